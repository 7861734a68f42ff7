"""`rlcli serve`: a policy (the base model or a checkpoint) behind the OpenAI-compatible endpoint
(generation/endpoint.py), sampled as rollouts sample: the recipe's engine, sampling settings and
context length, which a request's own temperature, top_p, max_tokens and stop replace. Nothing is stored."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlcli.errors import UsageError

if TYPE_CHECKING:
    from rlcli.generation.endpoint import Endpoint
    from rlcli.recipe import Recipe


def served_model_name(recipe: Recipe, folder: Path | None) -> str:
    """The name /v1/models gives: the recipe's model, and the checkpoint folder's name if one is served."""
    return recipe.model.name if folder is None else f"{recipe.model.name}@{folder.name}"


def start_endpoint(recipe: Recipe, folder: Path | None, port: int = 0) -> Endpoint:
    """The policy of `recipe` (with the checkpoint in `folder`; None: the base model) served on 127.0.0.1:port
    (0: a free port), started; the caller closes it."""
    from rlcli.generation.endpoint import Endpoint
    from rlcli.generation.engines import make_sampler
    from rlcli.generation.sampler import sampling_config
    from rlcli.models.loading import load_policy

    policy, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=folder, trainable=False)
    if tokenizer.chat_template is None:
        raise UsageError(
            f"{recipe.model.name} has no chat template, so it cannot answer chat messages; serve a chat model."
        )
    sampling = sampling_config(recipe.rollout)
    sampler = make_sampler(recipe, policy, tokenizer, sampling, base=folder is None, checkpoint_folder=folder)
    try:
        endpoint = Endpoint(
            sampler,
            tokenizer,
            served_model_name(recipe, folder),
            defaults=sampling,
            max_length=recipe.model.max_length,
            seed=recipe.run.seed,
            port=port,
        )
    except OSError as exc:  # the port is taken, or not ours to bind
        raise UsageError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc}).") from None
    return endpoint.start()
