"""`rlcli eval`: checkpoints on the held-out task split, with confidence intervals and pass@k.

Eval tasks use the env's eval seeds (disjoint from training seeds by construction). Each
checkpoint's episodes are a stage of the run (`eval/base`, `eval/ckpt-7`), so an interrupted
evaluation resumes and a finished one is never repeated. With grpo.eval_every, train grpo runs the
same stages as it trains (TrainingEvals).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rlcli.engine.context import RunContext
from rlcli.engine.games import resolve_opponent
from rlcli.engine.rollout import collect
from rlcli.generation.engines import make_sampler
from rlcli.generation.sampler import Sampler, sampling_config
from rlcli.store.checkpoints import checkpoint_note, resolve_checkpoint
from rlcli.store.db import now
from rlcli.store.episodes import sampled_token_entropy, stage_episodes
from rlcli.store.evals import eval_decoding, eval_result, leading_tasks_success, replace_eval
from rlcli.store.names import EXPERT, SFT, SFT_STAGE, PolicyRef, eval_stage
from rlcli.store.records import Checkpoint, EndReason, Episode, EvalResult

if TYPE_CHECKING:
    from rlcli.recipe import Recipe


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (well-behaved at 0% and 100%)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """Normal interval for the mean of per-task success rates (k > 1 samples are not independent)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return 0.0, 1.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n))


def eval_metrics(episodes: list[Episode], k: int) -> dict[str, Any]:
    """Success rate with a 95% CI, pass@k / avg@k and means, from a stage's episodes.

    A failed episode (the env failed, not the policy) says nothing about the policy: every measure
    is over the episodes that ran, and the failures are counted beside them in details.
    """
    ran = [ep for ep in episodes if ep.status == "ok"]
    per_task: dict[int, list[Episode]] = defaultdict(list)
    for ep in ran:
        per_task[ep.task_index].append(ep)
    task_rates = [sum(e.success for e in eps) / len(eps) for eps in per_task.values()]
    successes = sum(e.success for e in ran)
    n = len(ran)
    rate = successes / n if n else 0.0
    ci = wilson_interval(successes, n) if k == 1 else mean_interval(task_rates)
    passes = {}
    for j in sorted({1, k}):
        sampled_enough = [eps for eps in per_task.values() if len(eps) >= j]
        if sampled_enough:
            passes[f"pass@{j}"] = sum(
                pass_at_k(len(eps), sum(e.success for e in eps), j) for eps in sampled_enough
            ) / len(sampled_enough)
    return {
        "tasks": len({ep.task_index for ep in episodes}),
        "k": k,
        "success_rate": rate,
        "ci_low": ci[0],
        "ci_high": ci[1],
        "mean_return": sum(e.env_return for e in ran) / n if n else 0.0,
        "pass_at_k": passes.get(f"pass@{k}", 0.0),
        "avg_at_k": sum(task_rates) / len(task_rates) if task_rates else 0.0,
        "mean_turns": sum(e.num_turns for e in ran) / n if n else 0.0,
        "mean_tokens": sum(e.num_tokens for e in ran) / n if n else 0.0,
        "details": {"failed_episodes": len(episodes) - n, **passes, **game_outcomes(ran)},
    }


OUTCOMES = ("win", "draw", "loss")


