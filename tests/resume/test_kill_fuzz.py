"""Kill-fuzz: `rlcli run` (SFT, two GRPO iterations, eval) is killed with SIGKILL at random
moments, resumed after each kill, and must end with the same database (every table) and adapter
weights as a run that was never interrupted. The recipe meets what makes a resume hard: env steps
that outlast env.step_timeout_s and env steps that raise (both fixed by the task's seed, so every
run meets the same ones: the episodes fail, and must stay failed and out of training after a
resume), and grpo.checkpoint_every 2, so that a kill in iteration 1 resumes from before iteration 0's
update and redoes it (engine/grpo/resume.py, supersede_lost_rollouts).

The delays are drawn, seeded, uniformly over the duration of one uninterrupted invocation measured
at the start of the test, so kills land anywhere in an invocation: during imports and start-up,
inside any stage, during commits, during exit. A resumed invocation skips what is done, so the same
delay reaches further into the recipe as the run progresses. Every kill is printed with its seed,
its delay and the stages it interrupted (pytest shows them beside a failure, or with -s)."""

from __future__ import annotations

import json
import math
import random
import re
import signal
import sqlite3
import subprocess
import time
from collections import defaultdict
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import DEVICE, RLCLI, cli_env, kill_when, make_ctx, run_in_process, write_recipe

# A reward that differs between samples of a group, so that every GRPO iteration updates the
# adapter (equal rewards make a group zero-variance and the update is skipped).
DISTINCT_CHARS = (
    "def distinct(completions, **kwargs):\n    return [len(set(c)) / max(len(c), 1) for c in completions]\n"
)


# guess_number whose env fails on some tasks, chosen by the task's seed so that every run meets the
# same failures: on seeds 2, 8, 14, ... (train tasks 2 and 8, played by iterations 0 and 1 and by the
# SFT demos) the second step outlasts env.step_timeout_s (end_reason env_timeout, transient); on seeds
# 4, 10, ... (and the first eval task, seed 1000000) the first step raises (end_reason error).
FLAKY_ENV = """
import time

from rlcli.builtin_envs.guess_number import GuessNumber


class Flaky(GuessNumber):
    def reset(self, seed):
        self.seed = seed
        return super().reset(seed)

    def step(self, action):
        if self.turns == 1 and self.seed % 6 == 2:
            time.sleep(2.0)  # env.step_timeout_s is 0.5
        if self.turns == 0 and self.seed % 6 == 4:
            raise ConnectionError("the env's backend went away")
        return super().step(action)


def make_env(**kwargs):
    return Flaky(**kwargs)
"""
FLAKY = {"step_timeout_s": 0.5, "max_turns": 3}


def tiny_recipe(tmp_path: Path) -> Path:
    """Multi-turn episodes (turn tokens and logprobs), six rollout chunks per stage (a kill can
    land between their commits), SFT with a trainer checkpoint at each of its 6 steps, GRPO with
    grpo.checkpoint_every 2 (iteration 0 saves none), an env that times out and raises on some tasks
    (FLAKY_ENV: 6 timeouts of 0.5 s in a run), and three evaluated checkpoints (base, sft, latest).
    On 2 idle CPU cores the work took about 2.5 s before the timeouts added their 3 s, beside about
    4.5 s of imports and model loading that every invocation pays (15 to 22 s in all on 2 cores
    shared with other test runs)."""
    (tmp_path / "distinct.py").write_text(DISTINCT_CHARS)
    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    return write_recipe(
        tmp_path / "r.yaml",
        run={"name": "fuzz", "seed": 0},
        env={"name": str(tmp_path / "flaky.py"), **FLAKY},
        rollout={"tasks": 6, "group_size": 2, "max_new_tokens": 16, "batch_size": 2, "temperature": 1.0},
        rewards=[{"fn": "env_return"}, {"fn": f"{tmp_path / 'distinct.py'}:distinct", "name": "distinct"}],
        sft={"source": "expert", "demos": 12, "batch_size": 2, "micro_batch_size": 2, "save_steps": 1},
        grpo={"iterations": 2, "lr": 1e-2, "checkpoint_every": 2},
        eval={"tasks": 4},
    )


