"""What `rlcli runs list / show / compare / episodes` show, as plain dicts built from store
records: the --json output, and what the tables in report/tables.py render. Nothing here writes.

docs/reporting.md describes the commands built on these functions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from rlcli.report.ratings import elo_ratings
from rlcli.store.checkpoints import BestAndLatest, best_and_latest, checkpoint_run, checkpoints, ranked_checkpoints
from rlcli.store.db import RunDB
from rlcli.store.episodes import endpoint_calls, episode_counts, eval_games, labelled_episodes
from rlcli.store.evals import eval_results
from rlcli.store.events import list_events
from rlcli.store.images import image_sizes, load_images
from rlcli.store.names import (
    BEST,
    EXPERT,
    LATEST,
    DistillStage,
    DpoStage,
    EvalStage,
    SftStage,
    TrainStage,
    try_parse_stage,
)
from rlcli.store.records import GPU_MEMORY_KEYS, Checkpoint, EvalResult, LabelledEpisode, Run
from rlcli.store.run_store import RunStore
from rlcli.store.stages import displayed_status

KEY_METRICS = ("rollout/reward_mean", "rollout/success_rate", "train/loss")
COMPARE_METRICS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "train/loss",
    "train/kl",
    "train/teacher_kl",
    "train/entropy",
    "perf/tokens_per_s",
)
REWARD_KEY = "rollout/reward_mean"
SUCCESS_KEY = "rollout/success_rate"
HELDOUT_KEY = "eval/success_rate"  # grpo.eval_every; step -1 is the starting point
TEACHER_KL_KEY = "train/teacher_kl"  # a distill phase's reverse KL to its teacher, per iteration


def runs_summary(rundb: RunDB) -> list[dict[str, Any]]:
    """`runs list`: what each run is and how it did on held-out tasks; `metrics` (the last training
    iteration's) only in --json, where a script reads them as what they are."""
    out = []
    for run in rundb.list_runs():
        store = RunStore(rundb, run.name)
        out.append(
            {
                "name": run.name,
                "status": _status(rundb, run),
                "created_at": run.created_at,
                **identity_view(store, run),
                "metrics": {k: v for k, v in rundb.latest_metrics(run.name).items() if k in KEY_METRICS},
            }
        )
    return out


def identity_view(store: RunStore, run: Run) -> dict[str, Any]:
    """What `runs list`, `show` and `compare` lead with: the model, the env, the stages done and the
    held-out result (None when nothing has been evaluated)."""
    keep_best = bool(run.recipe.get("grpo", {}).get("keep_best"))
    held = held_out(eval_results(store), keep_best)
    done = stages_done(store, run)
    return {
        "model": run.recipe.get("model", {}).get("name"),
        "env": run.recipe.get("env", {}).get("name"),
        "stages_done": {**asdict(done), "summary": done.summary},
        "held_out": asdict(held) if held else None,
    }


@dataclass(frozen=True)
class StagesDone:
    """How far a run got: the stages done of each kind, and GRPO's iterations against the recipe's."""

    sft: bool
    grpo_iterations: int  # train/<i> stages done
    grpo_planned: int  # grpo.iterations times the grpo and distill phases in run.stages
    dpo: int  # DPO stages done
    evals: int  # eval stages done, grpo.eval_every's among them
    loop: str = "grpo"  # what the training loop's phases are: grpo, distill, or both (distill+grpo)

    @property
    def summary(self) -> str:
        """e.g. "sft, grpo 12/32, 5 evals"; "none" before any stage is done."""
        parts = ["sft"] if self.sft else []
        if self.grpo_planned:
            parts.append(f"{self.loop} {self.grpo_iterations}/{self.grpo_planned}")
        elif self.grpo_iterations:  # `rlcli train grpo` on a recipe whose run.stages leaves grpo out
            parts.append(f"{self.loop} {self.grpo_iterations}")
        if self.dpo:
            parts.append("dpo" if self.dpo == 1 else f"{self.dpo} dpo")
        if self.evals:
            parts.append(f"{self.evals} eval{'s' if self.evals > 1 else ''}")
        return ", ".join(parts) or "none"


def stages_done(store: RunStore, run: Run) -> StagesDone:
    # The stored recipe as a dict: a listing must not depend on every recipe validating under this rlcli.
    iterations = run.recipe.get("grpo", {}).get("iterations") or 0
    planned = run.recipe.get("run", {}).get("stages")
    rows = store.stages()
    done = [try_parse_stage(s.name) for s in rows if s.done]
    # The training loop's phases, GRPO's and distillation's: run.stages', else the one a command ran.
    if isinstance(planned, list):
        kinds = [stage for stage in planned if stage in ("grpo", "distill")]
    else:
        kinds = ["distill"] if any(isinstance(try_parse_stage(s.name), DistillStage) for s in rows) else ["grpo"]
    return StagesDone(
        sft=any(isinstance(s, SftStage) and not s.demos for s in done),
        grpo_iterations=sum(isinstance(s, TrainStage) for s in done),
        grpo_planned=iterations * len(kinds),
        loop="+".join(dict.fromkeys(kinds)) or "grpo",
        dpo=sum(isinstance(s, DpoStage) for s in done),
        evals=sum(isinstance(s, EvalStage) for s in done),
    )


@dataclass(frozen=True)
class HeldOut:
    """The one held-out result that says how a run did (held_out)."""

    label: str  # the policy evaluated, as the eval table names it: latest (#25), sft (#1), #33, base
    stage: str
    decoding: str  # greedy, or t<temperature>-k<k>
    success_rate: float
    ci_low: float  # the 95% Wilson interval
    ci_high: float
    tasks: int
    k: int


def held_out(results: list[EvalResult], keep_best: bool) -> HeldOut | None:
    """The eval that says how a run did: among the evals of the policy asked for as the run's result
    (best with grpo.keep_best, else latest: what `rlcli run`'s last eval asks for), else as latest or
    best, else among all, that of the most-trained checkpoint (the largest id; the base model counts as
    the earliest), over the most episodes (tasks × k), the newest of equals. Never the expert's; games
    against opponents only where nothing else was evaluated."""
    policy = [r for r in results if r.checkpoint != str(EXPERT)]
    alone = [r for r in policy if r.opponent is None] or policy
    result = str(BEST) if keep_best else str(LATEST)
    pool = (
        [r for r in alone if r.checkpoint == result]
        or [r for r in alone if r.checkpoint in (str(LATEST), str(BEST))]
        or alone
    )
    if not pool:
        return None
    best = max(pool, key=lambda r: (-1 if r.checkpoint_id is None else r.checkpoint_id, r.tasks * r.k, r.id or 0))
    return HeldOut(
        label=best.label,
        stage=best.stage,
        decoding=best.decoding,
        success_rate=best.success_rate,
        ci_low=best.ci_low,
        ci_high=best.ci_high,
        tasks=best.tasks,
        k=best.k,
    )


def run_details(store: RunStore) -> dict[str, Any]:
    run = store.require_run()
    status = _status(store.rundb, run)
    # Recorded on a GPU only (engine/context.py): the stage's peaks (allocated, reserved; the largest
    # GPU's), and the vLLM engine's share.
    memory = {key: {m.stage: m.value for m in store.metrics(key)} for key in GPU_MEMORY_KEYS}
    stages = [
        {
            "name": s.name,
            # A killed run leaves its last stage marked running.
            "status": "stopped" if status == "stopped" and s.status == "running" else s.status,
            "started_at": s.started_at,
            "finished_at": s.finished_at,
            "duration_s": s.duration_s,
            "error": s.error,
            "result": s.result,
            "gpu_mem_peak_gb": memory["perf/gpu_mem_peak_gb"].get(s.name),
            "gpu_mem_reserved_gb": memory["perf/gpu_mem_reserved_gb"].get(s.name),
            "vllm_mem_gb": memory["perf/vllm_mem_gb"].get(s.name),
        }
        for s in store.stages()
    ]
    total, failed, replayed_lost = episode_counts(store)
    return {
        "name": run.name,
        "status": status,
        **identity_view(store, run),
        "error": run.error,  # why the last command on it failed
        "description": run.description,
        "created_at": run.created_at,
        "recipe_sha256": run.recipe_sha256,
        "recipe_path": run.recipe_path,
        "seed": run.seed,
        "git_sha": run.git_sha,
        "hostname": run.hostname,
        "versions": run.versions,
        "stages": stages,
        "episodes": {"total": total, "failed": failed, "replayed_lost": replayed_lost},
        "latest_metrics": store.latest_metrics(),
        "reward_curve": _curve(store, REWARD_KEY),
        "success_curve": _curve(store, SUCCESS_KEY),
        "heldout_curve": _curve(store, HELDOUT_KEY),
        "teacher_kl_curve": _curve(store, TEACHER_KL_KEY),
        "teachers": teachers_view(store),
        "checkpoints": [asdict(c) for c in checkpoints(store)],
        "evals": [eval_view(r) for r in eval_results(store)],
        # two-player games: Elo ratings fitted to the held-out games of every eval stage
        "ratings": [asdict(r) for r in elo_ratings(eval_games(store))],
        "ending": ending_view(best_and_latest(store)),
        "events": [asdict(e) for e in list_events(store)],  # warnings raised while it trained
        "recipe_history": [
            {"created_at": h.created_at, "reason": h.reason, "recipe_sha256": h.recipe_sha256, "code": h.code}
            for h in store.rundb.recipe_history(store.run)
        ],
    }


def teachers_view(store: RunStore) -> list[dict[str, Any]]:
    """Each distill phase's teacher (as its stage distill/<k> recorded it) with the teacher's own held-out
    success, when the teacher is a checkpoint whose run evaluated it: what the student is measured against."""
    out = []
    for stage in store.stages():
        if not isinstance(try_parse_stage(stage.name), DistillStage) or "teacher" not in stage.params:
            continue
        teacher = stage.params["teacher"]
        ranked = None
        if (checkpoint_id := teacher.get("checkpoint")) is not None and (
            owner := checkpoint_run(store.rundb, checkpoint_id)
        ):
            ranked = next(
                (r for r in ranked_checkpoints(RunStore(store.rundb, owner)) if r.name == str(checkpoint_id)), None
            )
        out.append(
            {
                "stage": stage.name,
                "teacher": teacher["shown"],
                "checkpoint": checkpoint_id,
                "success_rate": None if ranked is None else ranked.success_rate,
                "tasks": None if ranked is None else ranked.tasks,
                "decoding": None if ranked is None else ranked.decoding,
            }
        )
    return out


def _status(rundb: RunDB, run: Run) -> str:
    return displayed_status(rundb.path.parent, run)


# What `best` and `latest` mean, in the words every view of them uses (store/checkpoints.py resolves them).
CHECKPOINT_ROLES = {
    "best": "the highest held-out success (-c best)",
    "latest": "the newest checkpoint (-c latest)",
}
KEEP_BEST_NOTE = "grpo.keep_best: the run's result is best; `rlcli run` evaluates it and `rlcli export` exports it"


def ending_view(ending: BestAndLatest) -> dict[str, Any]:
    """The best checkpoint by held-out success and the newest one; `name` is what -c takes."""

    def row(ckpt: Checkpoint | None, name: str, success: float | None) -> dict[str, Any]:
        return {
            "name": name,
            "id": ckpt.id if ckpt else None,
            "stage": ckpt.stage if ckpt else None,
            "iteration": ckpt.iteration if ckpt else None,
            "success_rate": success,
            "tasks": ending.tasks if success is not None else None,
            "decoding": ending.decoding if success is not None else None,
        }

    best, latest = ending.best, ending.latest
    return {
        "best": row(best.checkpoint, best.name, best.success_rate) if best else None,
        "latest": row(latest, str(latest.id), ending.latest_success) if latest else None,
        "keep_best": ending.keep_best,
    }


def eval_view(result: EvalResult) -> dict[str, Any]:
    """An eval result with the display label that tells checkpoints apart."""
    return {**asdict(result), "label": result.label, "decoding": result.decoding, "opponent": result.opponent}


def metric_series(store: RunStore) -> dict[str, dict[str, Any]]:
    """Every metric of a run as {key: {"stage", "steps", "values"}}, in step order."""
    series: dict[str, dict[str, Any]] = {}
    for metric in store.metrics():
        entry = series.setdefault(metric.key, {"stage": metric.stage, "steps": [], "values": []})
        entry["steps"].append(metric.step)
        entry["values"].append(metric.value)
    return series


OTHER_CHECKPOINTS = "other checkpoints"  # `runs compare`'s row for the best of those evaluated by id


def compare_runs(rundb: RunDB, names: list[str]) -> list[dict[str, Any]]:
    """`runs compare`: each run's identity and held-out result, the recipe fields in which the runs differ
    (`recipe_differs`: dotted field -> this run's value; a field its rlcli did not have is left out), its
    latest metrics and its best eval per checkpoint label."""
    runs = [RunStore(rundb, name).require_run() for name in names]
    recipes = [_flat(run.recipe) for run in runs]
    missing = object()
    differs = [
        field
        for field in dict.fromkeys(f for recipe in recipes for f in recipe)
        if field != "run.name" and len({json.dumps(r.get(field, missing), default=str) for r in recipes}) > 1
    ]
    out = []
    for run, recipe in zip(runs, recipes):
        name = run.name
        store = RunStore(rundb, name)
        latest = store.latest_metrics()
        best: dict[str, dict[str, Any]] = {}
        for result in eval_results(store):
            # The named labels (base, sft, latest, best, expert) are what runs share. Checkpoints asked
            # for by id, as grpo.eval_every's evals are, fold into one row: each run has its own ids.
            label = OTHER_CHECKPOINTS if result.checkpoint.isdigit() else result.checkpoint
            if label not in best or result.success_rate > best[label]["success_rate"]:
                best[label] = {
                    k: getattr(result, k)
                    for k in ("success_rate", "ci_low", "ci_high", "tasks", "k", "stage", "checkpoint_id")
                }
        out.append(
            {
                "name": name,
                "status": _status(rundb, run),
                "created_at": run.created_at,
                **identity_view(store, run),
                "recipe_differs": {field: recipe[field] for field in differs if field in recipe},
                "recipe_sha256": run.recipe_sha256,
                "episodes": episode_counts(store)[0],
                "latest_metrics": {k: latest[k] for k in COMPARE_METRICS if k in latest},
                "best_evals": best,
                "reward_curve": _curve(store, REWARD_KEY),
            }
        )
    return out


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A recipe as dotted field -> value (grpo.lr); lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def select_episodes(store: RunStore, **filters: Any) -> list[dict[str, Any]]:
    """Episodes to read, with their reward components (see store.episodes.labelled_episodes).

    A message's image part keeps the sha256 of its stored image (a vision-language model's run) and
    gains that image's width and height; a part without a sha256 is an image the policy never read.
    """
    episodes = [episode_view(e) for e in labelled_episodes(store, **filters)]
    sizes = image_sizes(store.rundb, [h for ep in episodes for h in image_hashes(ep["messages"])])
    calls = endpoint_calls(store.rundb, [ep["id"] for ep in episodes])
    for ep in episodes:
        ep["messages"] = [_with_sizes(m, sizes) for m in ep["messages"]]
        ep["calls"] = calls.get(ep["id"])  # an agent program's calls to the endpoint; None for an env's
    return episodes


def image_hashes(messages: list[dict[str, Any]]) -> list[str]:
    """The sha256 of the stored images that messages show, in order."""
    return [part["sha256"] for m in messages for part in _image_parts(m) if "sha256" in part]


def episode_pngs(rundb: RunDB, episodes: list[dict[str, Any]]) -> dict[str, bytes]:
    """sha256 -> PNG bytes of every stored image the episodes (select_episodes) show."""
    return load_images(rundb, [h for ep in episodes for h in image_hashes(ep["messages"])])


def _image_parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") == "image"]


def _with_sizes(message: dict[str, Any], sizes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    if not _image_parts(message):
        return message
    parts = []
    for part in message["content"]:
        if isinstance(part, dict) and part.get("sha256") in sizes:
            width, height = sizes[part["sha256"]]
            part = {**part, "width": width, "height": height}
        parts.append(part)
    return {**message, "content": parts}


def episode_view(labelled: LabelledEpisode) -> dict[str, Any]:
    row = asdict(labelled.episode)
    row.pop("turns")
    row.pop("images")  # empty when read back; the messages name their images (select_episodes)
    end = labelled.episode.end_reason
    return {
        **row,
        "end_reason": end.value if end else None,  # the stored string: an f-string of the enum shows its name
        "label_set": labelled.label_set,
        "reward": labelled.reward,
        "rewards": {
            component: {"value": r.value, "weight": r.weight, "error": r.error}
            for component, r in labelled.components.items()
        },
    }


def _curve(store: RunStore, key: str) -> list[float]:
    return [metric.value for metric in store.metrics(key)]
