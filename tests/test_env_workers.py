"""env.workers: envs in worker processes: same episodes as in the main process, hard time-outs,
crashes that fail only their episodes, limits, continuous batching of turns, kill -9 and resume."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from helpers import kill_when, make_ctx, run_cli, write_env_file, write_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.envs.protocol import EnvTimeout
from rlcli.envs.workers import EnvWorkerPool
from rlcli.errors import UsageError
from rlcli.store.blobs import unpack_floats, unpack_ids


def _episodes(ctx, stage="rollout"):
    return list(ctx.rundb.db.query("select * from episodes where run = ? and stage = ? order by id", [ctx.run, stage]))


def _played(ctx) -> list:
    """Everything an episode is, by (task, sample): what was sampled, what the env said, how it ended."""
    out = []
    for ep in sorted(_episodes(ctx), key=lambda e: (e["task_index"], e["sample_index"])):
        turns = ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [ep["id"]])
        out.append(
            (
                ep["task_index"],
                ep["sample_index"],
                ep["status"],
                ep["end_reason"],
                ep["env_return"],
                ep["messages"],
                [(unpack_ids(t["prompt_ids"]), unpack_ids(t["completion_ids"]), t["reward"]) for t in turns],
                [unpack_floats(t["logprobs"]) for t in turns],
            )
        )
    return out


# Steps take seed-dependent times, so that with workers the envs answer in another order than asked.
JITTERY_ENV = """
import time

class Jittery:
    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return f"Task {seed}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        self.turn += 1
        time.sleep(((self.seed * 7 + self.turn * 3) % 5) * 0.01)
        reward = float(len(action) % 3 == self.seed % 3)
        return f"Turn {self.turn}: {len(action)} characters.", reward, self.turn >= 1 + self.seed % 3, False, {}

def make_env():
    return Jittery()
"""


def test_same_seeds_give_the_same_episodes_whatever_the_number_of_workers(tmp_path):
    env_file = write_env_file(tmp_path / "jittery.py", JITTERY_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 3},
        rollout={"tasks": 3, "group_size": 2, "max_new_tokens": 6, "batch_size": 6},
    )
    played = {}
    for workers in (0, 1, 2):
        ctx = make_ctx(recipe, tmp_path / f"runs-{workers}", [f"env.workers={workers}"])
        summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
        assert (summary.episodes, summary.failed) == (6, 0)
        played[workers] = _played(ctx)
    assert {len(p[6]) for p in played[0]} == {1, 2, 3}  # episodes of 1, 2 and 3 turns
    for workers in (1, 2):
        for mine, reference in zip(played[workers], played[0]):
            assert mine[:7] == reference[:7]  # tokens, rewards, transcripts, end reasons: identical
            # Which episodes share a sampling call changes the float rounding of a batched forward only.
            for lp, ref in zip(mine[7], reference[7]):
                assert lp == pytest.approx(ref, abs=1e-4)


HANGING_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "(((9**64)**64)**64)**16"}}</tool_call>'


def test_the_hanging_calculator_is_killed_at_the_timeout_and_its_worker_replaced(tmp_path):
    with EnvWorkerPool("calculator", {}, 1, timeout_s=0.3) as pool:
        key = pool.reset(0)
        [reply] = pool.replies()
        assert reply.failure is None
        stuck_pid = pool.workers[0].process.pid
        pool.step(key, HANGING_CALL)
        [reply] = pool.replies()
        assert isinstance(reply.failure, EnvTimeout)
        assert "exceeded the 0.3s step time limit (its env worker was killed)" in str(reply.failure)
        with pytest.raises(ProcessLookupError):  # the step did not go on computing in the background
            os.kill(stuck_pid, 0)
        # The replacement worker serves the next episode.
        pool.release(key)
        again = pool.reset(1)
        [reply] = pool.replies()
        assert reply.key == again and reply.failure is None and pool.workers[0].process.pid != stuck_pid


def test_a_hanging_step_ends_its_episode_as_env_timeout_and_is_played_again(tmp_path):
    env_file = write_env_file(
        tmp_path / "hang.py",
        f"""
        from pathlib import Path

        from rlcli.builtin_envs.calculator import Calculator

        FLAG = Path(__file__).with_name("hang")

        class Hanging(Calculator):
            def expert_action(self):
                if self.a % 2 and self.last_result is None and FLAG.exists():
                    return {HANGING_CALL!r}
                return super().expert_action()

        def make_env():
            return Hanging()
        """,
    )
    (tmp_path / "hang").touch()
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "step_timeout_s": 0.5, "workers": 2},
        rollout={"tasks": 6, "group_size": 1, "batch_size": 6},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    first = run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    hung = [e for e in _episodes(ctx) if e["end_reason"] == "env_timeout"]
    assert hung and first.failed >= len(hung)
    for ep in hung:
        assert ep["status"] == "failed" and ep["transient"] == 1
        assert "env step failed: step exceeded the 0.5s step time limit" in ep["error"]
    # Every other failure is an env lost with a killed worker: transient as well.
    assert all(e["transient"] == 1 for e in _episodes(ctx) if e["status"] == "failed")

    (tmp_path / "hang").unlink()
    again = run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    assert (again.episodes, again.failed) == (6, 0)
    assert {e["attempts"] for e in _episodes(ctx) if e["seed"] in {h["seed"] for h in hung}} == {2}


CRASHING_ENV = """
import os
import signal
import sys