class Invocation:
    """One `rlcli run` in its own process, its output in a log file."""

    def __init__(self, recipe: Path, runs: Path, log: Path):
        self.log, self.started = log, time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                RLCLI + ["run", "-r", str(recipe)], env=cli_env(runs), cwd=recipe.parent, stdout=out, stderr=out
            )

    def finished_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        self.elapsed = time.monotonic() - self.started
        assert self.proc.returncode == 0, f"rlcli run failed:\n{self.log.read_text()[-3000:]}"
        return True

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def what_was_killed(runs: Path, pid: int) -> str:
    """Where the kill landed, as the database tells it: the stages this process had started and
    not finished."""
    if not (runs / "rlcli.db").exists():
        return "before the database existed"
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        if not table_exists(conn, "stages"):
            return "before the schema existed"
        running = conn.execute("select name from stages where status = 'running' and pid = ? order by id", [pid])
        running = [name for (name,) in running]
        done = conn.execute("select count(*) from stages where status = 'done'").fetchone()[0]
    where = f"in {', '.join(running)}" if running else "outside any stage (start-up or exit)"
    return f"{where}, {done} stages done"


def run_status(runs: Path) -> str | None:
    """The run's status: `done` once a command has committed all of the run's work."""
    if not (runs / "rlcli.db").exists():
        return None
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        row = conn.execute("select status from runs").fetchone() if table_exists(conn, "runs") else None
    return row and row[0]


def end_reasons(runs: Path) -> set[str]:
    """How the run's failed episodes ended."""
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        return {
            reason for (reason,) in conn.execute("select distinct end_reason from episodes where status = 'failed'")
        }


