"""Checkpoint rows: saved weights (and a GRPO checkpoint's optimizer state) under the runs dir.

A row's `path` is stored relative to the runs dir (the folder of rlcli.db), so that a run resumes
from any working directory; records come back with absolute paths. Rows written by older rlcli
hold a path relative to the working directory of the time, or an absolute one: both still resolve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import UsageError
from rlcli.store.db import RunDB, now
from rlcli.store.evals import eval_decoding, eval_results, leading_tasks_success
from rlcli.store.names import BASE, EXPERT, SFT_STAGE, EvalStage, PolicyRef, TrainStage, try_parse_stage
from rlcli.store.records import Checkpoint
from rlcli.store.run_store import RunStore


def add_checkpoint(store: RunStore, stage: str, iteration: int, path: str | Path, kind: str) -> int:
    """Record the folder `path` (as the caller sees it) and return the row's id.

    A stage that is redone writes the same folder again: its row is reused, so that evals and
    exports that point at the id stay valid.
    """
    stored = _stored_path(store.rundb, Path(path))
    with store.rundb.transaction() as db:
        same = list(
            db.table("checkpoints").rows_where("run = ? and stage = ? and path = ?", [store.run, stage, stored])
        )
        if same:
            db.table("checkpoints").update(same[-1]["id"], {"iteration": iteration, "kind": kind, "created_at": now()})
            return same[-1]["id"]
        row = {
            "run": store.run,
            "stage": stage,
            "iteration": iteration,
            "path": stored,
            "kind": kind,
            "created_at": now(),
        }
        pk = db.table("checkpoints").insert(row).last_pk
        assert isinstance(pk, int)  # the table's integer primary key
        return pk


def checkpoints(store: RunStore) -> list[Checkpoint]:
    """The run's checkpoints, oldest first, with absolute paths."""
    rows = store.rundb.db.table("checkpoints").rows_where("run = ?", [store.run], order_by="id")
    return [Checkpoint(**{**row, "path": str(_resolved_path(store.rundb, row["path"], store.run))}) for row in rows]


def checkpoint_run(rundb: RunDB, checkpoint_id: int) -> str | None:
    """The run a checkpoint id belongs to (ids are unique across the database); None if no checkpoint has it."""
    rows = list(rundb.db.table("checkpoints").rows_where("id = ?", [checkpoint_id], select="run"))
    return rows[0]["run"] if rows else None


def resolve_checkpoint(store: RunStore, which: str | PolicyRef) -> Checkpoint | None:
    """base -> None (the base model); sft / latest / best / a numeric id -> that checkpoint (`which`
    in the CLI form, PolicyRef.from_cli).

    latest: the newest checkpoint (None before the first: the base model), whatever the recipe says.
    best: the best held-out success (see best_checkpoint), which may be None (the base model).
    """
    ref = which if isinstance(which, PolicyRef) else PolicyRef.from_cli(which)
    if ref.kind == "base":
        return None
    rows = checkpoints(store)
    if ref.kind == "best":
        best = best_checkpoint(store)
        if best is None:
            raise UsageError(
                f"Run {store.run!r} has no held-out eval of its checkpoints or base model to pick the best from; "
                "run with grpo.eval_every or rlcli eval first."
            )
        return best.checkpoint
    if ref.kind == "latest":
        return rows[-1] if rows else None
    if ref.kind == "sft":
        sft_rows = [r for r in rows if r.stage == SFT_STAGE]
        if not sft_rows:
            raise UsageError(f"Run {store.run!r} has no SFT checkpoint; run `rlcli sft` first or choose base/latest.")
        return sft_rows[-1]
    if ref.kind == "checkpoint":
        for row in rows:
            if row.id == ref.number:
                return row
        raise UsageError(
            f"Run {store.run!r} has no checkpoint with id {ref}; `rlcli runs show {store.run}` lists them."
        )
    assert ref == EXPERT, f"from_cli gives no {ref.kind} reference"
    raise UsageError(f"Unknown checkpoint {str(ref)!r}: expected base, sft, latest, best or a checkpoint id.")


