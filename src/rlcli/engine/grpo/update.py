"""The GRPO update of one iteration: micro-batches, the policy's token logprobs, K epochs of clipped steps.

grpo/loop.py owns the loop (rollout, label, update, checkpoint); this module owns what happens
to a list of training sequences once their advantages are known.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlcli.engine.context import RunContext
from rlcli.engine.grpo.loss import check_finite, chunked_token_logprobs, policy_loss
from rlcli.errors import RlcliError
from rlcli.generation.sampler import sampling_config
from rlcli.generation.seeds import derive_seed
from rlcli.models import vision

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedModel

    from rlcli.recipe import GrpoSection, Recipe


@dataclass
class TrainSequence:
    """One training sequence: token ids, which of them are trainable, and their rollout logprobs."""

    episode_id: int
    group: int
    ids: list[int]
    mask: list[float]
    rollout_logprobs: list[float]
    turn_of_token: list[int]
    advantage: list[float] = field(default_factory=list)  # per token
    truncated: bool = False
    images: list[str] = field(default_factory=list)  # sha256 of the images in `ids`, in order (a VLM's)
    stale: bool = False  # sampled with weights older than those this update starts from (async GRPO)


@dataclass
class MicroBatch:
    """A micro-batch as the forward takes it (_collate): a shared prefix, forwarded once, then every
    row's suffix, left-padded; the [B, keep] tensors cover each row's last `keep` positions, which
    hold every trainable token."""

    prefix_ids: torch.Tensor | None  # [1, prefix]; None: every row is forwarded whole
    input_ids: torch.Tensor  # [B, width]
    attention_mask: torch.Tensor  # [B, prefix + width]
    position_ids: torch.Tensor | None  # None: an M-RoPE model (Qwen2-VL) computes its own 3-D positions
    pixels: dict[str, Any]  # a vision-language model's image inputs (empty for text)
    keep: int
    targets: torch.Tensor  # [B, keep] the token ids whose logprobs are computed
    mask: torch.Tensor  # [B, keep] 1 at trainable tokens
    advantages: torch.Tensor  # [B, keep]
    rollout_logprobs: torch.Tensor  # [B, keep] as the sampler recorded them
    positions: int  # positions the forward runs
    padding: int  # how many of them are padding


@dataclass
class _Tally:
    """An iteration's running statistics over its micro-batches."""

    totals: dict[str, float] = field(default_factory=dict)  # policy_loss's stats, weighted by tokens
    weight: float = 0.0  # the trainable tokens they were weighted by
    gap: float = 0.0  # |rollout logprob - the trainer's|, over the first epoch's trainable tokens
    forwarded: int = 0  # positions the training forwards ran
    padded: int = 0  # how many of them were padding
    grad_norms: list[float] = field(default_factory=list)  # one per optimizer step


