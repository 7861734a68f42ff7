"""How stale an episode is: the updates between the weights that sampled it and those being updated
(0 in the synchronous loop), read from its stored policy; and setting aside a rollout stage's episodes
that are staler than grpo.max_staleness allows (after a resume that lowered it).
grpo/worker.py's module docstring says how the asynchronous loop produces stale episodes."""

from __future__ import annotations

from rlcli.engine.context import RunContext
from rlcli.store.names import (
    BASE,
    SFT,
    LabelStage,
    PolicyRef,
    StageNameError,
    grpo_label_stage,
    rollout_stage,
    try_parse_stage,
)

# The truncation of the staleness correction's importance weights when grpo.tis_cap is null: a token
# whose probability rose more than 2x since it was sampled counts at most twice.
ASYNC_TIS_CAP = 2.0


START_VERSION = -1


STALE_EVENT = "stale_rollouts"


def policy_version(policy: str) -> int | None:
    """The iteration whose weights an episode of GRPO's loop was sampled with, from its stored policy:
    train/<v> -> v, base or sft (the starting point) -> -1; None for any other policy (an older rlcli's)."""
    try:
        ref = PolicyRef.parse(policy)
    except StageNameError:
        return None
    if ref.kind == "train":
        return ref.number
    return START_VERSION if ref in (BASE, SFT) else None


def staleness(it: int, policy: str) -> int:
    """Updates between the weights that sampled an episode (its stored policy) and those iteration `it`
    updates; 0 when unknown."""
    version = policy_version(policy)
    return 0 if version is None else it - 1 - version


def set_aside_stale(ctx: RunContext, it: int, bound: int) -> int:
    """Set aside rollout/it's episodes staler than `bound` (see the module docstring); return how many."""
    from rlcli.store.episodes import set_aside_episodes, stage_episodes
    from rlcli.store.events import add_event

    stage = rollout_stage(it)
    stale = [e for e in stage_episodes(ctx.store, stage) if staleness(it, e.policy) > bound]
    if not stale:
        return 0
    ids = [e.id for e in stale if e.id is not None]
    assert len(ids) == len(stale)  # read from the database: every stored episode has its id
    aside = set_aside_episodes(ctx.store, stage, ids)
    # The stage plays them again; its labels (GRPO's, and any `rlcli label` set's) must cover the new ones.
    for row in ctx.store.stages():
        if row.done and _labels_or_plays(row.name, it):
            ctx.store.mark_stage(row.name, "pending")
    worst = max(staleness(it, e.policy) for e in stale)
    message = (
        f"{len(stale)} episodes of {stage} were sampled up to {worst} updates before iteration {it} and "
        f"grpo.max_staleness is {bound}: set aside as {aside} and played again"
    )
    add_event(ctx.store, stage, it, STALE_EVENT, message, {"episodes": len(stale), "moved_to": aside})
    ctx.console.print(f"train grpo: {message}.", highlight=False)
    return len(stale)


def _labels_or_plays(name: str, it: int) -> bool:
    """Whether stage `name` is rollout/it, its GRPO labels label/it, or an `rlcli label` set's labels of it."""
    parsed = try_parse_stage(name)
    labelled = isinstance(parsed, LabelStage) and parsed.stage == rollout_stage(it)
    return labelled or name in (rollout_stage(it), grpo_label_stage(it))
