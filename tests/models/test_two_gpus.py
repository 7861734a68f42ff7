"""Two visible GPUs: the Hugging Face Trainer that rlcli builds for SFT and for DPO trains on the recipe's one
device (model.device), never on every visible GPU through nn.DataParallel.

This CPU machine fakes the two GPUs: torch.cuda says it has two, and the two calls the trainers make on a GPU
while they are built (making cuda:0 the current device, TRL's telemetry asking its name) do nothing. The model
stays on the CPU: the Trainer's move of it to the training device is recorded, not made.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import make_ctx, write_recipe
from rlcli.engine import dpo, sft, sft_tokens
from rlcli.engine.pairs import PreferenceExample
from rlcli.engine.sft_data import Conversation

CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture
def policy():
    """The tiny-random policy with a LoRA adapter, on the CPU (a fresh one per test: DPO adds its reference
    adapter to it)."""
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    return load_policy(
        ModelSection(name="tiny-random", dtype="float32"), LoraSection(r=4, alpha=8), QuantizationSection()
    )


@pytest.fixture
def two_gpus(monkeypatch, policy) -> list[torch.device]:
    """Two visible CUDA GPUs, faked once the policy is loaded; gives the devices the Trainer moved the model to."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    moves: list[torch.device] = []
    monkeypatch.setattr(transformers.Trainer, "_move_model_to_device", lambda self, model, device: moves.append(device))
    return moves


def _sft_trainer(ctx, model, tokenizer):
    from rlcli.generation.hf_sampler import _eos_ids

    rows, _ = sft_tokens.encode_conversations(
        tokenizer, [Conversation(CHAT, "chat")] * 2, 512, _eos_ids(model, tokenizer)
    )
    return sft.build_trainer(ctx, model, tokenizer, rows, [], callbacks=[])


def _dpo_trainer(ctx, model, tokenizer):
    examples = [PreferenceExample([11, 12, 13], [5, 6], [1, 1], [7, 8], [1, 1])] * 2
    return dpo.build_trainer(ctx, model, None, tokenizer, examples, ctx.run_dir / "dpo", callbacks=[])


@pytest.mark.parametrize("build", [_sft_trainer, _dpo_trainer], ids=["sft", "dpo"])
@pytest.mark.parametrize(("device", "expected"), [("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_the_trainer_uses_the_recipe_s_one_gpu_and_no_data_parallel(
    tmp_path, policy, two_gpus, build, device, expected
):
    model, tokenizer = policy
    recipe = write_recipe(tmp_path / "r.yaml", model={"name": "tiny-random", "device": device, "dtype": "float32"})
    trainer = build(make_ctx(recipe, tmp_path / "runs"), model, tokenizer)

    assert trainer.args.n_gpu == 1
    # Where the Trainer puts the model and each batch, and where accelerate's dataloaders put them.
    assert trainer.args.device == torch.device(expected)
    assert two_gpus == [torch.device(expected)]
    if device == "cuda:1":
        assert trainer.accelerator.device == torch.device(expected)
    # The micro-batch is the recipe's, not one per visible GPU.
    assert trainer._train_batch_size == trainer.args.per_device_train_batch_size
    wrapped = trainer._wrap_model(trainer.model_wrapped)
    assert wrapped is trainer.model_wrapped and not isinstance(wrapped, torch.nn.DataParallel)
