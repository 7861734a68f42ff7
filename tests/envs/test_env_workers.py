"""env.workers: envs in worker processes: same episodes as in the main process, hard time-outs,
crashes that fail only their episodes, limits, continuous batching of turns, kill -9 and resume."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest

from helpers import alive, cli, kill_at_event, kill_when, make_ctx, run_in_process, write_env_file, write_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.envs.protocol import EnvTimeout
from rlcli.envs.workers import EnvLost, EnvReply, EnvWorkerPool
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


# Hours of big-integer arithmetic in C: a call stuck where no thread can stop it. (The former
# "(((9**64)**64)**64)**16" took 1.3-1.6 s: on a fast machine it finished under a 1.5 s limit.)
HANGING_CALL = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "((((9**64)**64)**64)**64)**64"}}</tool_call>'
)


def test_the_hanging_calculator_is_killed_at_the_timeout_and_its_worker_replaced(tmp_path):
    with EnvWorkerPool("calculator", {}, 1, timeout_s=30) as pool:
        key = pool.reset(0)
        [reply] = pool.replies()
        assert reply.failure is None
        # The first env of a worker describes its tools to the model (transformers imports torch for
        # that, seconds on a loaded machine); the step is what this test times.
        pool.timeout_s = 0.3
        stuck_pid = pool.workers[0].process.pid
        pool.step(key, HANGING_CALL)
        [reply] = pool.replies()
        assert isinstance(reply.failure, EnvTimeout)
        assert "exceeded the 0.3s step time limit (its env worker was killed)" in str(reply.failure)
        with pytest.raises(ProcessLookupError):  # the step did not go on computing in the background
            os.kill(stuck_pid, 0)
        # The replacement worker serves the next episode (its first env pays the imports again).
        pool.release(key)
        pool.timeout_s = 30
        again = pool.reset(1)
        [reply] = pool.replies()
        assert reply.key == again and reply.failure is None and pool.workers[0].process.pid != stuck_pid


def test_a_hanging_step_ends_its_episode_as_env_timeout_whichever_worker_it_shares(tmp_path):
    # Seeds 0, 1, 4 and 5 hang (an odd first factor); each worker hosts some of them and some that do
    # not, so a hanging episode may first be lost through another's timeout: played again, it hangs
    # again and ends env_timeout all the same.
    env_file = write_env_file(
        tmp_path / "hang.py",
        f"""
        # Describing the calculator tool to the model imports these (seconds on a loaded machine):
        # imported with this file, as a worker starts, so that only the hang is timed.
        import torch
        import transformers.utils.chat_template_utils

        from rlcli.builtin_envs.calculator import Calculator

        class Hanging(Calculator):
            def expert_action(self):
                if self.a % 2 and self.last_result is None:
                    return {HANGING_CALL!r}
                return super().expert_action()

        def make_env():
            return Hanging()
        """,
    )
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "step_timeout_s": 0.5, "workers": 2},
        rollout={"tasks": 6, "group_size": 1, "batch_size": 6},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    for seed in (0, 1, 4, 5):
        ep = by_seed[seed]
        assert ep["status"] == "failed" and ep["end_reason"] == "env_timeout" and ep["transient"] == 1, ep
        assert "env step failed: step exceeded the 0.5s step time limit" in ep["error"]
    assert by_seed[2]["status"] == by_seed[3]["status"] == "ok"
    assert summary.failed == 4 and summary.replayed_lost == sum(e["lost"] for e in by_seed.values()) > 0


# Issue 41's rollout: 6 tasks x 2 samples, one turn; the step hangs for the tasks whose seed % 3 == 1
# (4 of the 12 episodes), as a stuck tool call or a frozen page does. Every reset is noted, so that a
# test can tell when episodes are being played again.
STUCK_ENV = """
import time
from pathlib import Path

class Stuck:
    def reset(self, seed):
        with Path(__file__).with_name("resets").open("a") as f:
            f.write(f"{seed}\\n")
        self.seed = seed
        return f"Task {seed}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        if self.seed % 3 == 1:
            time.sleep(3600)
        return "ok", float(len(action) % 2), True, False, {}

