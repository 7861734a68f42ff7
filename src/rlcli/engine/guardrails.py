"""Run-time warnings about GRPO going wrong, raised while it trains and stored as run events.

Each check is a pure function of per-iteration metric series ({iteration: value}, as the metrics
table holds them) that says whether a warning starts at iteration `it`. A warning is raised where
its condition starts to hold, not again while it goes on holding, so a long bad stretch is one
event; `check` reads the series from the store after an iteration's metrics (and its held-out
eval, with grpo.eval_every) are in, stores each new warning (store/events.py: one per kind and
iteration, so a resumed iteration does not repeat it) and returns it for the caller to print.

The warnings (docs/reporting.md):
- reward_up_heldout_down: over the last 3 held-out evals, held-out success never rose and fell by
  at least HELDOUT_DROP in all, while the train reward averaged between the last two evals is
  above its average between the two before: the policy is learning the reward, not the task.
- worse_than_start: a GRPO checkpoint's held-out success is below the starting point's (the SFT
  checkpoint, else the base model) beyond noise: the upper end of its 95% Wilson interval is below
  the starting point's success rate.
- entropy_collapse: train/entropy fell below grpo.min_entropy.
- no_signal: every group had equal rewards (train/zero_var_groups == train/groups) for
  grpo.zero_signal_patience iterations in a row: no advantages, nothing to learn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcli.engine.context import RunContext
from rlcli.store.checkpoints import checkpoints
from rlcli.store.events import add_event
from rlcli.store.names import SFT_STAGE, train_stage

REWARD = "rollout/reward_mean"
ENTROPY = "train/entropy"
ZERO_VAR = "train/zero_var_groups"
GROUPS = "train/groups"
HELDOUT = "eval/success_rate"  # logged by grpo.eval_every's evals; the starting point's at iteration -1
WINDOW = 3  # held-out evals that reward_up_heldout_down looks at
HELDOUT_DROP = 0.05  # the least fall of held-out success over that window that it reports

Series = dict[int, float]


@dataclass(frozen=True)
class RunWarning:
    kind: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


# --- the checks -------------------------------------------------------------------------


def reward_up_heldout_down(reward: Series, heldout: Series, it: int, run: str) -> RunWarning | None:
    """Train reward rising while held-out success falls, judged at the held-out eval of iteration `it`
    of run `run` (named in the advice)."""
    evals = sorted(step for step in heldout if step <= it)
    if it not in heldout or _reward_hacking_at(reward, heldout, evals[:-1]) is not None:
        return None
    found = _reward_hacking_at(reward, heldout, evals)
    if found is None:
        return None
    window, before, after = found
    rates = ", ".join(f"{heldout[s]:.2f}" for s in window)
    return RunWarning(
        "reward_up_heldout_down",
        f"Train reward is rising ({before:.3f} -> {after:.3f}) while held-out success falls ({rates} at "
        f"iterations {', '.join(_iteration(s) for s in window)}): the policy may be learning to game the "
        f"reward rather than the task. Read the best-rewarded episodes (`rlcli runs episodes {run} --best`), "
        "make the reward pay only for a right answer, and keep the best checkpoint (grpo.keep_best: true).",
        {"iterations": window, "heldout": [heldout[s] for s in window], "reward_before": before, "reward_after": after},
    )


def _reward_hacking_at(reward: Series, heldout: Series, evals: list[int]) -> tuple[list[int], float, float] | None:
    """(the window's eval iterations, mean reward between its first two evals, between its last two)
    when the condition holds over the last WINDOW of `evals`, else None."""
    if len(evals) < WINDOW:
        return None
    window = evals[-WINDOW:]
    rates = [heldout[s] for s in window]
    falling = all(b <= a for a, b in zip(rates, rates[1:])) and rates[0] - rates[-1] >= HELDOUT_DROP
    before = _mean([v for s, v in reward.items() if window[-3] < s <= window[-2]])
    after = _mean([v for s, v in reward.items() if window[-2] < s <= window[-1]])
    if not falling or before is None or after is None or after <= before:
        return None
    return window, before, after


def worse_than_start(heldout: Series, it: int, episodes: int, start: str) -> RunWarning | None:
    """Held-out success of iteration `it`'s checkpoint below the starting point's (iteration -1)
    beyond noise; `episodes` is how many episodes each held-out success rate is over."""
    if it not in heldout or -1 not in heldout or episodes <= 0:
        return None
    previous = [s for s in heldout if 0 <= s < it]
    if previous and _below(heldout[max(previous)], heldout[-1], episodes):
        return None  # already reported while it lasts
    if not _below(heldout[it], heldout[-1], episodes):
        return None
    low, high = _wilson(heldout[it], episodes)
    return RunWarning(
        "worse_than_start",
        f"Held-out success after iteration {it} is {heldout[it]:.2f} (95% CI {low:.2f}-{high:.2f} over {episodes} "
        f"episodes), below the {start} policy's {heldout[-1]:.2f}: GRPO is making the {start} policy worse. "
        + (
            "Anchor it to SFT (grpo.beta > 0 with grpo.reference: sft), lower grpo.lr, "
            if start == "sft"
            else "Lower grpo.lr, add a KL anchor (grpo.beta > 0), "
        )
        + "check the reward for loopholes, and keep the best checkpoint (grpo.keep_best: true).",
        {
            "heldout": heldout[it],
            "ci_low": low,
            "ci_high": high,
            "episodes": episodes,
            "start": start,
            "start_heldout": heldout[-1],
        },
    )


def _below(rate: float, reference: float, episodes: int) -> bool:
    return _wilson(rate, episodes)[1] < reference


def _wilson(rate: float, episodes: int) -> tuple[float, float]:
    from rlcli.engine.evaluate import wilson_interval

    return wilson_interval(round(rate * episodes), episodes)


def entropy_collapse(entropy: Series, it: int, min_entropy: float) -> RunWarning | None:
    """The policy's mean token entropy falling below `min_entropy` nats at iteration `it`."""
    if min_entropy <= 0 or it not in entropy or entropy[it] >= min_entropy:
        return None
    earlier = [s for s in entropy if s < it]
    if earlier and entropy[max(earlier)] < min_entropy:
        return None  # already reported while it lasts
    return RunWarning(
        "entropy_collapse",
        f"The policy's entropy fell to {entropy[it]:.3f} nats per token (grpo.min_entropy is {min_entropy:g}): "
        "its replies are nearly deterministic, so a group's samples stop differing and GRPO stops learning. "
        "Try a higher rollout.temperature, a lower grpo.lr, or a KL anchor (grpo.beta > 0).",
        {"entropy": entropy[it], "min_entropy": min_entropy},
    )


def no_signal(zero_var: Series, groups: Series, it: int, patience: int) -> RunWarning | None:
    """Every group with equal rewards for `patience` iterations in a row, ending at iteration `it`."""
    if patience <= 0:
        return None
    streak, step = 0, it
    while step in groups and groups[step] > 0 and zero_var.get(step) == groups[step]:
        streak, step = streak + 1, step - 1
    if streak != patience:  # once per run of such iterations, when it reaches the patience
        return None
    return RunWarning(
        "no_signal",
        f"GRPO is getting no signal: the tasks are too hard or too easy for the current policy. Every group "
        f"had equal rewards for {patience} iterations in a row ({it - patience + 1}-{it}), so no advantages "
        "and nothing to learn. Try a higher rollout.temperature or a larger rollout.group_size (more varied "
        "replies per task); SFT first (an sft: section) if it never succeeds; easier tasks (env.kwargs) or a "
        "curriculum; a partial-credit reward if successes are rare.",
        {"iterations": list(range(it - patience + 1, it + 1)), "groups": groups[it]},
    )


# --- from the store -------------------------------------------------------------------------


def warnings_at(ctx: RunContext, it: int) -> list[RunWarning]:
    """Every check on the run's metrics up to iteration `it` (later ones, left by an interrupted
    run that this one is redoing, are not read)."""
    cfg = ctx.recipe.grpo

    def series(key: str) -> Series:
        return {m.step: m.value for m in ctx.store.metrics(key) if m.step <= it}

    heldout = series(HELDOUT)
    eval_tasks = cfg.eval_tasks or ctx.recipe.eval.tasks  # the tasks grpo.eval_every's evals play
    start = "sft" if any(c.stage == SFT_STAGE for c in checkpoints(ctx.store)) else "base"
    found = [
        reward_up_heldout_down(series(REWARD), heldout, it, ctx.run),
        worse_than_start(heldout, it, eval_tasks * ctx.recipe.eval.k, start),
        entropy_collapse(series(ENTROPY), it, cfg.min_entropy),
        no_signal(series(ZERO_VAR), series(GROUPS), it, cfg.zero_signal_patience),
    ]
    return [w for w in found if w is not None]


def check(ctx: RunContext, it: int) -> list[RunWarning]:
    """Store the warnings that start at iteration `it` as run events; return those not stored before."""
    return [w for w in warnings_at(ctx, it) if add_event(ctx.store, train_stage(it), it, w.kind, w.message, w.details)]


# --- helpers --------------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _iteration(step: int) -> str:
    return "start" if step < 0 else str(step)