def table_exists(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("select 1 from sqlite_master where type = 'table' and name = ?", [name]).fetchone() is not None


# What may legitimately differ between the fuzzed and the uninterrupted run, and why:
# - row ids (`id`, and the ids that other rows point at): a redone stage may allocate them
#   differently; rows are matched by their natural keys instead (a checkpoint by the stage that
#   wrote it, an episode by stage, task and sample);
# - wall-clock times (`*_at`) and durations (`gen_time_s`, `env_time_s`), and `pid`;
# - `perf/*` metrics: timings, which a resumed iteration also does not log (they would time the
#   resume, not the work);
# - `resumed_from_step` in a stage's result: where its last attempt started, which is what a kill
#   changes;
# - checkpoint paths: each run has its own runs dir, so they are compared relative to it;
# - the episodes a resume superseded (stage superseded/<stage>/<n>) with their turns and labels
#   (SUPERSEDED): a rollout that a kill left played with weights the resume then recomputed
#   (grpo.checkpoint_every 2 saves none after iteration 0), set aside and played again. They are
#   extra rows, which the uninterrupted run cannot have; the stage played again must equal its
#   uninterrupted self, row for row, and nothing reads the set-aside ones.
# Everything else is compared exactly on a CPU, floats and token blobs included: every random draw
# derives from the run seed, and resumed weights are loaded bit for bit from float32 safetensors, so a
# resumed run repeats the same CPU computation. On a GPU a redone update is not bit-identical (CUDA's
# kernels, the embedding's backward among them, add in no fixed order), so the floats that follow it
# (logprobs, metrics, results, weights) compare to FLOAT_TOLERANCE there; tokens, ids and every other
# value stay exact. Seen on an H100: one last bit of some rollout/1 logprobs after a redone train/0.
EXACT_FLOATS = DEVICE == "cpu"
FLOAT_TOLERANCE = dict(rel_tol=1e-4, abs_tol=1e-6)
VOLATILE_COLUMNS = {"id", "pid", "gen_time_s", "env_time_s", "elapsed_s"}
VOLATILE_RESULT_FIELDS = {"resumed_from_step"}
SUPERSEDED = "superseded/"

# Rows are matched on these columns (after ids are translated, see `Snapshot.normalise`), so that a
# difference names the row and the column; a table not listed here is matched on its whole row.
NATURAL_KEYS = {
    "runs": ("name",),
    "stages": ("run", "name"),
    "episodes": ("run", "stage", "task_index", "sample_index"),
    "turns": ("episode_id", "turn_index"),
    "rewards": ("episode_id", "label_set", "component"),
    "metrics": ("run", "stage", "step", "key"),
    "checkpoints": ("run", "stage"),
    "evals": ("run", "stage", "tasks"),
    "_sqlite_migrations": ("migration_set", "name"),
}


class Snapshot:
    """A runs dir reduced to what must not change when the run is killed and resumed: each table's
    rows grouped by natural key (a key with two rows is a duplicate), the files, and the folder of
    each checkpoint."""

    def __init__(self, runs: Path):
        self.runs = runs
        self.conn = sqlite3.connect(runs / "rlcli.db")
        try:
            self.checkpoints = dict(self.conn.execute("select id, stage from checkpoints"))
            self.episodes = {
                episode_id: (self.stage_name(stage), task, sample)
                for episode_id, stage, task, sample in self.conn.execute(
                    "select id, stage, task_index, sample_index from episodes"
                )
            }
            names = self.conn.execute(
                "select name from sqlite_master where type = 'table' and name not like 'sqlite_%'"
            )
            self.tables = {table: self.rows_by_key(table) for (table,) in names.fetchall()}
            # The database itself (and its -wal, -shm) is compared by its rows above.
            self.files = sorted(str(p.relative_to(runs)) for p in runs.rglob("*") if not p.name.startswith("rlcli.db"))
            self.checkpoint_folders = {
                stage: runs / self.relative(path)
                for stage, path in self.conn.execute("select stage, path from checkpoints")
            }
        finally:
            self.conn.close()

    def rows_by_key(self, table: str) -> dict[tuple, list[dict]]:
        rows = defaultdict(list)
        for row in self.rows(table):
            rows[tuple(row[c] for c in NATURAL_KEYS.get(table) or row)].append(row)
        return rows

    def rows(self, table: str):
        columns = [
            c
            for (c,) in self.conn.execute("select name from pragma_table_info(?)", [table])
            if c not in VOLATILE_COLUMNS and not c.endswith("_at")
        ]
        for values in self.conn.execute(f"select {', '.join(columns)} from {table}"):
            row = {c: self.normalise(c, v) for c, v in zip(columns, values)}
            if not (table == "metrics" and row["key"].startswith("perf/")) and not self.superseded(row):
                yield row

    @staticmethod
    def superseded(row: dict) -> bool:
        """An episode a resume set aside, or a turn or label of one (its episode_id is normalised to
        (stage, task, sample))."""
        episode = row.get("episode_id")
        stage = episode[0] if isinstance(episode, tuple) else row.get("stage")
        return isinstance(stage, str) and stage.startswith(SUPERSEDED)

    def normalise(self, column: str, value):
        if value is None:
            return None
        if column == "episode_id":
            return self.episodes[value]
        if column == "checkpoint_id":
            return self.checkpoints[value]
        if column in ("stage", "name"):
            return self.stage_name(value)
        if column == "policy":  # a checkpoint id, or a name such as `base` or `train/0`
            return self.checkpoints[int(value)] if value.isdigit() else value
        if column == "path":
            return self.relative(value)
        if column == "result":
            return json.dumps(self.result(json.loads(value)), sort_keys=True)
        return value

    def stage_name(self, name: str) -> str:
        """`eval/ckpt-3@t0.8-k1` names a checkpoint by id: name it by the stage that wrote it."""
        return re.sub(r"ckpt-(\d+)", lambda m: f"ckpt[{self.checkpoints[int(m[1])]}]", name)

    def result(self, summary: dict) -> dict:
        summary = {k: v for k, v in summary.items() if k not in VOLATILE_RESULT_FIELDS}
        if "checkpoint_id" in summary:
            summary["checkpoint_id"] = self.checkpoints[summary["checkpoint_id"]]
        if "path" in summary:
            summary["path"] = self.relative(summary["path"])
        return summary

    def relative(self, path: str) -> str:
        """A checkpoint path relative to the runs dir, however it was stored (absolute, relative to
        the runs dir, or relative to the directory the command ran in)."""
        runs = self.runs.resolve()
        for candidate in (Path(path), self.runs / path, self.runs.parent / path):
            if candidate.is_absolute() and candidate.exists() and candidate.resolve().is_relative_to(runs):
                return str(candidate.resolve().relative_to(runs))
        raise AssertionError(f"checkpoint path {path!r} is not a folder inside {self.runs}")


def differences(table: str, expected: dict[tuple, list[dict]], actual: dict[tuple, list[dict]]) -> list[str]:
    found = []
    for key in expected.keys() | actual.keys():
        a, b = expected.get(key, []), actual.get(key, [])
        if len(a) != len(b):
            found.append(f"{table} {key}: {len(a)} row(s) uninterrupted, {len(b)} after the kills")
        elif not same(a, b):
            columns = [c for c in a[0] if not same(a[0][c], b[0].get(c), c)] or ["(columns)"]
            found += [
                f"{table} {key}: {c} = {a[0].get(c)!r:.80} uninterrupted, {b[0].get(c)!r:.80} after the kills"
                for c in columns
            ]
    return sorted(found)


def same(a, b, column: str = "") -> bool:
    """a == b, except that off the CPU floats compare to FLOAT_TOLERANCE: numbers, the float32
    `logprobs` blobs, and the numbers inside a JSON `result` (see EXACT_FLOATS)."""
    if EXACT_FLOATS or a == b:
        return a == b
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, **FLOAT_TOLERANCE)
    if column == "logprobs" and isinstance(a, bytes) and isinstance(b, bytes):
        x, y = (np.frombuffer(blob, dtype=np.float32) for blob in (a, b))
        return x.shape == y.shape and bool(
            np.allclose(x, y, rtol=FLOAT_TOLERANCE["rel_tol"], atol=FLOAT_TOLERANCE["abs_tol"])
        )
    if column == "result" and isinstance(a, str) and isinstance(b, str):
        return same(json.loads(a), json.loads(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], k) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, column) for x, y in zip(a, b))
    return False


