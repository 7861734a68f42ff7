"""grpo.reference: the KL anchor is the SFT policy (a frozen second LoRA adapter) or the base model."""

from __future__ import annotations

import pytest
import torch

from helpers import make_ctx, write_recipe
from rlcli.engine.grpo import loss, update
from rlcli.engine.grpo.loop import run_grpo
from rlcli.engine.grpo.resume import reference_checkpoint, resume_point
from rlcli.errors import UsageError
from rlcli.models import loading
from rlcli.recipe import LoraSection, ModelSection, QuantizationSection, load_recipe
from rlcli.store.checkpoints import add_checkpoint, checkpoints

TINY = ModelSection(name="tiny-random", dtype="float32")
NO_QUANT = QuantizationSection()
LORA = LoraSection(r=4, alpha=8)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def make_sft_checkpoint(folder):
    """A LoRA adapter that differs from the base model (a fresh adapter's B is zero, which would
    make the SFT policy and the base indistinguishable)."""
    torch.manual_seed(1)
    model, tokenizer = loading.load_policy(TINY, LORA, NO_QUANT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return loading.save_checkpoint(model, tokenizer, folder)


def test_the_sft_reference_equals_the_sft_checkpoint_while_the_policy_trains(tmp_path):
    sft = make_sft_checkpoint(tmp_path / "sft")
    model, tokenizer = loading.load_policy(TINY, LORA, NO_QUANT, adapter=sft, trainable=True)
    loading.attach_reference(model, sft)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable), "only the policy's adapter trains"
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([tokenizer("What is 12 plus 30? The answer is 42.")["input_ids"]], device=model.device)

    model.train()
    for _ in range(2):  # the update's order: policy forward, reference forward, backward, step
        policy = token_logprobs(model, ids)
        with torch.no_grad(), loading.reference_context(model):
            reference = token_logprobs(model, ids)
        (-policy.mean()).backward()
        graded = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert graded and graded <= trainable, "gradients reach the trainable adapter only"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert model.training and model.active_adapter == "default"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    separate, _ = loading.load_policy(TINY, LORA, NO_QUANT, adapter=sft, trainable=False)
    base, _ = loading.load_policy(TINY, None, NO_QUANT, trainable=False)
    with torch.no_grad():
        expected = token_logprobs(separate, ids)
        torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)
        assert (token_logprobs(base, ids) - expected).abs().max() > 1e-2, "the SFT adapter is not the base"
        model.eval()
        assert (token_logprobs(model, ids) - expected).abs().max() > 1e-3, "the policy moved away from SFT"

    # A checkpoint holds the policy's adapter alone, not the frozen reference beside it.
    saved = loading.save_checkpoint(model, tokenizer, tmp_path / "policy")
    assert not (saved / loading.REFERENCE_ADAPTER).exists()


def test_a_full_fine_tuned_policy_cannot_take_the_sft_adapter(tmp_path):
    sft = make_sft_checkpoint(tmp_path / "sft")
    model, _ = loading.load_policy(TINY, None, NO_QUANT, trainable=True)
    with pytest.raises(UsageError, match="LoRA"):
        loading.attach_reference(model, sft)


def grpo_recipe(tmp_path, **grpo_options):
    return write_recipe(
        tmp_path / "r.yaml",
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
        grpo={"iterations": 1, "beta": 0.1, "drop_zero_var_groups": False, **grpo_options},
    )


def first_update_logprobs(monkeypatch):
    """The policy's and the reference's logprobs that the first loss of the run receives."""
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    policy_loss = loss.policy_loss

    def spy(logprobs, old, advantages, mask, **kwargs):
        seen.append((logprobs.detach().clone(), kwargs["ref_logprobs"].clone(), mask.clone()))
        return policy_loss(logprobs, old, advantages, mask, **kwargs)

    monkeypatch.setattr(update, "policy_loss", spy)  # as grpo/update.py calls it
    return seen


@pytest.mark.parametrize("reference", ["auto", "base"])
def test_grpo_anchors_its_kl_to_the_sft_checkpoint_by_default(tmp_path, monkeypatch, reference):
    recipe, runs = grpo_recipe(tmp_path, reference=reference), tmp_path / "runs"
    ctx = make_ctx(recipe, runs)
    sft = make_sft_checkpoint(ctx.run_dir / "checkpoints" / "sft")
    sft_id = add_checkpoint(ctx.store, "sft", 0, sft, "lora")
    seen = first_update_logprobs(monkeypatch)
    run_grpo(ctx)

    # Iteration 0 starts from the SFT checkpoint, so its first loss sees the policy equal to the
    # SFT reference, and different from the base.
    policy, ref, mask = seen[0]
    gap = float(((policy - ref).abs() * mask).max())
    if reference == "auto":
        assert gap < 1e-5
    else:
        assert gap > 1e-3
    _, state = resume_point(ctx)
    assert state["reference"] == (sft_id if reference == "auto" else None)


def test_a_resumed_run_keeps_its_reference(tmp_path):
    recipe, runs = grpo_recipe(tmp_path), tmp_path / "runs"
    ctx = make_ctx(recipe, runs)
    sft_id = add_checkpoint(ctx.store, "sft", 0, make_sft_checkpoint(ctx.run_dir / "sft"), "lora")
    run_grpo(ctx)
    _, state = resume_point(ctx)
    assert state["reference"] == sft_id

    # A later SFT checkpoint does not move the anchor of the GRPO run that started before it ...
    add_checkpoint(ctx.store, "sft", 0, make_sft_checkpoint(ctx.run_dir / "sft2"), "lora")
    assert reference_checkpoint(ctx, state).id == sft_id
    # ... a checkpoint from before rlcli recorded the anchor used the base model ...
    assert reference_checkpoint(ctx, {k: v for k, v in state.items() if k != "reference"}) is None
    # ... and a recipe that now names the other anchor is refused, saying which one the run has.
    ctx.recipe = load_recipe(recipe, ["grpo.reference=base"])
    with pytest.raises(UsageError, match="reference: sft"):
        reference_checkpoint(ctx, state)


def test_reference_sft_without_an_sft_checkpoint_is_refused(tmp_path):
    ctx = make_ctx(grpo_recipe(tmp_path, reference="sft"), tmp_path / "runs")
    with pytest.raises(UsageError, match="no SFT checkpoint"):
        reference_checkpoint(ctx, None)
    assert not checkpoints(ctx.store)
    assert reference_checkpoint(make_ctx(grpo_recipe(tmp_path), tmp_path / "runs2"), None) is None, "auto: base"