def update(
    ctx: RunContext,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    sequences: list[TrainSequence],
    it: int,
    entropy_coef: float = 0.0,
) -> dict[str, float]:
    """grpo.epochs passes over `sequences` in shuffled minibatches (one optimizer step each), every
    minibatch forwarded in length-sorted micro-batches whose gradients accumulate; returns the
    iteration's train/ statistics and perf/pad_frac. entropy_coef: the entropy bonus's (grpo.entropy_target).
    Only ctx.recipe is read."""
    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    temperature = sampling_config(recipe.rollout).logprob_temperature
    n_mb = minibatches_per_epoch(recipe)
    check_output_head(model, sequences[0].ids[:16])
    pictures = sequence_pictures(ctx, sequences)
    needs_old = cfg.epochs > 1 or n_mb > 1
    old_logprobs = (
        sequence_logprobs(model, sequences, cfg.micro_batch_size, temperature, not cfg.gradient_checkpointing, pictures)
        if needs_old
        else None
    )
    max_len_norm = recipe.rollout.max_new_tokens * recipe.env.horizon(it)
    tally = _Tally()
    for epoch in range(cfg.epochs):
        gen = torch.Generator().manual_seed(derive_seed(recipe.run.seed, "shuffle", it, epoch))
        order = torch.randperm(len(sequences), generator=gen).tolist()
        size = math.ceil(len(order) / n_mb)
        for mb_start in range(0, len(order), size):
            mb = order[mb_start : mb_start + size]
            mb_tokens = sum(sum(sequences[i].mask) for i in mb)
            mb_seqs = sum(1 for i in mb if any(sequences[i].mask))
            optimizer.zero_grad(set_to_none=True)
            for micro_idx in micro_batches(sequences, mb, cfg.micro_batch_size):
                micro = [sequences[i] for i in micro_idx]
                if not any(any(s.mask) for s in micro):
                    continue  # nothing to train on: it would add 0 to the gradient and to every statistic
                batch = _collate(micro, model, share_prefix=not cfg.gradient_checkpointing, pictures=pictures)
                olds = [old_logprobs[i] for i in micro_idx] if old_logprobs is not None else None
                loss = _micro_loss(
                    cfg, model, batch, micro, olds, temperature, entropy_coef, max_len_norm, epoch, tally
                )
                # Scale so that accumulated micro-batch gradients equal the minibatch's gradient.
                if cfg.aggregation == "token_mean":
                    share = float(batch.mask.sum()) / max(mb_tokens, 1.0)
                else:
                    share = sum(1 for s in micro if any(s.mask)) / max(mb_seqs, 1)
                (loss * share).backward()
            _step(cfg, model, optimizer, scheduler, it, tally)
    optimizer.zero_grad(set_to_none=True)
    out = {f"train/{k}": v / max(tally.weight, 1.0) for k, v in tally.totals.items() if k != "tokens"}
    out["train/tokens"] = sum(sum(s.mask) for s in sequences)
    out["train/engine_logprob_gap"] = tally.gap / max(out["train/tokens"], 1)
    out["train/grad_norm"] = sum(tally.grad_norms) / len(tally.grad_norms)
    out["perf/pad_frac"] = tally.padded / max(tally.forwarded, 1)
    return out


def _micro_loss(
    cfg: GrpoSection,
    model: PreTrainedModel,
    batch: MicroBatch,
    micro: list[TrainSequence],
    olds: list[torch.Tensor] | None,
    temperature: float,
    entropy_coef: float,
    max_len_norm: int,
    epoch: int,
    tally: _Tally,
) -> torch.Tensor:
    """One micro-batch's clipped loss (olds: its sequences' logprobs before the update; None: the
    first forward's own, detached), its statistics added to `tally`."""
    tally.forwarded += batch.positions
    tally.padded += batch.padding
    logprobs, entropy = token_logprobs(model, batch, temperature, entropy=True)
    old = _collate_values(olds, batch) if olds is not None else logprobs.detach()
    if epoch == 0:  # `old` is the trainer's logprob under the weights that sampled the rollout
        tally.gap += float(((old - batch.rollout_logprobs).abs() * batch.mask).sum())
    ref = None
    if cfg.beta > 0:
        from rlcli.models.loading import reference_context

        with torch.no_grad(), reference_context(model):
            ref, _ = token_logprobs(model, batch, temperature)
    behaviour, tis_cap = _behaviour_logprobs(cfg, batch.rollout_logprobs, old, micro)
    loss, st = policy_loss(
        logprobs,
        old,
        batch.advantages,
        batch.mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        importance=cfg.importance,
        aggregation=cfg.aggregation,
        ref_logprobs=ref,
        beta=cfg.beta,
        rollout_logprobs=behaviour,
        tis_cap=tis_cap,
        entropy=entropy,
        entropy_top_frac=cfg.entropy_top_frac,
        entropy_coef=entropy_coef,
        max_len_norm=max_len_norm,
    )
    check_finite("the loss", loss)
    w = float(batch.mask.sum())
    tally.weight += w
    for k, v in st.items():
        tally.totals[k] = tally.totals.get(k, 0.0) + float(v) * w
    return loss