class Crashing:
    def reset(self, seed):
        self.seed = seed
        return "Say anything.", {"task": {}}
    def step(self, action):
        if self.seed == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.seed == 2:
            os._exit(3)
        if self.seed == 3:
            sys.exit("seed 3 gives up")
        return "ok", 1.0, True, False, {}
    def expert_action(self):
        return "anything"

def make_env():
    return Crashing()
"""


def test_a_worker_that_dies_fails_only_its_episodes_and_the_stage_goes_on(tmp_path):
    env_file = write_env_file(tmp_path / "crash.py", CRASHING_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 2},
        rollout={"tasks": 8, "group_size": 1, "batch_size": 8},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    assert "its env worker was killed by SIGSEGV" in by_seed[1]["error"] and by_seed[1]["transient"] == 0
    assert "its env worker exited with status 3" in by_seed[2]["error"] and by_seed[2]["transient"] == 0
    for seed in (0, 3, 4, 5, 6, 7):  # finished, or lost with a crashed worker and worth playing again
        ep = by_seed[seed]
        assert ep["status"] == "ok" or (ep["transient"] == 1 and "env's state was lost" in ep["error"]), ep
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    assert {s for s, e in by_seed.items() if e["status"] == "ok"} == {0, 4, 5, 6, 7}
    assert "SystemExit: seed 3 gives up" in by_seed[3]["error"]  # sys.exit fails the call, not the worker
    assert by_seed[3]["transient"] == 0


LIMITED_ENV = """
class Greedy:
    def reset(self, seed):
        self.seed = seed
        return "Say anything.", {"task": {}}
    def step(self, action):
        if self.seed == 0:
            block = bytearray(1024 * 2**20)  # 1 GiB, over env.worker_memory_mb
        if self.seed == 1:
            while True:  # spins past env.worker_cpu_s
                pass
        return "ok", 1.0, True, False, {}
    def expert_action(self):
        return "anything"

def make_env():
    return Greedy()
"""


def test_worker_memory_and_cpu_limits(tmp_path):
    env_file = write_env_file(tmp_path / "greedy.py", LIMITED_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 2, "worker_memory_mb": 512, "worker_cpu_s": 1, "step_timeout_s": 60},
        rollout={"tasks": 2, "group_size": 1, "batch_size": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    assert "MemoryError" in by_seed[0]["error"]
    assert "killed by SIGXCPU (it used more than env.worker_cpu_s=1 CPU seconds)" in by_seed[1]["error"]


def test_limits_without_workers_are_refused(tmp_path):
    from rlcli.recipe import load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "arithmetic", "worker_cpu_s": 5})
    with pytest.raises(UsageError, match="set env.workers too"):
        load_recipe(recipe, [])


def test_an_env_name_that_loads_nowhere_is_one_sentence(tmp_path):
    with pytest.raises(UsageError, match="nosuch"), EnvWorkerPool("nosuch", {}, 1, timeout_s=5) as pool:
        pool.reset(0)
        pool.replies()


# Seed 0's step waits until every other episode has played all its turns: it can only finish when
# the others' turns are sampled without waiting for it (continuous batching); otherwise it times out.
WAITING_ENV = """
import time
from pathlib import Path

