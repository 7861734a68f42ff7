"""env.workers_backend: ray: the env workers as Ray actors on a local Ray of 2 CPUs: same episodes as
in the main process, hard time-outs, crashes that fail only their episodes, clear usage errors."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from helpers import make_ctx, write_env_file, write_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.envs.protocol import EnvTimeout
from rlcli.errors import UsageError
from test_env_workers import (
    CRASHING_ENV,
    HANGING_CALL,
    JITTERY_ENV,
    _episodes,
    _played,
    check_stuck_rollout,
    stuck_recipe,
)

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'rlcli[ray]')"
)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module: starting one takes seconds. RayEnvHost joins it, as it would join
    a cluster, and leaves it running."""
    import ray

    # Room for four actors and their replacements: Ray frees a killed actor's CPU some time after the
    # kill, and a replacement waits for a free one (a CI run once waited out START_TIMEOUT_S).
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@needs_ray
def test_same_seeds_give_the_same_episodes_with_ray_actors_as_in_the_main_process(tmp_path, local_ray):
    env_file = write_env_file(tmp_path / "jittery.py", JITTERY_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 3},
        rollout={"tasks": 3, "group_size": 2, "max_new_tokens": 6, "batch_size": 6},
    )
    played = {}
    for name, overrides in {"main": [], "ray": ["env.workers=2", "env.workers_backend=ray"]}.items():
        ctx = make_ctx(recipe, tmp_path / f"runs-{name}", overrides)
        summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
        assert (summary.episodes, summary.failed) == (6, 0)
        played[name] = _played(ctx)
    assert {len(p[6]) for p in played["main"]} == {1, 2, 3}  # episodes of 1, 2 and 3 turns
    for mine, reference in zip(played["ray"], played["main"], strict=True):
        assert mine[:7] == reference[:7]  # tokens, rewards, transcripts, end reasons: identical


@needs_ray
def test_the_hanging_calculator_is_killed_at_the_timeout_and_its_actor_replaced(local_ray):
    from rlcli.envs.ray_workers import RayEnvHost

    with RayEnvHost("calculator", {}, 1, timeout_s=30) as host:
        key = host.reset(0)
        [reply] = host.replies()
        assert reply.failure is None
        # The first env of an actor describes its tools to the model (transformers imports torch for
        # that, seconds on a loaded machine); the step is what this test times.
        host.timeout_s = 0.5
        stuck = host.actors[0].handle
        host.step(key, HANGING_CALL)
        [reply] = host.replies()
        assert isinstance(reply.failure, EnvTimeout)
        assert "exceeded the 0.5s step time limit (its env worker was killed)" in str(reply.failure)
        with pytest.raises(local_ray.exceptions.RayActorError):  # killed, not computing on in the background
            local_ray.get(stuck.ready.remote(), timeout=30)
        host.release(key)
        host.timeout_s = 30  # the replacement actor's first env pays the imports again
        again = host.reset(1)
        [reply] = host.replies()
        assert reply.key == again and reply.failure is None


@needs_ray
def test_a_hanging_step_ends_its_episode_as_env_timeout_with_ray(tmp_path, local_ray):
    # Seeds 0 and 1 hang (an odd first factor), 2 and 3 do not; each actor hosts one of each, so a
    # hang's timeout also loses the other env of its actor: that episode is played again elsewhere.
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
        env={"name": str(env_file), "step_timeout_s": 3, "workers": 2, "workers_backend": "ray"},
        rollout={"tasks": 4, "group_size": 1, "batch_size": 4},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    for seed in (0, 1):
        ep = by_seed[seed]
        assert ep["status"] == "failed" and ep["end_reason"] == "env_timeout" and ep["transient"] == 1, ep
        assert "env step failed: step exceeded the 3s step time limit" in ep["error"]
    assert all(by_seed[seed]["status"] == "ok" for seed in (2, 3))
    assert summary.failed == 2 and summary.replayed_lost == sum(e["lost"] for e in by_seed.values())