def game_outcomes(episodes: list[Episode]) -> dict[str, Any]:
    """Two-player games (episodes whose task names an opponent): {"games": rows} with the policy's
    win, draw and loss rates and their 95% Wilson intervals, per opponent and seat (first or second
    mover, then both). A game's outcome is the sign of its return (the policy's zero-sum score); one
    cut off before the game ended (env.max_turns, the token cap) is `unfinished`, counted in n."""
    played = [ep for ep in episodes if isinstance(ep.task, dict) and "opponent" in ep.task]
    if not played:
        return {}

    def outcome(ep: Episode) -> str:
        if ep.env_return > 0:
            return "win"
        if ep.env_return < 0:
            return "loss"
        return "draw" if ep.end_reason == EndReason.TERMINATED else "unfinished"

    cells: dict[tuple[str, str], list[str]] = defaultdict(list)
    for ep in played:
        seat = "first" if ep.task.get("first") else "second"
        for key in ((ep.task["opponent"], seat), (ep.task["opponent"], "both")):
            cells[key].append(outcome(ep))
    order = {"first": 0, "second": 1, "both": 2}
    rows = []
    for (opponent, seat), outcomes in sorted(cells.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        n = len(outcomes)
        row: dict[str, Any] = {
            "opponent": opponent,
            "seat": seat,
            "games": n,
            "unfinished": outcomes.count("unfinished"),
        }
        for name in OUTCOMES:
            count = outcomes.count(name)
            low, high = wilson_interval(count, n)
            row.update({name: count / n, f"{name}_ci_low": low, f"{name}_ci_high": high})
        rows.append(row)
    return {"games": rows}


def run_eval(ctx: RunContext, checkpoints: list[str]) -> list[EvalResult]:
    """Evaluate each checkpoint (base, sft, latest, best, expert or an id) once; return their results,
    each named as asked (its label: `best (#25)`)."""
    results: list[EvalResult] = []
    seen: dict[PolicyRef, str] = {}  # the weights evaluated -> the name they were asked for by
    for which in checkpoints:
        asked = PolicyRef.from_cli(which)
        ckpt = resolve_checkpoint(ctx.store, asked) if asked != EXPERT else None
        note = checkpoint_note(ctx.store, which)
        if note:
            ctx.console.print(f"eval: {note}", highlight=False)
        elif which == "latest" and ckpt is None:
            ctx.console.print("eval: the run has no checkpoint yet; 'latest' is the base model.")
        evaluated = EXPERT if asked == EXPERT else PolicyRef.of_checkpoint(ckpt)
        if evaluated in seen:
            if which != seen[evaluated]:
                weights = "the base model" if ckpt is None else f"checkpoint {ckpt.id}"
                ctx.console.print(f"eval: {which} is {weights}, evaluated above as {seen[evaluated]}.", highlight=False)
            continue
        seen[evaluated] = which
        for opponent in eval_opponents(ctx.recipe):
            results.append(evaluate_checkpoint(ctx, which, ckpt, ctx.recipe.eval.tasks, opponent=opponent))
    return results


def recipe_checkpoints(recipe: Recipe) -> list[str]:
    """What `rlcli run` and a bare `rlcli eval` evaluate: eval.checkpoints (sft only when the recipe
    has SFT), and with grpo.keep_best also best, the run's result, beside the newest (`latest`)."""
    wanted = [c for c in recipe.eval.checkpoints if c != "sft" or recipe.sft.source != "none"]
    return wanted + ["best"] if recipe.grpo.keep_best and "best" not in wanted else wanted


def eval_opponents(recipe: Recipe) -> list[str | int | None]:
    """Whom each checkpoint plays at eval, one stage each: eval.opponents; else a model env.opponent
    (base, sft, an id); else [None]: the env's own opponents, if any, in one stage."""
    if recipe.eval.opponents is not None:
        return list(recipe.eval.opponents)
    return [recipe.env.model_opponent()]


def opponent_key(ctx: RunContext, opponent: str | int | None) -> str | None:
    """How an eval stage names its opponent: random, bot, base or ckpt-<id> (sft and ids resolved)."""
    if opponent is None or opponent in ("random", "bot", "base"):
        return None if opponent is None else str(opponent)
    ckpt = resolve_checkpoint(ctx.store, PolicyRef.from_cli(str(opponent)))
    return "base" if ckpt is None else f"ckpt-{ckpt.id}"


def evaluate_checkpoint(
    ctx: RunContext,
    which: str,
    ckpt: Checkpoint | None,
    tasks: int,
    policy: tuple[Any, Any] | None = None,
    opponent: str | int | None = None,
) -> EvalResult:
    """One checkpoint's eval stage on the first `tasks` held-out tasks, with the recipe's eval decoding.

    policy: (model, tokenizer) already holding the checkpoint's weights (GRPO's model in memory),
    used instead of loading it from disk. opponent: a two-player game's (eval_opponents), None for
    none. A stage done with at least `tasks` tasks is reused; one done with fewer gets the missing
    ones, and an interrupted one finishes the tasks it was begun with.
    """
    temperature, k = eval_decoding(ctx.recipe)
    evaluated = EXPERT if PolicyRef.from_cli(which) == EXPERT else PolicyRef.of_checkpoint(ckpt)
    stage = eval_stage(evaluated, temperature, k, opponent_key(ctx, opponent))
    row = ctx.store.stage(stage)
    if row is not None and not row.done:
        tasks = max(tasks, row.params.get("tasks", 0))
    if row is not None and row.done and row.params.get("tasks", 0) < tasks:
        ctx.store.mark_stage(stage, "pending")  # more tasks asked for: add the missing ones
    ctx.stage(
        stage,
        lambda: _evaluate(ctx, stage, which, ckpt, tasks, policy, opponent),
        {"checkpoint": which, "tasks": tasks, "k": k, "temperature": temperature}
        | ({"opponent": str(opponent)} if opponent is not None else {}),
    )
    result = eval_result(ctx.store, stage)
    assert result is not None  # the stage just completed
    # A stage done before (a checkpoint GRPO evaluated by id, now asked for as best) is named as asked now.
    return replace(result, checkpoint=which)


def _evaluate(
    ctx: RunContext,
    stage: str,
    which: str,
    ckpt: Checkpoint | None,
    tasks: int,
    policy: tuple[Any, Any] | None,
    opponent: str | int | None,
) -> dict[str, Any]:
    recipe = ctx.recipe
    sampling = sampling_config(recipe.rollout)
    sampling.temperature = eval_decoding(recipe)[0]
    sampler: Sampler | None = None  # None: the env's expert plays
    if PolicyRef.from_cli(which) == EXPERT:
        policy_ref, tokenizer = EXPERT, None
    else:
        if policy is not None:
            model, tokenizer = policy
        else:
            from rlcli.models.loading import load_policy

            model, tokenizer = load_policy(
                recipe.model, recipe.lora, recipe.quantization, adapter=ckpt.path if ckpt else None, trainable=False
            )
        policy_ref = PolicyRef.of_checkpoint(ckpt)
        # A model in memory carries GRPO's adapter: even at the base model's weights, vLLM gets them synced.
        sampler = make_sampler(
            recipe,
            model,
            tokenizer,
            sampling,
            base=ckpt is None and policy is None,
            checkpoint_folder=ckpt.path if ckpt else None,
        )
    collect(
        ctx,
        stage=stage,
        policy=policy_ref,
        sampler=sampler,
        tokenizer=tokenizer,
        task_indices=list(range(tasks)),
        group_size=recipe.eval.k,
        split="eval",
        progress_label=f"eval {which}" + (f" vs {opponent}" if opponent is not None else ""),
        opponent=resolve_opponent(ctx, opponent, sampler, sampling, stage=stage),
    )
    metrics = eval_metrics(stage_episodes(ctx.store, stage), recipe.eval.k)
    # How spread out the policy still is: SFT that leaves it near-deterministic leaves GRPO groups of
    # equal rewards. Sampled logprobs estimate it only when sampling (greedy's are of the argmax).
    if sampler is not None and sampling.temperature > 0:
        metrics["details"]["entropy"] = sampled_token_entropy(ctx.store, stage)
    replace_eval(
        ctx.rundb,
        EvalResult(
            id=None,
            run=ctx.run,
            stage=stage,
            checkpoint=which,
            checkpoint_id=ckpt.id if ckpt else None,
            split="eval",
            created_at=now(),
            **metrics,
        ),
    )
    return {k: v for k, v in metrics.items() if k != "details"}


HELDOUT_KEY = "eval/success_rate"


class TrainingEvals:
    """grpo.eval_every: held-out evals of GRPO's starting point and checkpoints, from train grpo.

    Each is the eval stage `rlcli eval -c <id>` would run (eval/base, eval/ckpt-<id>), so either
    command reuses the other's. Its success over the first grpo.eval_tasks tasks is logged as the
    metric eval/success_rate at the checkpoint's iteration (-1: the starting point), once the stage
    is done; logging it again is harmless, so a resume simply logs what a kill may have cut off.
    """

    def __init__(self, ctx: RunContext, model: Any, tokenizer: Any, metrics_stage: str) -> None:
        self.ctx, self.model, self.tokenizer, self.metrics_stage = ctx, model, tokenizer, metrics_stage
        self.tasks = ctx.recipe.grpo.eval_tasks or ctx.recipe.eval.tasks

    def evaluate(self, ckpt: Checkpoint | None, step: int, in_memory: bool) -> dict[str, float]:
        """Evaluate `ckpt` (None: the base model) with the trainer's model when `in_memory` says it
        holds those weights (and there is one), else loaded from disk; return the metrics logged for `step`."""
        which = str(SFT if ckpt is not None and ckpt.stage == SFT_STAGE else PolicyRef.of_checkpoint(ckpt))
        policy = (self.model, self.tokenizer) if in_memory and self.model is not None else None
        opponent = eval_opponents(self.ctx.recipe)[0]  # a two-player game: the first opponent
        result = evaluate_checkpoint(self.ctx, which, ckpt, self.tasks, policy, opponent)
        rate = leading_tasks_success(self.ctx.store, result.stage, self.tasks)
        metrics = {HELDOUT_KEY: rate} if rate is not None else {}
        if step < 0 and rate is not None:  # no iteration line shows it
            self.ctx.console.print(f"eval: the starting point ({which}) has held-out success {rate:.2f}")
        self.ctx.store.log_metrics(self.metrics_stage, step, dict(metrics))
        return metrics
