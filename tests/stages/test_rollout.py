"""Rollouts: token-exact records, determinism, durability under kill -9, failing envs, labelling."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from helpers import (
    DEVICE,
    kill_when,
    make_ctx,
    run_in_process,
    sequence_logprobs,
    write_env_file,
    write_recipe,
)
from rlcli.engine.rollout import load_rollout_policy, run_rollout_stage
from rlcli.envs.loading import load_env
from rlcli.generation.seeds import derive_seed
from rlcli.store.blobs import unpack_floats, unpack_ids


def _episodes(ctx, stage="rollout"):
    return list(ctx.rundb.db.query("select * from episodes where run = ? and stage = ? order by id", [ctx.run, stage]))


def _turns(ctx, episode_id):
    return list(ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [episode_id]))


BUILTINS = ["arithmetic", "calculator", "guess_number", "maze"]


@pytest.mark.parametrize("env", BUILTINS)
def test_rollout_records_exact_tokens_and_logprobs(tmp_path, env):
    check_exact_records(tmp_path, env, "tiny-random")


@pytest.mark.slow
@pytest.mark.parametrize("env", BUILTINS)
def test_smollm2_rollout_records_exact_tokens_and_logprobs(tmp_path, env, smollm2_cache):
    check_exact_records(tmp_path, env, "smollm2-135m")


def check_exact_records(tmp_path, env, model):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": env, "max_turns": 3},
        model={"name": model},
        # The HF sampler's records (tests/models/test_vllm_rollout.py checks vLLM's).
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4, "engine": "hf"},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert summary.episodes == 4
    _, model, tokenizer = load_rollout_policy(ctx, "base")
    for ep in _episodes(ctx):
        assert ep["status"] == "ok", ep["error"]
        turns = _turns(ctx, ep["id"])
        assert len(turns) == ep["num_turns"] >= 1
        for t in turns:
            prompt, completion = unpack_ids(t["prompt_ids"]), unpack_ids(t["completion_ids"])
            logps = unpack_floats(t["logprobs"])
            assert len(completion) == len(logps) >= 1
            recomputed = sequence_logprobs(model, prompt + completion, len(prompt))
            assert torch.allclose(recomputed, torch.tensor(logps), atol=2e-3), (recomputed, logps)
        # Each turn's prompt extends the previous turn's prompt and sampled tokens exactly.
        assert ep["template_consistent"] == 1
        for prev, nxt in zip(turns, turns[1:]):
            seen = unpack_ids(prev["prompt_ids"]) + unpack_ids(prev["completion_ids"])
            assert unpack_ids(nxt["prompt_ids"])[: len(seen)] == seen
        # Rendering the stored transcript reproduces the prefix the model saw on the last turn.
        messages = json.loads(ep["messages"])
        last_prompt = unpack_ids(turns[-1]["prompt_ids"])
        upto = [i for i, m in enumerate(messages) if m["role"] == "assistant"][-1]
        tools = getattr(load_env(env, {})(), "tools", None)
        rendered = tokenizer.apply_chat_template(
            messages[:upto], tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert tokenizer.decode(last_prompt, skip_special_tokens=False) == rendered


def test_rollout_is_deterministic_and_independent_of_batching(tmp_path):
    # Multi-turn, so episodes end at different turns and leave the batch's turn cache.
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number", "max_turns": 3, "kwargs": {"high": 3}},
        rollout={"tasks": 3, "group_size": 2, "max_new_tokens": 6, "batch_size": 6},
    )
    a = make_ctx(recipe, tmp_path / "a")
    run_rollout_stage(a, stage="rollout", policy="base", split="train")
    b = make_ctx(recipe, tmp_path / "b", ["rollout.batch_size=2"])
    run_rollout_stage(b, stage="rollout", policy="base", split="train")
    ids_a = [unpack_ids(t["completion_ids"]) for e in _episodes(a) for t in _turns(a, e["id"])]
    ids_b = [unpack_ids(t["completion_ids"]) for e in _episodes(b) for t in _turns(b, e["id"])]
    assert ids_a == ids_b
    # Samples of a group share the task but not the sampling seed.
    eps = _episodes(a)
    assert eps[0]["seed"] == eps[1]["seed"] and eps[0]["task"] == eps[1]["task"]
    assert derive_seed(0, "rollout", 0, 0) != derive_seed(0, "rollout", 0, 1)


def test_turn_cache_prefills_only_new_tokens_and_matches_a_full_prefill():
    """Turn 2 with the cache of turn 1 (one row dropped, rows of different lengths) samples what a
    fresh prefill of the whole conversation samples, with the same logprobs."""
    from rlcli.generation.hf_sampler import TurnCache, sample_batch
    from rlcli.generation.sampler import SamplingConfig
    from rlcli.models.loading import load_policy
    from rlcli.recipe import ModelSection, QuantizationSection

    model, tokenizer = load_policy(
        ModelSection(name="tiny-random", dtype="float32"), None, QuantizationSection(), trainable=False
    )
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=5)
    gens = lambda n, salt: [torch.Generator(DEVICE).manual_seed(salt + i) for i in range(n)]  # noqa: E731
    first = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    cache = TurnCache()
    cache.align(["a", "b", "c"])
    turn1 = sample_batch(model, tokenizer, first, gens(3, 0), cfg, [2, 5, 4], turn_cache=cache)  # rows end apart
    assert [len(c) for c in cache.ids] == [len(p) + len(s.ids) - 1 for p, s in zip(first, turn1)]
    feedback = {"a": [20, 21], "c": [22, 23, 24, 25]}
    second = [first[0] + turn1[0].ids + feedback["a"], first[2] + turn1[2].ids + feedback["c"]]
    cache.align(["a", "c"])  # episode b ended
    assert cache.new_tokens(second) == [[turn1[0].ids[-1], *feedback["a"]], [turn1[2].ids[-1], *feedback["c"]]]
    cached = sample_batch(model, tokenizer, second, gens(2, 100), cfg, turn_cache=cache)
    full = sample_batch(model, tokenizer, second, gens(2, 100), cfg)
    for c, f in zip(cached, full):
        assert c.ids == f.ids
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(f.logprobs), atol=1e-4)
    # A prompt that does not extend its cached row (a rewritten transcript) gets a full prefill.
    assert cache.new_tokens([[1, 2, 3], second[1]]) is None
    cache.align(["a", "z"])
    assert cache.kv is None and cache.new_tokens(second) is None


def test_expert_policy_solves_and_stores_text_only(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", env={"name": "guess_number", "max_turns": 8}, rollout={"tasks": 4, "group_size": 1}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="demos", policy="expert", split="train")
    assert summary.success_rate == 1.0
    ep = _episodes(ctx, "demos")[0]
    assert ep["policy"] == "expert" and ep["num_tokens"] == 0


def test_raising_env_is_a_failed_episode_and_the_rest_go_on(tmp_path):
    env_file = write_env_file(
        tmp_path / "flaky.py",
        """
        class Flaky:
            def reset(self, seed):
                self.seed = seed
                return "Say anything.", {"task": {"seed": seed}}
            def step(self, action):
                if self.seed % 2:
                    raise RuntimeError("boom on odd seeds")
                return "ok", 1.0, True, False, {}
        def make_env():
            return Flaky()
    """,
    )
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": str(env_file)}, rollout={"tasks": 4, "group_size": 1})
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    eps = _episodes(ctx)
    failed = [e for e in eps if e["status"] == "failed"]
    assert summary.episodes == 4 and 0 < len(failed) < 4
    assert all("boom on odd seeds" in e["error"] for e in failed)
    assert all(e["env_return"] == 1.0 for e in eps if e["status"] == "ok")


@pytest.mark.parametrize("reward", ["nan", "inf"])
def test_a_non_finite_env_reward_fails_the_episode_and_eval_still_runs(tmp_path, reward):
    # SQLite stores NaN as NULL, which later read as a 0 reward and broke eval's means for good.
    env_file = write_env_file(
        tmp_path / "nan_env.py",
        f"""
        class NanOnOdd:
            def reset(self, seed):
                self.seed = seed
                return "Say anything.", {{"task": {{"seed": seed}}}}
            def step(self, action):
                return "ok", float("{reward}") if self.seed % 2 else 1.0, True, False, {{}}
        def make_env():
            return NanOnOdd()
    """,
    )
    recipe = write_recipe(
        tmp_path / "r.yaml", env={"name": str(env_file)}, rollout={"tasks": 4, "group_size": 1}, eval={"tasks": 4}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    eps = _episodes(ctx)
    failed = [e for e in eps if e["status"] == "failed"]
    assert 0 < len(failed) < 4
    assert all(f"reward {reward}" in e["error"] and e["end_reason"] == "error" for e in failed)
    assert all(e["env_return"] is not None for e in eps)
    from rlcli.engine.evaluate import run_eval

    (result,) = run_eval(ctx, ["base"])
    assert result.details["failed_episodes"] > 0


def test_context_budget_overflow_fails_the_episode(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", model={"name": "tiny-random", "max_length": 8})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    eps = _episodes(ctx)
    assert all(e["status"] == "failed" and "context budget" in e["error"] for e in eps)


def test_kill_during_rollout_resumes_without_duplicates(tmp_path):
    runs = tmp_path / "runs"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number", "max_turns": 2},
        # batch_size 1: 24 chunks, each its own commit, so the kill lands mid-rollout even on a fast machine.
        rollout={"tasks": 12, "group_size": 2, "max_new_tokens": 12, "batch_size": 1},
    )
    stored = kill_when(["rollout", "-r", str(recipe), "--policy", "base"], runs, "select count(*) from episodes", 4)
    assert 0 < stored < 24, "the kill must land mid-rollout"
    done = run_in_process(["rollout", "-r", str(recipe), "--policy", "base"], runs)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(runs / "rlcli.db") as conn:
        keys = conn.execute("select task_index, sample_index from episodes where stage = 'rollout'").fetchall()
        resumed = conn.execute(
            "select e.task_index, e.sample_index, t.turn_index, t.completion_ids from episodes e "
            "join turns t on t.episode_id = e.id order by 1, 2, 3"
        ).fetchall()
    assert len(keys) == len(set(keys)) == 24
    # The resumed run equals an uninterrupted one.
    clean = tmp_path / "clean"
    assert run_in_process(["rollout", "-r", str(recipe), "--policy", "base"], clean).returncode == 0
    with sqlite3.connect(clean / "rlcli.db") as conn:
        reference = conn.execute(
            "select e.task_index, e.sample_index, t.turn_index, t.completion_ids from episodes e "
            "join turns t on t.episode_id = e.id order by 1, 2, 3"
        ).fetchall()
    assert resumed == reference


def test_relabelling_adds_a_label_set_without_touching_episodes(tmp_path):
    fn_file = tmp_path / "my_rewards.py"
    fn_file.write_text("def brevity(completions, **kwargs):\n    return [-len(c) / 10 for c in completions]\n")
    recipe = write_recipe(tmp_path / "r.yaml", rewards=[{"fn": "env_return"}])
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    before = [dict(e) for e in _episodes(ctx)]
    from rlcli.engine.labelling import run_label_stage

    run_label_stage(ctx, label_set="v1")
    from rlcli.recipe import load_recipe

    # What `rlcli label --label-set v2 --force` does with a recipe whose rewards changed.
    ctx.recipe = load_recipe(
        write_recipe(
            tmp_path / "r2.yaml",
            rewards=[{"fn": "env_return", "weight": 0.5}, {"fn": f"{fn_file}:brevity", "name": "brevity"}],
        )
    )
    run_label_stage(ctx, label_set="v2")
    assert [dict(e) for e in _episodes(ctx)] == before
    rows = list(ctx.rundb.db.query("select label_set, component, count(*) n from rewards group by 1, 2 order by 1, 2"))
    assert [(r["label_set"], r["component"], r["n"]) for r in rows] == [
        ("v1", "env_return", 4),
        ("v1", "total", 4),
        ("v2", "brevity", 4),
        ("v2", "env_return", 4),
        ("v2", "total", 4),
    ]
    for ep in before:
        vals = {
            r["component"]: r["value"]
            for r in ctx.rundb.db.query(
                "select component, value from rewards where episode_id = ? and label_set = 'v2'", [ep["id"]]
            )
        }
        assert vals["total"] == pytest.approx(0.5 * vals["env_return"] + vals["brevity"])


def test_relabelling_labels_the_episodes_a_stage_gained_since(tmp_path):
    # Raising eval.tasks adds episodes to eval/base; `rlcli label` used to find label/<set>/eval/base
    # done and leave the new ones unlabelled, saying nothing.
    from rlcli.engine.evaluate import run_eval
    from rlcli.engine.labelling import run_label_stage

    recipe = write_recipe(tmp_path / "r.yaml", rewards=[{"fn": "env_return"}], eval={"tasks": 2})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_eval(ctx, ["base"])
    [summary] = run_label_stage(ctx, label_set="v1")
    assert summary.episodes == 2
    ctx = make_ctx(recipe, tmp_path / "runs", ["eval.tasks=4"])
    run_eval(ctx, ["base"])
    [summary] = run_label_stage(ctx, label_set="v1")
    (finished,) = ctx.rundb.db.execute(
        "select count(*) from episodes where stage = 'eval/base' and status = 'ok'"
    ).fetchone()
    (labelled,) = ctx.rundb.db.execute(
        "select count(*) from rewards where label_set = 'v1' and component = 'total'"
    ).fetchone()
    assert finished == labelled == summary.episodes == 4


# --- timeouts: settled within the stage, the same whether it runs once or is resumed ---------

SLOW_ENV = """
from pathlib import Path