@needs_ray
@pytest.mark.slow
def test_episodes_lost_with_a_killed_actor_are_played_again_on_another(tmp_path, local_ray):
    # A Ray call takes longer to come back than a pipe's message: on a busy machine, a non-hanging call
    # once outlasted a 1 s limit.
    recipe = stuck_recipe(tmp_path, step_timeout_s=3)
    reference = check_stuck_rollout(_rollout(recipe, tmp_path / "runs-main", ["env.step_timeout_s=1"]), None)
    for workers in (2, 4):
        ctx = _rollout(recipe, tmp_path / f"runs-{workers}", [f"env.workers={workers}", "env.workers_backend=ray"])
        check_stuck_rollout(ctx, reference)
        assert sum(e["lost"] for e in _episodes(ctx)) > 0


def _rollout(recipe, runs, overrides):
    ctx = make_ctx(recipe, runs, overrides)
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    return ctx


@needs_ray
def test_an_actor_that_dies_fails_only_its_episodes_and_the_stage_goes_on(tmp_path, local_ray):
    env_file = write_env_file(tmp_path / "crash.py", CRASHING_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 2, "workers_backend": "ray"},
        rollout={"tasks": 6, "group_size": 1, "batch_size": 6},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    for seed in (1, 2):  # a segfault, os._exit
        assert "its env worker (a Ray actor) died" in by_seed[seed]["error"] and by_seed[seed]["transient"] == 0
    # The envs lost with a dead actor were played again in the stage, on another actor.
    assert {s for s, e in by_seed.items() if e["status"] == "ok"} == {0, 4, 5}
    lost = [e for e in by_seed.values() if e["lost"]]
    assert all("worker was replaced after another episode's call crashed" in e["earlier_errors"] for e in lost), lost
    assert "SystemExit: seed 3 gives up" in by_seed[3]["error"]  # sys.exit fails the call, not the actor


SPINNING_ENV = """
class Spinning:
    def reset(self, seed):
        self.seed = seed
        return "Say anything.", {"task": {}}
    def step(self, action):
        while self.seed == 1:  # spins past env.worker_cpu_s
            pass
        return "ok", 1.0, True, False, {}
    def expert_action(self):
        return "anything"

def make_env():
    return Spinning()
"""


@needs_ray
def test_worker_cpu_s_kills_an_actor_that_spins(tmp_path, local_ray):
    env_file = write_env_file(tmp_path / "spin.py", SPINNING_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 2, "workers_backend": "ray", "worker_cpu_s": 1, "step_timeout_s": 60},
        rollout={"tasks": 2, "group_size": 1, "batch_size": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    assert by_seed[0]["status"] == "ok"
    assert "more than env.worker_cpu_s=1 CPU seconds" in by_seed[1]["error"] and by_seed[1]["transient"] == 0


@needs_ray
def test_an_env_name_that_loads_nowhere_is_one_sentence_with_ray(local_ray):
    from rlcli.envs.ray_workers import RayEnvHost

    with pytest.raises(UsageError, match="nosuch"), RayEnvHost("nosuch", {}, 1, timeout_s=5):
        pass


def test_ray_backend_needs_workers_and_ray_address_needs_the_ray_backend(tmp_path):
    from rlcli.recipe import load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "arithmetic", "workers_backend": "ray"})
    with pytest.raises(UsageError, match="set env.workers to 1 or more"):
        load_recipe(recipe, [])
    with pytest.raises(UsageError, match="set that too"):
        load_recipe(recipe, ["env.workers_backend=process", "env.ray_address=auto"])
    with pytest.raises(UsageError, match="not Ray actors"):
        load_recipe(recipe, ["env.workers=2", "env.worker_memory_mb=512"])


def test_ray_backend_without_ray_installed_says_how_to_install_it(monkeypatch):
    from rlcli.envs.ray_workers import RayEnvHost

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as if it were not installed
    with pytest.raises(UsageError, match=r"pip install 'rlcli\[ray\]'"):
        RayEnvHost("arithmetic", {}, 1, timeout_s=5)