def assert_same_database(clean: Snapshot, fuzzed: Snapshot) -> None:
    expected, actual = clean.tables, fuzzed.tables
    assert expected.keys() == actual.keys()
    problems = [line for table in expected for line in differences(table, expected[table], actual[table])]
    assert not problems, "the fuzzed run differs from the uninterrupted one:\n" + "\n".join(problems[:40])


def assert_same_files(clean: Snapshot, fuzzed: Snapshot) -> None:
    """The same files under each runs dir (nothing left behind by a killed save), and the same
    adapter weights in each checkpoint."""
    assert fuzzed.files == clean.files
    expected, actual = clean.checkpoint_folders, fuzzed.checkpoint_folders
    assert expected.keys() == actual.keys()
    for stage in expected:
        a, b = (load_file(folder[stage] / "adapter_model.safetensors") for folder in (expected, actual))
        assert a.keys() == b.keys(), stage
        # Exact on a CPU: the same float32 computation on the same inputs (see EXACT_FLOATS).
        changed = [
            name
            for name in a
            if not (
                torch.equal(a[name], b[name])
                if EXACT_FLOATS
                else torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6)
            )
        ]
        assert not changed, f"checkpoint {stage}: tensors differ: {changed[:5]}"


class Fuzzer:
    """Seeded random kills of `rlcli run`, the delays spread over one invocation's duration."""

    def __init__(self, recipe: Path, seed: int, duration: float):
        self.recipe, self.seed, self.duration = recipe, seed, duration
        self.rng = random.Random(seed)
        self.kills = self.invocations = 0

    def kill_and_resume(self, runs: Path, kills: int) -> int:
        """Run the recipe in `runs`, killing it up to `kills` times and resuming after each kill,
        then to the end. Returns the kills used: fewer when the run completed first, because an
        invocation outran its kill (the machine got less loaded than when the duration was
        measured) or was killed on its way out, after its last commit."""
        used = 0
        while used < kills:
            delay = self.rng.uniform(0, self.duration)
            moment = f"{delay:.2f} s of {self.duration:.2f} s (seed {self.seed})"
            invocation = self.start(runs)
            if invocation.finished_within(delay):
                print(f"{runs.name}: complete before the kill at {moment}")
                if used == 0:  # an uninterrupted run: a fresher measure of the duration
                    self.duration = invocation.elapsed
                return used
            invocation.kill()
            used += 1
            self.kills += 1
            print(f"{runs.name}: kill {self.kills} at {moment}, {what_was_killed(runs, invocation.proc.pid)}")
            if run_status(runs) == "done":
                break
        # The rest of the run; after a kill on the way out, a rerun that must change nothing.
        assert self.start(runs).finished_within(600)
        return used

    def start(self, runs: Path) -> Invocation:
        self.invocations += 1
        return Invocation(self.recipe, runs, runs.parent / f"invocation-{self.invocations}.log")