@dataclass(frozen=True)
class RankedCheckpoint:
    """A checkpoint (None: the base model) with its held-out success, as `best` compares them."""

    checkpoint: Checkpoint | None
    success_rate: float  # over the first `tasks` eval tasks, sampled as `decoding` says
    tasks: int
    decoding: str  # how the evals compared sampled: greedy, or t<temperature>-k<k>
    stage: str  # the eval stage the rate comes from

    @property
    def name(self) -> str:
        """What -c takes to name it again: base or the checkpoint id."""
        return str(PolicyRef.of_checkpoint(self.checkpoint))

    def describe(self) -> str:
        """e.g. "checkpoint 7 (iteration 11, held-out 0.41 on 32 tasks, t0.8-k1)"."""
        held_out = f"held-out {self.success_rate:.2f} on {self.tasks} tasks, {self.decoding}"
        if self.checkpoint is None:
            return f"the base model ({held_out})"
        c = self.checkpoint
        where = "sft" if c.stage == SFT_STAGE else f"iteration {c.iteration}"
        return f"checkpoint {c.id} ({where}, {held_out})"


def ranked_checkpoints(store: RunStore) -> list[RankedCheckpoint]:
    """The base model and checkpoints with comparable held-out evals, in training order (base,
    then by checkpoint id).

    Comparable: evaluated with one decoding (temperature, k) on at least the tasks that
    grpo.eval_tasks (default eval.tasks) names, compared on those first tasks; when no eval reached
    that many, on as many as the largest eval has. An eval of more tasks (a later `rlcli eval` with
    a larger eval.tasks) still compares: its first tasks are the same episodes. The decoding is the
    one that evaluated the most policies (a tie: the recipe's eval decoding, then the newer
    one), so that an eval at another temperature (`rlcli eval -c best eval.temperature=0`) neither
    finds nothing to rank nor moves `best` to a checkpoint ranked on fewer evals.
    """
    recipe = store.recipe()
    by_id = {c.id: c for c in checkpoints(store)}
    # Per decoding (temperature, k), in the order first used: each eval stage's policy and its most tasks.
    decodings: dict[tuple[float, int], dict[str, tuple[Checkpoint | None, int]]] = {}
    for result in eval_results(store):
        ckpt = by_id.get(result.checkpoint_id) if result.checkpoint_id is not None else None
        if result.checkpoint_id is not None and ckpt is None:
            continue  # a checkpoint row that is gone
        stage = try_parse_stage(result.stage)
        # The expert is no candidate, and a game against an opponent is another measure.
        if not isinstance(stage, EvalStage) or stage.policy == EXPERT or stage.opponent is not None:
            continue
        evaluated = decodings.setdefault((stage.temperature, stage.k), {})
        evaluated[result.stage] = (ckpt, max(result.tasks, evaluated.get(result.stage, (None, 0))[1]))
    if not decodings:
        return []
    preferred, keys = eval_decoding(recipe), list(decodings)
    ranked = [_ranked(store, decodings[key], key) for key in keys]
    return max(enumerate(ranked), key=lambda pair: (len(pair[1]), keys[pair[0]] == preferred, pair[0]))[1]


def _ranked(
    store: RunStore, evaluated: dict[str, tuple[Checkpoint | None, int]], decoding: tuple[float, int]
) -> list[RankedCheckpoint]:
    """The policies evaluated with one decoding (eval stage -> (checkpoint, tasks)), compared on the
    same first tasks, in training order."""
    recipe = store.recipe()
    most = max(have for _, have in evaluated.values())
    tasks = min(recipe.grpo.eval_tasks or recipe.eval.tasks or most, most)
    shown = EvalStage(BASE, *decoding).decoding or "greedy"
    ranked = []
    for stage, (ckpt, have) in evaluated.items():
        rate = leading_tasks_success(store, stage, tasks) if have >= tasks else None
        if rate is not None:
            ranked.append(RankedCheckpoint(ckpt, rate, tasks, shown, stage))
    return sorted(ranked, key=lambda r: -1 if r.checkpoint is None else r.checkpoint.id)