def _step(
    cfg: GrpoSection,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    it: int,
    tally: _Tally,
) -> None:
    """The minibatch's optimizer step, its gradient clipped at grpo.max_grad_norm; a non-finite
    gradient stops the update before it reaches the weights."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise RlcliError(
            f"Iteration {it}: the gradient norm is {float(grad_norm)}; the update was stopped before the "
            "optimizer step (try a lower grpo.lr or float32)."
        )
    tally.grad_norms.append(float(grad_norm))
    optimizer.step()
    scheduler.step()


def _behaviour_logprobs(
    cfg: GrpoSection, rollout_logprobs: torch.Tensor, old: torch.Tensor, micro: list[TrainSequence]
) -> tuple[torch.Tensor, float | None]:
    """(the logprobs policy_loss weighs `old` against, its tis_cap). Asynchronous GRPO (decoupled PPO, see
    grpo/worker.py): `old` is the proximal policy and a stale sequence's recorded rollout
    logprobs are its behaviour policy's, so it gets the weight pi_prox / pi_behav, truncated at tis_cap
    (ASYNC_TIS_CAP when null); without tis_cap a fresh sequence is on-policy and weighs exactly 1.
    A replayed episode (grpo.replay) counts as stale: its behaviour policy is the one that played it, and
    so does a group that grpo.dynamic_sampling carried from an earlier iteration."""
    carries = cfg.dynamic_sampling and cfg.carry_staleness > 0
    if not (cfg.max_staleness or cfg.replay is not None or carries) or cfg.tis_cap is not None:
        return rollout_logprobs, cfg.tis_cap
    from rlcli.engine.grpo.staleness import ASYNC_TIS_CAP

    stale = torch.tensor([[s.stale] for s in micro], device=old.device)
    return torch.where(stale, rollout_logprobs, old), ASYNC_TIS_CAP


def micro_batches(sequences: list[TrainSequence], indices: list[int], size: int) -> list[list[int]]:
    """`indices` (a minibatch, in its shuffled order) in micro-batches of `size`, longest first, so that
    the rows forwarded together have similar lengths and little padding. The minibatch, and so its
    gradient, is the same in any order; the sort is stable, so the split depends on the seed alone."""
    ranked = sorted(indices, key=lambda i: -len(sequences[i].ids))
    return [ranked[k : k + size] for k in range(0, len(ranked), size)]


def padding(micro: list[TrainSequence], prefix: int) -> tuple[int, int]:
    """(positions the micro-batch's forward runs, how many of them are padding): the shared prefix
    once, then every row at the width of the longest suffix."""
    width = max(len(s.ids) for s in micro) - prefix
    return prefix + len(micro) * width, sum(width - (len(s.ids) - prefix) for s in micro)


def sequence_pictures(ctx: RunContext, sequences: list[TrainSequence]) -> dict[str, Any]:
    """sha256 -> PIL image of every image the sequences show, from the run database (a VLM's rollouts)."""
    hashes = [h for s in sequences for h in s.images]
    if not hashes:
        return {}
    from rlcli.models.vision import image_from_png
    from rlcli.store.images import load_images

    stored = load_images(ctx.rundb, hashes)
    missing = set(hashes) - set(stored)
    if missing:
        raise RlcliError(f"{len(missing)} image(s) of the episodes to train on are missing from the run database.")
    return {sha: image_from_png(data) for sha, data in stored.items()}


def _collate(
    micro: list[TrainSequence],
    model: PreTrainedModel,
    share_prefix: bool = True,
    pictures: dict[str, Any] | None = None,
) -> MicroBatch:
    """A micro-batch as one shared prefix (forwarded once) plus left-padded suffixes; only the
    positions that end in trainable tokens are kept. share_prefix=False (gradient checkpointing,
    which cannot return a KV cache) forwards every row whole.

    Rows with images (a vision-language model's) are forwarded whole too, the pixels rebuilt from the
    stored images (`pictures`): a prefix forwarded alone would need its images' features computed
    apart from the rows', and a group's screenshots differ right after the shared system prompt.
    An M-RoPE model (Qwen2-VL) gets no position_ids then: its forward computes the 3-D positions of
    the image tokens from the image grids and the attention mask (left padding skipped)."""
    from rlcli.models.vision import pixel_inputs, processor_of

    device = next(model.parameters()).device
    images = [(pictures or {})[h] for s in micro for h in s.images]
    prefix = _shared_prefix(micro) if share_prefix and not images else 0
    width = max(len(s.ids) for s in micro) - prefix
    # The first trainable token over the batch, measured from the right: logits before it are not needed.
    keep = (
        max(len(s.ids) - next(i for i, m in enumerate(s.mask) if m) for s in micro if any(s.mask))
        if any(any(s.mask) for s in micro)
        else 1
    )
    B = len(micro)
    positions, padded = padding(micro, prefix)
    ids = torch.zeros((B, width), dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, keep))
    adv = torch.zeros((B, keep))
    roll = torch.zeros((B, keep))
    for b, s in enumerate(micro):
        n = len(s.ids) - prefix
        ids[b, width - n :] = torch.tensor(s.ids[prefix:])
        attn[b, width - n :] = 1
        tail = slice(max(len(s.ids) - keep, 0), len(s.ids))
        k = tail.stop - tail.start
        mask[b, keep - k :] = torch.tensor(s.mask[tail])
        if s.advantage:  # none yet when only logprobs are wanted (a distill teacher's, grpo/teacher.py)
            adv[b, keep - k :] = torch.tensor(s.advantage[tail])
        roll[b, keep - k :] = torch.tensor(s.rollout_logprobs[tail])
    # Padding sits between the prefix and each suffix; the mask hides it and positions skip it.
    pos = prefix + (attn.cumsum(-1) - 1).clamp(min=0)
    attn = torch.cat([torch.ones((B, prefix), dtype=torch.long), attn], dim=-1)
    ids = ids.to(device)
    pixels = pixel_inputs(processor_of(model), images, model, input_ids=ids) if images else {}
    return MicroBatch(
        prefix_ids=torch.tensor([micro[0].ids[:prefix]], device=device) if prefix else None,
        input_ids=ids,
        attention_mask=attn.to(device),
        position_ids=None if "mm_token_type_ids" in pixels else pos.to(device),
        pixels=pixels,
        keep=keep,
        targets=ids[:, width - keep :].to(device),
        mask=mask.to(device),
        advantages=adv.to(device),
        rollout_logprobs=roll.to(device),
        positions=positions,
        padding=padded,
    )


def _shared_prefix(micro: list[TrainSequence], minimum: int = 16) -> int:
    """How many leading tokens every sequence shares (the group's prompt, often the system prompt
    of every task), stopping two tokens before the first trainable one so that every logit the
    loss needs comes from the per-row forward. 0 when sharing is not worth a separate forward."""
    if len(micro) < 2:
        return 0
    limit = min(next((i for i, m in enumerate(s.mask) if m), len(s.ids)) for s in micro) - 1
    first = micro[0].ids
    n = 0
    while n < limit and all(len(s.ids) > n and s.ids[n] == first[n] for s in micro):
        n += 1
    return n if n >= minimum else 0


def _collate_values(values: list[torch.Tensor], batch: MicroBatch) -> torch.Tensor:
    """Per-row values (each row's tail, as sequence_logprobs keeps them) laid out as the batch's [B, keep] tensors."""
    keep = batch.keep
    out = torch.zeros((len(values), keep), device=batch.mask.device)
    for b, v in enumerate(values):
        tail = v[-keep:]
        out[b, keep - len(tail) :] = tail
    return out


# Positions whose float32 logits exist at once: 2**24 values (64 MiB; a few temporaries of that size
# live with them), ~110 positions of a 151,936-token vocabulary, whatever the micro-batch's size (the
# backward recomputes them per chunk). Still enough rows for the LM head's matmul to run at speed.
LOGIT_CHUNK_VALUES = 2**24


def token_logprobs(
    model: PreTrainedModel, batch: MicroBatch, temperature: float, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, keep] logprobs of each row's tokens at its trainable positions (0 elsewhere: the loss never
    reads them) and, with entropy=True, the entropy of the policy there (detached).

    From the final hidden states through the LM head, a chunk of positions at a time
    (loss.py's chunked_token_logprobs): no [tokens, vocab] tensor for the micro-batch, in the forward or
    the backward. Positions that are not trainable (prompts, env observations) never meet the head."""
    hidden = _hidden_states(model, batch)
    live = batch.mask > 0
    head = output_head(model)
    config = _unwrap(model).config
    vocab = config.get_text_config().vocab_size
    slots = vision.slot_token_ids(config)  # as the samplers, which never draw them
    logp, ent = chunked_token_logprobs(
        hidden[live],
        head,
        batch.targets[live],
        chunk_size=max(1, LOGIT_CHUNK_VALUES // vocab),
        temperature=temperature,
        entropy=entropy,
        unwritable=torch.tensor(slots, device=live.device) if slots else None,
    )
    zeros = torch.zeros(live.shape, device=live.device)
    return zeros.masked_scatter(live, logp), (zeros.masked_scatter(live, ent) if ent is not None else None)


def _unwrap(model: PreTrainedModel) -> PreTrainedModel:
    """The transformers model under a peft wrapper (its LoRA layers in place), or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)  # a PeftModel's
    return get_base_model() if get_base_model is not None else model