@pytest.mark.parametrize(
    "kills, seed",
    [
        pytest.param(3, 1, id="3-kills", marks=[pytest.mark.fuzz, pytest.mark.slow]),
        pytest.param(20, 2, id="20-kills", marks=[pytest.mark.fuzz, pytest.mark.slow]),
    ],
)
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, kills, seed):
    recipe = tiny_recipe(tmp_path)
    clean = tmp_path / "clean"
    uninterrupted = Invocation(recipe, clean, tmp_path / "clean.log")
    assert uninterrupted.finished_within(600)
    assert {"env_timeout", "error"} <= end_reasons(clean), "the recipe's env times out and raises"
    expected, fuzzer = Snapshot(clean), Fuzzer(recipe, seed, uninterrupted.elapsed)

    # Kills that a completed run did not use go to a fresh run, so that kills land in unfinished
    # work; each fuzzed run is compared with the uninterrupted one.
    kills_left, fuzzed_runs = kills, 0
    while kills_left:
        fuzzed_runs += 1
        fuzzed = tmp_path / f"fuzzed-{fuzzed_runs}"
        kills_left -= fuzzer.kill_and_resume(fuzzed, kills_left)
        with closing(sqlite3.connect(fuzzed / "rlcli.db")) as conn:
            aside = conn.execute("select count(*) from episodes where stage like ?", [SUPERSEDED + "%"]).fetchone()[0]
        print(f"{fuzzed.name}: complete, {aside} episodes superseded by its resumes")
        actual = Snapshot(fuzzed)
        assert_same_database(expected, actual)
        assert_same_files(expected, actual)


def nudge_every_update(monkeypatch) -> None:
    """Each GRPO update, in this process, ends with its trainable weights moved by 1e-3: the same in
    every run that has it, and not in a process without it. A stand-in for a GPU, where an update
    redone after a kill computes other weights than the killed process had (its reductions are not
    bit-reproducible), which a CPU never does."""
    from rlcli.engine.grpo.learner import GrpoTrainer

    update = GrpoTrainer.update

    def nudged(self, batch):
        stats = update(self, batch)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:
                    p.add_(1e-3)
        return stats

    monkeypatch.setattr(GrpoTrainer, "update", nudged)


