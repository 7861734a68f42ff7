"""Which engine generates (hf or vllm: rollout.engine, with auto resolved) and the policy's sampler on it.

The choice reads the model's config.json (its attention head size, whether it is a vision-language
model) and what is installed, without importing vllm, which takes seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rlcli.errors import UsageError
from rlcli.generation.sampler import Sampler, SamplingConfig
from rlcli.models import vision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.models.loading import PolicyModel
    from rlcli.recipe import Recipe

# vLLM's CPU attention kernels take these head sizes only (vllm-cpu 0.32,
# CPUAttentionBackend.get_supported_head_sizes; tests/models/test_vllm_engine.py checks the copy). Kept here so
# that `auto` can decide without importing vllm, which takes seconds.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def generation_engine(recipe: Recipe) -> str:
    """hf or vllm: rollout.engine, with auto resolved (see its description in the recipe)."""
    import importlib.util

    cfg = recipe.rollout
    model_type = vision.vision_model_type(resolve_model_folder(recipe.model.name))
    # vLLM's Qwen2-VL family imports transformers' torchvision image processor.
    needs_torchvision = model_type in vision.MROPE_FAMILIES and importlib.util.find_spec("torchvision") is None
    if cfg.engine == "vllm" and needs_torchvision:
        raise UsageError(
            f"rollout.engine vllm: vLLM's {model_type} model needs torchvision, which is not installed; install "
            "the torchvision build that matches your torch, or set rollout.engine: hf."
        )
    if cfg.engine == "hf":
        return "hf"
    from rlcli.models.loading import resolve_device

    on_cuda = resolve_device(cfg.device or recipe.model.device).startswith("cuda")
    head_size = _head_size(recipe.model.name)
    if cfg.vllm_quantization == "fp8" and not on_cuda and cfg.engine == "vllm":
        raise UsageError(
            "rollout.vllm_quantization fp8: vLLM quantises to FP8 on CUDA GPUs only, and this engine runs on the "
            "CPU; set rollout.vllm_quantization: auto or none."
        )
    if cfg.engine == "vllm":
        # Refused here, before any work: vLLM would fail only once its engine had started.
        if not on_cuda and head_size is not None and head_size not in VLLM_CPU_HEAD_SIZES:
            raise UsageError(
                f"rollout.engine vllm: vLLM's CPU build cannot serve {recipe.model.name} (attention head size "
                f"{head_size}; it takes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); set rollout.engine: hf."
            )
        return "vllm"
    if cfg.top_k != 0 or cfg.top_p != 1 or importlib.util.find_spec("vllm") is None or needs_torchvision:
        return "hf"
    if on_cuda:
        from rlcli.generation.memory_plan import plan_on_this_machine

        # The memory plan picks the HF sampler where vLLM's share cannot fit beside the trainer.
        plan = plan_on_this_machine(recipe, [])
        return "vllm" if plan is None else plan.choices.engine
    if model_type is not None:
        return "hf"  # not measured against the HF sampler on a CPU, unlike text models (below)
    # On a CPU vLLM ran the quickstart 1.37x faster than the HF sampler, start-up and syncs included.
    return "vllm" if head_size in VLLM_CPU_HEAD_SIZES else "hf"


def resolve_model_folder(model_name: str) -> Path:
    from rlcli.models.cache import resolve_model

    return Path(resolve_model(model_name))


def _head_size(model_name: str) -> int | None:
    """The attention head size from the model's config.json (no weights loaded); None if unknown."""
    path = resolve_model_folder(model_name) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)  # a vision-language model's language part
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return config["hidden_size"] // config["num_attention_heads"]
    return None


def make_sampler(
    recipe: Recipe,
    model: PolicyModel,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingConfig,
    *,
    base: bool,
    checkpoint_folder: str | os.PathLike | None = None,
) -> Sampler:
    """The policy's Sampler on the recipe's engine; base: model is the recipe's model unchanged.

    The vLLM engine is the process's shared one (see vllm_engine.policy_engine), given model's weights.
    checkpoint_folder: where model was loaded from, if from a checkpoint (adapter-only sync serves it).
    """
    if generation_engine(recipe) == "hf":
        from rlcli.generation.hf_sampler import HfSampler

        return HfSampler(model, tokenizer, sampling)
    from rlcli.generation.vllm_engine import VllmSampler, policy_engine

    engine = policy_engine(recipe, model, base=base, adapter_folder=checkpoint_folder)
    processor = vision.processor_of(tokenizer)
    slots = vision.slot_token_ids(model.config) if processor is not None else []
    # transformers types convert_ids_to_tokens str | list[str], without overloads: a list of ids gives a list.
    unwritable = cast("list[str]", tokenizer.convert_ids_to_tokens(slots))
    return VllmSampler(engine, sampling, processor=processor, unwritable=unwritable)