def best_checkpoint(store: RunStore) -> RankedCheckpoint | None:
    """The best held-out success among comparable evals; a tie goes to the later checkpoint (the
    base model counts as the earliest). None when nothing has been evaluated comparably."""
    return _best(ranked_checkpoints(store))


def _best(ranked: list[RankedCheckpoint]) -> RankedCheckpoint | None:
    # Ranked in training order: among equal rates, the larger position (the later one) wins.
    return max(enumerate(ranked), key=lambda pair: (pair[1].success_rate, pair[0]))[1] if ranked else None


def checkpoint_note(store: RunStore, which: str) -> str | None:
    """What `best` meant this time, and on which evals; None for the names that say it themselves."""
    if which == "best" and (best := best_checkpoint(store)) is not None:
        return f"best = {best.describe()}"
    return None


@dataclass(frozen=True)
class BestAndLatest:
    """How a run ended: its best checkpoint by held-out success and its newest one (either may be None)."""

    best: RankedCheckpoint | None
    latest: Checkpoint | None
    latest_success: float | None  # the latest's held-out success, compared like best's; None if not evaluated
    tasks: int | None  # how many eval tasks the comparison is over; None with nothing evaluated
    decoding: str | None  # how those evals sampled (greedy, t0.8-k1); None with nothing evaluated
    keep_best: bool  # grpo.keep_best: the run's result is best (`rlcli run` evaluates it, export takes it)


def best_and_latest(store: RunStore) -> BestAndLatest:
    rows, ranked = checkpoints(store), ranked_checkpoints(store)
    latest = rows[-1] if rows else None
    latest_rank = next((r for r in ranked if latest is not None and r.name == str(latest.id)), None)
    return BestAndLatest(
        _best(ranked),
        latest,
        latest_rank.success_rate if latest_rank else None,
        ranked[0].tasks if ranked else None,
        ranked[0].decoding if ranked else None,
        store.recipe().grpo.keep_best,
    )


def train_checkpoints(store: RunStore) -> list[Checkpoint]:
    """GRPO's checkpoints (stages train/<i>), oldest first."""
    return [c for c in checkpoints(store) if isinstance(try_parse_stage(c.stage), TrainStage)]


def require_folder(checkpoint: Checkpoint) -> Path:
    """The checkpoint's folder; a recorded one that is gone is an error, never a silent fresh start."""
    folder = Path(checkpoint.path)
    if not folder.is_dir():
        raise UsageError(
            f"Checkpoint {checkpoint.id} of run {checkpoint.run!r} ({checkpoint.stage}) is recorded at {folder}, "
            "which does not exist; restore that folder, or give the --runs-dir that holds it."
        )
    return folder


def _runs_dir(rundb: RunDB) -> Path:
    return Path(os.path.abspath(rundb.path.parent))  # normalised like _stored_path's paths ("..")


def _stored_path(rundb: RunDB, path: Path) -> str:
    """Relative to the runs dir when the folder lies inside it, else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(_runs_dir(rundb)))
    except ValueError:
        return str(absolute)


def _resolved_path(rundb: RunDB, stored: str, run: str) -> Path:
    """The absolute folder of a stored path, whichever rlcli wrote it.

    Rows rlcli writes now are relative to the runs dir, from the run's folder on: they resolve there
    only, so a missing checkpoint is an error (require_folder), never a same-named folder below the
    working directory. Older rows: relative to the working directory they were written from (which
    is where they are found when it is this one), or absolute. Either way, a folder that has since
    moved with its runs dir is found below this runs dir, from the run's own folder on.
    """
    path, runs_dir = Path(stored), _runs_dir(rundb)
    if path.is_absolute():
        candidates = [path]
    elif path.parts[0] == run:
        return runs_dir / path
    else:
        candidates = [runs_dir / path, Path.cwd() / path]
    run_folders = [i for i, part in enumerate(path.parts[:-1]) if part == run]
    if run_folders:
        candidates.append(runs_dir.joinpath(*path.parts[run_folders[-1] :]))
    return next((c for c in candidates if c.exists()), candidates[0])