def make_env():
    return Stuck()
"""


def stuck_recipe(tmp_path, tasks: int = 6, **env):
    env_file = write_env_file(tmp_path / "stuck.py", STUCK_ENV)
    return write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "step_timeout_s": 1, **env},
        rollout={"tasks": tasks, "group_size": 2, "max_new_tokens": 6, "batch_size": 2 * tasks},
    )


def stuck_outcome_of(ctx, stage: str = "rollout") -> dict:
    """Issue 41's table row: how many episodes ended ok, env_timeout or otherwise."""
    ends = [e["end_reason"] if e["status"] == "failed" else "ok" for e in _episodes(ctx, stage)]
    return {end: ends.count(end) for end in set(ends)}


def check_stuck_rollout(ctx, reference: list | None) -> list:
    """Every episode that does not hang ends ok, the 4 that do end env_timeout, and the episodes lost
    with a killed worker were played again to what they would have been without the loss."""
    assert stuck_outcome_of(ctx) == {"ok": 8, "env_timeout": 4}
    for ep in _episodes(ctx):
        hangs = ep["seed"] % 3 == 1
        assert (ep["end_reason"] == "env_timeout") == hangs, ep
        if hangs:
            limit = f"env step failed: step exceeded the {ctx.recipe.env.step_timeout_s:g}s step time limit"
            assert limit in ep["error"] and ep["transient"] == 1
        assert ep["attempts"] == 1 + ep["lost"]  # env.timeout_retries 0: only lost attempts are played again
        lines = (ep["earlier_errors"] or "").splitlines()
        assert len(lines) == ep["lost"] and all("the env's state was lost" in line for line in lines), ep
    played = _played(ctx)
    if reference is not None:
        for mine, theirs in zip(played, reference, strict=True):
            assert mine[:7] == theirs[:7]  # tokens, rewards, transcripts, end reasons: as without losses
    return played


@pytest.mark.slow
def test_episodes_lost_with_a_killed_worker_are_played_again_in_the_stage(tmp_path):
    recipe = stuck_recipe(tmp_path)
    reference, replayed = None, {}
    for workers in (0, 2, 4):
        ctx = make_ctx(recipe, tmp_path / f"runs-{workers}", [f"env.workers={workers}"])
        summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
        reference = check_stuck_rollout(ctx, reference)
        replayed[workers] = summary.replayed_lost
        assert summary.replayed_lost == sum(e["lost"] for e in _episodes(ctx))
    # In the main process nothing is killed; in 2 or 4 workers a hang loses its worker-mates' envs.
    assert replayed[0] == 0 and replayed[2] > 0 and replayed[4] > 0


def test_with_isolation_episode_a_timeout_loses_no_other_episode(tmp_path):
    recipe = stuck_recipe(tmp_path, workers=4, isolation="episode")
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    check_stuck_rollout(ctx, None)
    assert summary.replayed_lost == 0
    assert len((tmp_path / "resets").read_text().split()) == 12  # each episode reset once


def test_timeout_retries_plays_a_timed_out_episode_again_in_the_stage(tmp_path):
    recipe = stuck_recipe(tmp_path, tasks=2, workers=0, timeout_retries=1)  # task 1 hangs, task 0 does not
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    by_seed = {}
    for ep in _episodes(ctx):
        by_seed.setdefault(ep["seed"], []).append(ep)
    for ep in by_seed[1]:
        assert ep["end_reason"] == "env_timeout" and ep["attempts"] == 2 and ep["lost"] == 0
        assert ep["earlier_errors"].startswith("attempt 1: env step failed: step exceeded the 1s step time limit")
    assert {ep["attempts"] for ep in by_seed[0]} == {1}