def test_a_resume_redoes_the_work_after_the_last_checkpoint_as_an_uninterrupted_run_does(tmp_path, monkeypatch):
    """grpo.checkpoint_every 2: iteration 0 saves no checkpoint, and rollout/1 is played with its
    weights. Killed in train/1, the run resumes from the start of the phase and redoes train/0, whose
    weights may differ from the lost ones (on a GPU; nudge_every_update stands in for it here): the
    rollout/1 they played must not be trained on, but played again with the redone weights, as an
    uninterrupted run with those weights plays it. The run then equals that uninterrupted run: every
    table (but the set-aside episodes, SUPERSEDED) and the weights of every checkpoint. Its env times
    out and raises on some tasks (FLAKY_ENV): the resume must not play those episodes again."""
    (tmp_path / "distinct.py").write_text(DISTINCT_CHARS)
    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "fuzz", "seed": 0},
        env={"name": str(tmp_path / "flaky.py"), **FLAKY},
        rollout={"tasks": 6, "group_size": 2, "max_new_tokens": 12, "batch_size": 4, "temperature": 1.0},
        rewards=[{"fn": "env_return"}, {"fn": f"{tmp_path / 'distinct.py'}:distinct", "name": "distinct"}],
        grpo={"iterations": 2, "lr": 1e-2, "checkpoint_every": 2},
    )
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    args = ["train", "grpo", "-r", str(recipe)]

    # Killed at train/1's commit (its update done, its checkpoint folder written, its row not): no
    # checkpoint row yet, so the resume starts the phase again. The killed process is not nudged.
    training = "select count(*) from stages where name = 'train/1' and status = 'running'"
    kill_when(args, killed, training, 1, timeout=300)
    with closing(sqlite3.connect(killed / "rlcli.db")) as conn:
        assert conn.execute("select count(*) from checkpoints").fetchone() == (0,)
        done = {name for (name,) in conn.execute("select name from stages where status = 'done'")}
        failed = conn.execute(
            "select end_reason, count(*) from episodes where status = 'failed' group by 1 order by 1"
        ).fetchall()
    assert {"train/0", "rollout/1", "label/1"} <= done
    assert failed == [("env_timeout", 4), ("error", 4)], "the env timed out and raised in both rollouts"

    nudge_every_update(monkeypatch)
    resumed = run_in_process(args, killed, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted = run_in_process(args, clean, cwd=tmp_path)
    assert uninterrupted.returncode == 0, uninterrupted.stderr

    expected, actual = Snapshot(clean), Snapshot(killed)
    assert_same_database(expected, actual)
    assert_same_files(expected, actual)
    with closing(sqlite3.connect(killed / "rlcli.db")) as conn:
        aside = conn.execute("select stage, policy, count(*) from episodes where stage like 'superseded/%' group by 1")
        assert aside.fetchall() == [("superseded/rollout/1/1", "train/0", 12)]
    assert "rollout/1 was begun with weights that this resume recomputes" in resumed.stderr


# guess_number whose second step on seed 2 outlasts env.step_timeout_s while the runs dir holds a file
# `hang`: a timeout that need not recur (the env's backend was slow for a while).
HANGS_FOR_A_WHILE = """
import os
import time
from pathlib import Path

from rlcli.builtin_envs.guess_number import GuessNumber


class SlowForAWhile(GuessNumber):
    def reset(self, seed):
        self.seed = seed
        return super().reset(seed)

    def step(self, action):
        if self.turns == 1 and self.seed == 2 and (Path(os.environ["RLCLI_HOME"]) / "hang").exists():
            time.sleep(2.0)
        return super().step(action)


def make_env(**kwargs):
    return SlowForAWhile(**kwargs)
"""


def test_a_resume_trains_on_the_episodes_an_uninterrupted_run_trained_on(tmp_path):
    """Issue 32, item 2: episodes that timed out stay failed and out of train/i in a run never
    interrupted; killed in train/i, the resume must not play them again (the timeout need not recur,
    and here it does not) and train on more than that run did. A stored episode is final."""
    (tmp_path / "slow.py").write_text(HANGS_FOR_A_WHILE)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "fuzz", "seed": 0},
        env={"name": str(tmp_path / "slow.py"), **FLAKY},
        rollout={"tasks": 4, "group_size": 2, "max_new_tokens": 12, "batch_size": 4, "temperature": 1.0},
        grpo={"iterations": 1, "lr": 1e-2, "drop_zero_var_groups": False},
    )
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    args = ["train", "grpo", "-r", str(recipe)]
    for runs in (clean, killed):
        runs.mkdir()
        (runs / "hang").touch()
    uninterrupted = run_in_process(args, clean, cwd=tmp_path)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert end_reasons(clean) == {"env_timeout"}

    kill_when(args, killed, "select count(*) from stages where name = 'train/0' and status = 'running'", 1)
    (killed / "hang").unlink()  # the env is fast again
    resumed = run_in_process(args, killed, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    for runs in (clean, killed):
        (runs / "hang").unlink(missing_ok=True)
    expected, actual = Snapshot(clean), Snapshot(killed)
    assert_same_database(expected, actual)
    assert_same_files(expected, actual)


def test_superseded_episodes_are_kept_and_read_by_nothing_that_trains_or_draws(tmp_path):
    """store/episodes.py supersede_stage: the episodes move with their turns and labels, the stage and
    label rows go, and task statistics, grpo.replay's candidates and SFT on the run's episodes no
    longer see them (nor a task_stats row that only they made)."""
    from rlcli.store.episodes import episodes_for_sft, stage_episodes, store_episodes, store_rewards, supersede_stage
    from rlcli.store.records import Episode, RewardRow, Turn
    from rlcli.store.replays import replay_candidates
    from rlcli.store.tasks import compute_task_stats, refresh_task_stats, stored_task_stats

    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    rundb, run, store = ctx.rundb, ctx.run, ctx.store

    def episode(stage: str, iteration: int, task: int) -> Episode:
        return Episode(
            id=None, run=run, stage=stage, iteration=iteration, split="train", task_index=task, sample_index=0,
            seed=task, policy=f"train/{iteration - 1}", status="ok", end_reason=None, env_return=1.0, success=True,
            num_turns=1, num_tokens=2, task={}, messages=[], template_consistent=True, error=None,
            created_at="2025-01-01T00:00:00.000+00:00", turns=[Turn(0, [1, 2], [3, 4], [-1.0, -1.0])],
        )  # fmt: skip

    store_episodes(rundb, [episode("rollout/1", 1, 0), episode("rollout/2", 2, 0), episode("rollout/2", 2, 5)])
    ids = {(e.stage, e.task_index): e.id for s in ("rollout/1", "rollout/2") for e in stage_episodes(store, s)}
    store_rewards(rundb, [RewardRow(i, "grpo", "total", 1.0, None) for i in ids.values()])
    for stage in ("rollout/2", "label/2", "label/mine/rollout/2", "rollout/1"):
        rundb.mark_stage(run, stage, "done")
    for stage in ("rollout/1", "rollout/2"):
        refresh_task_stats(store, stage, "grpo")
    assert [(s.task_index, s.attempts) for s in stored_task_stats(store, "grpo")] == [(0, 2), (5, 1)]

    aside, moved = supersede_stage(store, "rollout/2", ["rollout/2", "label/2", "label/mine/rollout/2"])
    assert (aside, moved) == ("superseded/rollout/2/1", 2)
    assert [s.name for s in rundb.stages(run)] == ["rollout/1"]
    kept = stage_episodes(store, aside)
    assert {e.id for e in kept} == {ids["rollout/2", 0], ids["rollout/2", 5]}
    refresh_task_stats(store, aside, "grpo")
    assert [(s.task_index, s.attempts) for s in stored_task_stats(store, "grpo")] == [(0, 1)]
    assert [(s.task_index, s.attempts) for s in compute_task_stats(store, "grpo")] == [(0, 1)]
    assert [e.episode.id for e in replay_candidates(store, 0, 9, "grpo", 0.5, 5)] == [ids["rollout/1", 0]]
    assert [e.episode.id for e in episodes_for_sft(store)] == [ids["rollout/1", 0]]
    # Superseded again (a second kill): the next set-aside stage.
    store_episodes(rundb, [episode("rollout/2", 2, 0)])
    assert supersede_stage(store, "rollout/2", ["rollout/2"]) == ("superseded/rollout/2/2", 1)