DONE = Path(__file__).with_name("done")

class Waiting:
    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return "Say anything.", {"task": {}}
    def step(self, action):
        self.turn += 1
        if self.seed == 0:
            while not (DONE.exists() and len(DONE.read_text().split()) == 2):
                time.sleep(0.02)
            return "ok", 1.0, True, False, {}
        if self.turn == 3:
            with DONE.open("a") as f:
                f.write(f"{self.seed} ")
        return "ok", 1.0, self.turn == 3, False, {}

def make_env():
    return Waiting()
"""


def test_episodes_whose_env_answered_are_sampled_without_waiting_for_a_slow_one(tmp_path):
    env_file = write_env_file(tmp_path / "waiting.py", WAITING_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 3, "max_turns": 3, "step_timeout_s": 60},
        rollout={"tasks": 3, "group_size": 1, "batch_size": 3},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert summary.failed == 0
    assert sorted(e["num_turns"] for e in _episodes(ctx)) == [1, 3, 3]


# Each env notes the pid of the worker it runs in, so the test can check that none outlives a kill.
PID_ENV = """
import os
import time
from pathlib import Path

class Noting:
    def reset(self, seed):
        with Path(__file__).with_name("pids").open("a") as f:
            f.write(f"{os.getpid()}\\n")
        self.turn = 0
        return "Say anything.", {"task": {}}
    def step(self, action):
        self.turn += 1
        time.sleep(0.1)
        return "ok", float(len(action) % 2), self.turn == 2, False, {}

def make_env():
    return Noting()
"""


def test_kill_during_a_rollout_with_workers_leaves_no_worker_and_resumes_without_duplicates(tmp_path):
    env_file = write_env_file(tmp_path / "noting.py", PID_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 2},
        rollout={"tasks": 12, "group_size": 2, "max_new_tokens": 8, "batch_size": 2},
    )
    runs = tmp_path / "runs"
    args = ["rollout", "-r", str(recipe), "--policy", "base"]
    stored = kill_when(args, runs, "select count(*) from episodes", 4)
    assert 0 < stored < 24, "the kill must land mid-rollout"
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert pids
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "an env worker outlived the killed rollout"

    done = run_cli(args, runs)
    assert done.returncode == 0, done.stderr
    clean = tmp_path / "clean"
    assert run_cli(args, clean).returncode == 0
    same = (
        "select e.task_index, e.sample_index, e.status, t.turn_index, t.completion_ids, t.reward from episodes e "
        "join turns t on t.episode_id = e.id order by 1, 2, 4"
    )
    with sqlite3.connect(runs / "rlcli.db") as conn:
        keys = conn.execute("select task_index, sample_index from episodes").fetchall()
        resumed = conn.execute(same).fetchall()
    with sqlite3.connect(clean / "rlcli.db") as conn:
        reference = conn.execute(same).fetchall()
    assert len(keys) == len(set(keys)) == 24
    assert resumed == reference


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- run.threads --------------------------------------------------------------------


def test_run_threads_sets_torch_threads_and_a_busy_machine_is_warned_about(monkeypatch):
    import torch

    from rlcli.engine import threads
    from rlcli.engine.threads import set_threads, usable_cores

    before = torch.get_num_threads()
    warnings = []
    try:
        monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
        set_threads(1, warnings.append)
        assert torch.get_num_threads() == 1 and warnings == []
        monkeypatch.setattr(threads, "busy_cores", lambda: float(usable_cores()))  # every core taken
        set_threads(1, warnings.append)
        assert len(warnings) == 1 and "leaving 0 idle for this run's 1 torch threads" in warnings[0]
    finally:
        torch.set_num_threads(before)