@pytest.mark.slow
def test_a_grpo_iteration_with_a_hanging_task_trains_on_every_other_episode(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo

    recipe = stuck_recipe(tmp_path, workers=2)
    # Every non-hanging episode trains, whatever its group's rewards.
    ctx = make_ctx(recipe, tmp_path / "runs", ["grpo.drop_zero_var_groups=false"])
    run_grpo(ctx)
    assert stuck_outcome_of(ctx, "rollout/0") == {"ok": 8, "env_timeout": 4}
    [sequences] = ctx.rundb.metrics(ctx.run, "train/sequences")
    [replayed] = ctx.rundb.metrics(ctx.run, "rollout/replayed_lost")
    assert sequences.value == 8  # one turn each
    assert replayed.value == sum(e["lost"] for e in _episodes(ctx, "rollout/0")) > 0


@pytest.mark.slow
def test_kill_during_the_replays_of_lost_episodes_resumes_to_the_same_episodes(tmp_path, capsys, monkeypatch):
    recipe = stuck_recipe(tmp_path, workers=2)
    runs = tmp_path / "runs"
    args = ["rollout", "-r", str(recipe), "--policy", "base"]
    resets = tmp_path / "resets"
    # More resets than episodes: the lost episodes are being played again. Killed at the first database
    # write after that: the chunk's commit, which the kill prevents.
    kill_at_event(args, runs, {"lines": str(resets), "more_than": 12}, timeout=300)
    assert _lines(resets) > 12, "the kill must land during the replays"
    with sqlite3.connect(runs / "rlcli.db") as conn:
        assert conn.execute("select count(*) from episodes").fetchone()[0] == 0  # the chunk stores all or nothing

    # The resume and the uninterrupted reference run in this process: starting rlcli takes seconds.
    monkeypatch.setenv("RLCLI_HOME", str(runs))
    assert cli(capsys, *args)[0] == 0
    clean = tmp_path / "clean"
    monkeypatch.setenv("RLCLI_HOME", str(clean))
    assert cli(capsys, *args)[0] == 0
    same = (
        "select e.task_index, e.sample_index, e.status, e.end_reason, t.completion_ids, t.reward from episodes e "
        "left join turns t on t.episode_id = e.id order by 1, 2"
    )
    with sqlite3.connect(runs / "rlcli.db") as conn:
        resumed = conn.execute(same).fetchall()
    with sqlite3.connect(clean / "rlcli.db") as conn:
        reference = conn.execute(same).fetchall()
    assert len(resumed) == 12 and resumed == reference
    assert [r[3] for r in resumed].count("env_timeout") == 4


def _lines(path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


class LosingHost:
    """An env host whose every env is lost at once, as when a worker dies between calls again and again."""

    def __init__(self):
        self.keys, self.answered = 0, []

    def reset(self, seed: int) -> int:
        self.keys += 1
        self.answered.append(EnvReply(self.keys, "reset", failure=EnvLost("its env worker died"), failed_in="reset"))
        return self.keys

    def replies(self, timeout=None):
        out, self.answered = self.answered, []
        return out

    def release(self, key: int) -> None:
        pass


def test_a_pass_whose_every_episode_was_lost_is_stored_as_failed_instead_of_played_for_ever():
    from rlcli.engine.episode_runner import EpisodeRunner
    from rlcli.engine.turns import EpisodeSpec, RolloutLimits

    runner = EpisodeRunner(LosingHost(), RolloutLimits(max_turns=1, max_length=64, step_timeout_s=1))
    [ep] = runner.run([EpisodeSpec(0, 0, 0, 0)])
    assert ep.status == "failed" and ep.env_lost and "its env worker died" in ep.error


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
    lost = [e for e in by_seed.values() if e["lost"]]
    assert "its env worker was killed by SIGSEGV" in by_seed[1]["error"] and by_seed[1]["transient"] == 0
    assert "its env worker exited with status 3" in by_seed[2]["error"] and by_seed[2]["transient"] == 0
    # The envs lost with a crashed worker were played again in the stage, from their start.
    assert {s for s, e in by_seed.items() if e["status"] == "ok"} == {0, 4, 5, 6, 7}
    assert all("worker was replaced after another episode's call crashed" in e["earlier_errors"] for e in lost), lost
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
    with pytest.raises(UsageError, match="env.isolation episode gives each live env a worker process"):
        load_recipe(recipe, ["env.worker_cpu_s=null", "env.isolation=episode"])


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
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "an env worker outlived the killed rollout"

    done = run_in_process(args, runs)
    assert done.returncode == 0, done.stderr
    clean = tmp_path / "clean"
    assert run_in_process(args, clean).returncode == 0
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


# An env with a subprocess of its own (a `sleep`, standing for a game server or a browser): its pid
# goes to the file `children` beside the env file. `crash` kills the worker, `hang` outlasts the limit.
CHILD_ENV = """
import os
import signal
import subprocess
import time
from pathlib import Path

class WithChild:
    def reset(self, seed):
        self.child = subprocess.Popen(["sleep", "300"])
        with Path(__file__).with_name("children").open("a") as f:
            f.write(f"{self.child.pid}\\n")
        return "Say anything.", {"task": {}}
    def step(self, action):
        if action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            time.sleep(3600)
        return "ok", 1.0, True, False, {}

def make_env():
    return WithChild()
"""


def _children(folder) -> list[int]:
    path = folder / "children"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _gone(pids: list[int], within_s: float = 20) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


@pytest.mark.parametrize("action", ["crash", "hang"])
def test_an_envs_subprocesses_die_with_its_crashed_or_timed_out_worker(tmp_path, action):
    env_file = write_env_file(tmp_path / "child.py", CHILD_ENV)
    with EnvWorkerPool(str(env_file), {}, 1, timeout_s=2, root=tmp_path) as pool:
        key = pool.reset(0)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
        [child] = _children(tmp_path)
        assert alive(child)
        pool.step(key, action)
        [reply] = pool.replies()
        assert "killed by SIGKILL" in str(reply.failure) or "time limit" in str(reply.failure), reply.failure
        assert _gone([child]), f"the env's subprocess outlived its {action}ed worker"
        # The replacement worker serves new envs.
        key = pool.reset(1)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
    assert _gone(_children(tmp_path)), "an env's subprocess outlived the closed pool"


KILLED_PARENT = """
import sys, time
from rlcli.envs.workers import EnvWorkerPool

pool = EnvWorkerPool(sys.argv[1], {}, 1, timeout_s=30)
pool.reset(0)
assert pool.replies()[0].failure is None
print(pool.workers[0].process.pid, flush=True)
time.sleep(3600)
"""


def test_an_envs_subprocesses_die_with_a_killed_rlcli(tmp_path):
    env_file = write_env_file(tmp_path / "child.py", CHILD_ENV)
    parent = subprocess.Popen(
        [sys.executable, "-c", KILLED_PARENT, str(env_file)], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(parent.stdout.readline())
        [child] = _children(tmp_path)
        assert alive(worker) and alive(child)
    finally:
        parent.kill()  # kill -9: nothing of rlcli's runs after it
        parent.wait()
    assert _gone([worker]), "the env worker outlived the killed main process"
    assert _gone([child]), "the env's subprocess outlived the killed main process"


# --- run.threads --------------------------------------------------------------------


def test_run_threads_sets_torch_threads_and_a_busy_machine_is_warned_about(monkeypatch):
    import torch

    from rlcli.engine import threads
    from rlcli.engine.threads import set_threads, usable_cores

    # An in-process vLLM CPU engine (an earlier test's) replaces torch.set_num_threads with a no-op for
    # the rest of the process; what is tested here is rlcli's own call, in a process without one.
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    warnings = []
    try:
        torch.set_num_threads(2)  # the suite runs with one (tests/conftest.py): something for rlcli to change
        monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
        set_threads(1, warnings.append)
        assert torch.get_num_threads() == 1 and warnings == []
        monkeypatch.setattr(threads, "busy_cores", lambda: float(usable_cores()))  # every core taken
        set_threads(1, warnings.append)
        assert len(warnings) == 1 and "leaving 0 idle for this run's 1 torch threads" in warnings[0]
    finally:
        torch.set_num_threads(before)