def _hidden_states(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict the last `keep` tokens of each row ([B, keep, H]),
    from the model's body (what its forward runs before the LM head). A shared prefix is forwarded once
    and its KV cache repeated for every row; gradients flow through it to all rows."""
    body = _unwrap(model).base_model
    cache = None
    if batch.prefix_ids is not None:
        cache = body(input_ids=batch.prefix_ids, use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch.input_ids.shape[0])
    out = body(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        past_key_values=cache,
        use_cache=cache is not None,
        **batch.pixels,
    )
    return out.last_hidden_state[:, -batch.keep - 1 : -1]


def output_head(model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden states -> logits as the model's own forward computes them: its LM head, then the logit
    scaling or soft-capping some families apply after it (Granite, Cohere, Gemma 2/3).
    check_output_head compares it with the model's forward, for families that do something else."""
    inner = _unwrap(model)
    config = inner.config.get_text_config()
    lm_head = inner.get_output_embeddings()
    scaling = getattr(config, "logits_scaling", None)
    scale = getattr(inner, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        if scaling is not None:
            logits = logits / scaling
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return head


def check_output_head(model: PreTrainedModel, ids: list[int]) -> None:
    """Stop before training if output_head's logits differ from the model's forward on `ids` (a model
    family that transforms its logits in a way rlcli does not know would get wrong logprobs)."""
    was_training = model.training
    model.eval()  # no dropout, so both forwards see the same weights
    try:
        with torch.no_grad():
            x = torch.tensor([ids], device=next(model.parameters()).device)
            expected = model(input_ids=x).logits.float()
            got = output_head(model)(_unwrap(model).base_model(input_ids=x).last_hidden_state).float()
    finally:
        model.train(was_training)
    if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
        raise RlcliError(
            f"{type(_unwrap(model)).__name__}: the logits of its LM head differ from its forward's "
            f"(by up to {float((got - expected).abs().max()):.3g}); rlcli cannot compute its token logprobs."
        )


def sequence_logprobs(
    model: PreTrainedModel,
    sequences: list[TrainSequence],
    micro_batch_size: int,
    temperature: float,
    share_prefix: bool,
    pictures: dict[str, Any] | None = None,
) -> list[torch.Tensor]:
    """Logprobs of every sequence under the weights at the start of the iteration (PPO's pi_old),
    left on the model's device (0 at positions that are not trainable)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    with torch.no_grad():
        for micro_idx in micro_batches(sequences, list(range(len(sequences))), micro_batch_size):
            micro = [sequences[i] for i in micro_idx]
            batch = _collate(micro, model, share_prefix, pictures)
            lp, _ = token_logprobs(model, batch, temperature)
            for b, i in enumerate(micro_idx):
                n = min(len(sequences[i].ids), batch.keep)
                out[i] = lp[b, batch.keep - n :]
    return out


def minibatches_per_epoch(recipe: Recipe) -> int:
    episodes = recipe.rollout.tasks * recipe.rollout.group_size
    size = recipe.grpo.minibatch_size or episodes
    return max(1, math.ceil(episodes / size))