FLAG = Path(__file__).with_name("under-load")

class Slow:
    def reset(self, seed):
        self.seed = seed
        return "Say anything.", {"task": {"seed": seed}}
    def step(self, action):
        if self.seed == 3:
            raise RuntimeError("seed 3 is broken")
        if self.seed == 1 and FLAG.exists():
            import time
            time.sleep(2)  # longer than env.step_timeout_s: the step times out
        return "ok", 1.0, True, False, {}

def make_env():
    return Slow()
"""


def slow_env_recipe(tmp_path, **sections):
    env_file = write_env_file(tmp_path / "slow.py", SLOW_ENV)
    return write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "step_timeout_s": 0.3},
        rollout={"tasks": 4, "group_size": 1, "batch_size": 4},
        **sections,
    )


def test_a_stored_timed_out_episode_is_final_when_its_stage_runs_again(tmp_path):
    # Before, running the stage again played it again: a resumed run then held other episodes than
    # an uninterrupted one.
    recipe = slow_env_recipe(tmp_path)
    (tmp_path / "under-load").touch()
    ctx = make_ctx(recipe, tmp_path / "runs")
    first = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert (first.episodes, first.failed) == (4, 2)
    stored = _episodes(ctx)
    by_seed = {e["seed"]: e for e in stored}
    assert "step time limit" in by_seed[1]["error"] and by_seed[1]["end_reason"] == "env_timeout"
    assert by_seed[1]["attempts"] == 1 and by_seed[1]["transient"] == 1

    (tmp_path / "under-load").unlink()
    again = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert (again.episodes, again.failed) == (4, 2)
    assert _episodes(ctx) == stored


def test_timeout_retries_plays_a_timed_out_episode_again_within_the_stage(tmp_path):
    recipe = slow_env_recipe(tmp_path)
    (tmp_path / "under-load").touch()
    ctx = make_ctx(recipe, tmp_path / "runs", ["env.timeout_retries=2"])
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert (summary.episodes, summary.failed) == (4, 2)
    by_seed = {e["seed"]: e for e in _episodes(ctx)}
    assert by_seed[1]["attempts"] == 3 and by_seed[1]["end_reason"] == "env_timeout" and by_seed[1]["lost"] == 0
    assert by_seed[1]["earlier_errors"].count("step time limit") == 2
    assert by_seed[3]["attempts"] == 1 and "seed 3 is broken" in by_seed[3]["error"]  # the env raised: not retried
    assert ctx.rundb.db["turns"].count == sum(e["num_turns"] for e in _episodes(ctx))  # no orphaned turns


def test_a_grpo_iteration_whose_episodes_all_timed_out_is_not_replayed_on_resume(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.errors import RlcliError

    env_file = write_env_file(
        tmp_path / "stuck.py",
        """
        import time
        from pathlib import Path

        class Stuck:
            def reset(self, seed):
                return "Say anything.", {"task": {}}
            def step(self, action):
                if Path(__file__).with_name("under-load").exists():
                    time.sleep(2)
                return "ok", float(len(action) % 2), True, False, {}

        def make_env():
            return Stuck()
        """,
    )
    recipe = write_recipe(
        tmp_path / "r.yaml", env={"name": str(env_file), "step_timeout_s": 0.3}, grpo={"iterations": 1, "lr": 1e-3}
    )
    (tmp_path / "under-load").touch()
    ctx = make_ctx(recipe, tmp_path / "runs")
    with pytest.raises(RlcliError, match="no successfully finished"):
        run_grpo(ctx)
    # A resume trains on what an uninterrupted run had: the stored rollout, not a new one.
    (tmp_path / "under-load").unlink()
    with pytest.raises(RlcliError, match="no successfully finished"):
        run_grpo(ctx)
    assert {e["end_reason"] for e in _episodes(ctx, "rollout/0")} == {"env_timeout"}


def test_markup_in_user_chosen_names_is_shown_as_written(tmp_path, capsys):
    from helpers import cli

    recipe = write_recipe(tmp_path / "r.yaml", rewards=[{"fn": "env_return", "name": "[/x]c"}])
    runs = tmp_path / "runs"
    code, out, err = cli(capsys, "--runs-dir", runs, "rollout", "-r", recipe, "--stage", "mine[red]")
    assert code == 0, err
    assert "mine[red]" in err and "mine[red]" in out  # the progress bar (stderr), the summary table (stdout)
    code, out, err = cli(capsys, "--runs-dir", runs, "label", "-r", recipe, "--label-set", "[red]")
    assert code == 0, err
    assert "[red]" in out + err and "[/x]c" in out + err
