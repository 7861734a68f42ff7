"""Rollouts, GRPO and the recipe with `rollout.engine: vllm` (the engine seam, rlcli.generation.engines).

The vLLM tests share one engine per process with tests/models/test_vllm_engine.py (same tiny head_dim-64
model, same options): see ENGINE_OPTIONS there. The recipe tests need no vllm.
"""

from __future__ import annotations

import sqlite3

import pytest

from helpers import DEVICE, kill_when, make_ctx, run_in_process, sequence_logprobs, write_recipe
from rlcli.engine.rollout import load_rollout_policy, run_rollout_stage
from rlcli.errors import UsageError
from rlcli.generation.engines import generation_engine
from rlcli.recipe import load_recipe
from rlcli.store.blobs import unpack_floats, unpack_ids
from test_train import DIGITS, _learnable_recipe
from test_vllm_engine import KV_CACHE_BYTES, needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)

# Engine and trainer both compute in float32 on the CPU: what differs is summation order, ~1e-6.
LOGPROB_TOLERANCE = 1e-4
TURNS = (
    "select e.task_index, e.sample_index, t.turn_index, t.completion_ids, t.logprobs from episodes e "
    "join turns t on t.episode_id = e.id where e.stage = ? order by 1, 2, 3"
)


def vllm_recipe(tmp_path, model, **sections):
    """A recipe on `model` (tiny64) that the session's shared engine serves."""
    base = dict(
        model={"name": str(model), "max_length": 1024, "dtype": "float32", "device": DEVICE},
        env={"name": "guess_number", "max_turns": 2},  # two turns: the second extends the first's ids
        rollout={
            "tasks": 3,
            "group_size": 2,
            "max_new_tokens": 12,
            "batch_size": 4,
            "engine": "vllm",
            "vllm_memory": KV_CACHE_BYTES,
        },
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return write_recipe(tmp_path / "r.yaml", **base)


def stored_turns(runs_dir, stage="rollout"):
    with sqlite3.connect(runs_dir / "rlcli.db") as conn:
        return conn.execute(TURNS, [stage]).fetchall()


# --- the recipe (no vllm needed) ------------------------------------------------------------------


def test_vllm_refuses_truncated_sampling(tmp_path, monkeypatch):
    import rlcli.generation.engines

    monkeypatch.setattr(rlcli.generation.engines, "_head_size", lambda name: 64)  # one vLLM's CPU build takes
    recipe = write_recipe(tmp_path / "r.yaml", rollout={"engine": "vllm", "top_p": 0.9})
    with pytest.raises(UsageError, match="truncated distribution"):
        load_recipe(recipe)
    assert generation_engine(load_recipe(recipe, ["rollout.top_p=1"])) == "vllm"


def test_auto_picks_vllm_on_a_cpu_for_head_sizes_its_kernels_take(tmp_path, monkeypatch):
    import importlib.util
    import json

    def model_with_heads(head_dim: int):
        folder = tmp_path / f"model-{head_dim}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"hidden_size": 4 * head_dim, "num_attention_heads": 4}))
        return str(folder)

    def engine(model: str, *overrides: str) -> str:
        recipe = write_recipe(tmp_path / "auto.yaml", model={"name": model, "device": "cpu"})
        return generation_engine(load_recipe(recipe, list(overrides)))

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    assert engine(model_with_heads(64)) == "vllm"
    assert engine(model_with_heads(16)) == "hf"  # the tiny test model's: vLLM's CPU attention refuses it
    assert engine(model_with_heads(64), "rollout.top_p=0.9") == "hf"
    assert engine(model_with_heads(64), "rollout.engine=hf") == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert engine(model_with_heads(64)) == "hf"  # vllm not installed


def test_sft_turns_activation_checkpointing_off_unless_asked_under_either_transformers_name():
    from trl import SFTConfig

    from rlcli.engine.hf_trainer import checkpointing_options

    off = SFTConfig(
        output_dir="unused", report_to="none", use_cpu=True, bf16=False, **checkpointing_options(SFTConfig, False)
    )
    assert off.gradient_checkpointing is False
    on = SFTConfig(
        output_dir="unused", report_to="none", use_cpu=True, bf16=False, **checkpointing_options(SFTConfig, True)
    )
    assert on.gradient_checkpointing is True and on.gradient_checkpointing_kwargs == {"use_reentrant": False}


# --- rollouts ------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_vllm
def test_same_seeds_same_episodes_and_logprobs_the_trainer_recomputes(tmp_path, tiny64):  # noqa: F811
    recipe = vllm_recipe(tmp_path, tiny64)
    runs = [tmp_path / "a", tmp_path / "b"]
    for runs_dir in runs:
        run_rollout_stage(make_ctx(recipe, runs_dir), stage="rollout", policy="base", split="train")
    first, again = (stored_turns(r) for r in runs)
    assert first == again and len(first) >= 6
    assert any(turn_index == 1 for _, _, turn_index, _, _ in first)  # a second turn went through the cache

    ctx = make_ctx(recipe, runs[0])
    _, model, _ = load_rollout_policy(ctx, "base")
    for ep in ctx.rundb.db.query("select id from episodes where stage = 'rollout'"):
        for t in ctx.rundb.db.query("select * from turns where episode_id = ?", [ep["id"]]):
            check_logprobs(model, t)


def check_logprobs(model, turn) -> None:
    prompt, completion = unpack_ids(turn["prompt_ids"]), unpack_ids(turn["completion_ids"])
    recomputed = sequence_logprobs(model, prompt + completion, len(prompt))  # temperature 1
    assert recomputed.tolist() == pytest.approx(unpack_floats(turn["logprobs"]), abs=LOGPROB_TOLERANCE)


@pytest.mark.slow
@needs_vllm
def test_kill_during_a_vllm_rollout_resumes_without_duplicates(tmp_path, tiny64):  # noqa: F811
    # batch_size 1: each episode is its own commit, so the kill lands mid-rollout.
    recipe = vllm_recipe(tmp_path, tiny64, rollout={"tasks": 12, "batch_size": 1})
    runs = tmp_path / "runs"
    args = ["rollout", "-r", str(recipe), "--policy", "base"]
    # The engine starts first: 10-40 s.
    stored = kill_when(args, runs, "select count(*) from episodes", 4, timeout=300)
    assert 0 < stored < 24, "the kill must land mid-rollout"
    done = run_in_process(args, runs)  # the resume, with the session's engine (no second start)
    assert done.returncode == 0, done.stderr

    clean = tmp_path / "clean"  # uninterrupted, in this process (the shared engine)
    run_rollout_stage(make_ctx(recipe, clean), stage="rollout", policy="base", split="train")
    resumed = stored_turns(runs)
    assert resumed == stored_turns(clean)
    assert len({(task, sample) for task, sample, *_ in resumed}) == 24
    with sqlite3.connect(runs / "rlcli.db") as conn:
        assert conn.execute("select count(*) from episodes").fetchone()[0] == 24  # nothing duplicated


# --- GRPO ----------------------------------------------------------------------------------------


def metric(ctx, key):
    return [r.value for r in ctx.rundb.metrics(ctx.run, key)]


@pytest.mark.slow
@needs_vllm
def test_after_an_update_the_engine_samples_the_trained_adapter(tmp_path, tiny64):  # noqa: F811
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.store.checkpoints import checkpoints

    (tmp_path / "digits.py").write_text(DIGITS)  # a reward that varies within a group: a gradient
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        lora={"r": 4, "alpha": 8},
        env={"name": "arithmetic", "max_turns": 1},
        rewards=[{"fn": f"{tmp_path / 'digits.py'}:digits"}],
        grpo={"iterations": 2, "lr": 3e-2, "checkpoint_every": 1, "drop_zero_var_groups": False},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    assert len(metric(ctx, "perf/time_sync_s")) == 2
    first = checkpoints(ctx.store)[0]
    _, trained, _ = load_rollout_policy(ctx, str(first.id))
    _, base, _ = load_rollout_policy(ctx, "base")
    turns = list(
        ctx.rundb.db.query("select t.* from turns t join episodes e on e.id = t.episode_id where e.stage = 'rollout/1'")
    )
    assert turns
    moved = 0.0
    for t in turns:  # rollout/1 was sampled after train/0 and the sync that followed it
        check_logprobs(trained, t)
        prompt, completion = unpack_ids(t["prompt_ids"]), unpack_ids(t["completion_ids"])
        before = sequence_logprobs(base, prompt + completion, len(prompt))
        moved = max(moved, max(abs(a - b) for a, b in zip(before.tolist(), unpack_floats(t["logprobs"]))))
    assert moved > 0.01  # the engine no longer serves the base weights


@pytest.mark.slow
@needs_vllm
def test_grpo_with_vllm_logs_the_sync_and_a_zero_logprob_gap(tmp_path, tiny64):  # noqa: F811
    from rlcli.engine.grpo.loop import run_grpo

    digits = _learnable_recipe(tmp_path)  # the reward file and sections of test_train's learning test
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        **{k: v for k, v in load_recipe(digits).to_dict().items() if k in ("env", "rewards", "grpo")},
        lora={"r": 8, "alpha": 16},
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    assert len(metric(ctx, "rollout/reward_mean")) == len(metric(ctx, "perf/time_sync_s")) == 12
    gaps = metric(ctx, "train/engine_logprob_gap")
    assert gaps and max(gaps) < LOGPROB_TOLERANCE, gaps  # every rollout came from the trained weights


@pytest.mark.slow
@needs_vllm
def test_full_fine_tuning_with_vllm_keeps_a_zero_logprob_gap(tmp_path, tiny64):  # noqa: F811
    """Full fine-tuning also trains the embedding, which the tiny model's head is tied to.

    Before vllm_engine.load_weights repacked the tied head on vLLM's CPU build, the gap grew every
    iteration (0.27, 0.90, 3.0, ...): the engine kept the first head.
    """
    from rlcli.engine.grpo.loop import run_grpo

    digits = _learnable_recipe(tmp_path)  # full fine-tuning (lora: null), lr 3e-2
    sections = load_recipe(digits).to_dict()
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        **{k: v for k, v in sections.items() if k in ("env", "rewards")},
        grpo={**sections["grpo"], "iterations": 4},
        lora=None,
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    assert len(metric(ctx, "perf/time_sync_s")) == 4
    gaps = metric(ctx, "train/engine_logprob_gap")
    assert len(gaps) == 4 and max(gaps) < 1e-3, gaps


@pytest.mark.slow
@needs_vllm
def test_grpo_with_vllm_learns_the_digits_task(tmp_path, tiny64):  # noqa: F811
    """test_train's test_reward_rises_over_iterations with the engine sampling: full fine-tuning, lr 3e-2."""
    from rlcli.engine.grpo.loop import run_grpo

    sections = load_recipe(_learnable_recipe(tmp_path)).to_dict()
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        **{k: v for k, v in sections.items() if k in ("env", "rewards", "grpo")},
        lora=None,
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    rewards = metric(ctx, "rollout/reward_mean")
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


@pytest.mark.slow
@needs_vllm
def test_distill_with_a_vllm_student_scores_its_tokens_as_the_engine_sampled_them(tmp_path, tiny64):  # noqa: F811
    # The base model as teacher of a student that starts from it: the teacher's logprobs of what the
    # engine sampled at temperature 1 are the engine's own, so the reverse KL of iteration 0 is ~0.
    from rlcli.engine.grpo.loop import run_distill

    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        lora={"r": 8, "alpha": 16},
        rollout={"tasks": 2, "group_size": 2, "temperature": 1.0},
        grpo={"iterations": 2, "lr": 1e-2},
        eval={"tasks": 0},
        distill={"teacher": "base"},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_distill(ctx)
    kl = metric(ctx, "train/teacher_kl")
    assert len(kl) == 2 and abs(kl[0]) < LOGPROB_TOLERANCE * 10, kl
    with sqlite3.connect(tmp_path / "runs" / "rlcli.db") as db:
        unscored = db.execute(
            "select count(*) from turns t join episodes e on e.id = t.episode_id where e.stage like 'rollout/%' "
            "and not exists (select 1 from teacher_logprobs s where s.episode_id = t.episode_id "
            "and s.turn_index = t.turn_index)"
        ).fetchone()[0]
    assert unscored == 0
