"""What `rlcli runs list / show / compare / episodes` show, as plain dicts built from store
records: the --json output, and what the tables in report/tables.py render. Nothing here writes.

docs/reporting.md describes the commands built on these functions.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rlcli.report.ratings import elo_ratings
from rlcli.store.checkpoints import BestAndLatest, best_and_latest, checkpoints
from rlcli.store.db import RunDB
from rlcli.store.episodes import episode_counts, eval_games, labelled_episodes
from rlcli.store.evals import eval_results
from rlcli.store.events import list_events
from rlcli.store.images import image_sizes, load_images
from rlcli.store.records import GPU_MEMORY_KEYS, Checkpoint, EvalResult, LabelledEpisode, Run
from rlcli.store.run_store import RunStore
from rlcli.store.stages import displayed_status

KEY_METRICS = ("rollout/reward_mean", "rollout/success_rate", "train/loss")
COMPARE_METRICS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "train/loss",
    "train/kl",
    "train/entropy",
    "perf/tokens_per_s",
)
REWARD_KEY = "rollout/reward_mean"
SUCCESS_KEY = "rollout/success_rate"
HELDOUT_KEY = "eval/success_rate"  # grpo.eval_every; step -1 is the starting point


def runs_summary(rundb: RunDB) -> list[dict[str, Any]]:
    return [
        {
            "name": run.name,
            "status": _status(rundb, run),
            "created_at": run.created_at,
            "metrics": {k: v for k, v in rundb.latest_metrics(run.name).items() if k in KEY_METRICS},
        }
        for run in rundb.list_runs()
    ]


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


def _status(rundb: RunDB, run: Run) -> str:
    return displayed_status(rundb.path.parent, run)


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
    out = []
    for name in names:
        store = RunStore(rundb, name)
        run = store.require_run()
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
                "recipe_sha256": run.recipe_sha256,
                "episodes": episode_counts(store)[0],
                "latest_metrics": {k: latest[k] for k in COMPARE_METRICS if k in latest},
                "best_evals": best,
                "reward_curve": _curve(store, REWARD_KEY),
            }
        )
    return out


def select_episodes(store: RunStore, **filters: Any) -> list[dict[str, Any]]:
    """Episodes to read, with their reward components (see store.episodes.labelled_episodes).

    A message's image part keeps the sha256 of its stored image (a vision-language model's run) and
    gains that image's width and height; a part without a sha256 is an image the policy never read.
    """
    episodes = [episode_view(e) for e in labelled_episodes(store, **filters)]
    sizes = image_sizes(store.rundb, [h for ep in episodes for h in image_hashes(ep["messages"])])
    for ep in episodes:
        ep["messages"] = [_with_sizes(m, sizes) for m in ep["messages"]]
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
