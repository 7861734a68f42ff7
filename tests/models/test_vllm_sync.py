"""How the vLLM engine gets the policy after an update: rollout.vllm_sync adapter (a LoRARequest over
the base weights), and sleep/wake around the update (rollout.vllm_sleep).

The engine tests share one LoRA-enabled engine (the tiny head_dim-64 model of test_vllm_engine.py,
its options plus max_lora_rank 4): the engine-level test and the GRPO run reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import DEVICE, make_ctx, write_recipe
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe
from test_vllm_engine import (  # noqa: F401 (fixtures)
    ENGINE_OPTIONS,
    LOGPROB_TOLERANCE,
    SAMPLED,
    gap,
    hf_model,
    lora_model,
    needs_vllm,
    prompts,
    tiny64,
    tokenizer,
)
from test_vllm_rollout import check_logprobs, metric, vllm_recipe

LORA_RANK = 4  # lora_model's, and the GRPO recipe's lora.r


def test_adapter_sync_needs_a_lora(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", lora=None, rollout={"vllm_sync": "adapter"})
    with pytest.raises(UsageError, match="vllm_sync adapter serves a LoRA adapter"):
        load_recipe(recipe)
    assert load_recipe(recipe, ["rollout.vllm_sync=merged"]).rollout.vllm_sync == "merged"


def test_vllm_lora_ranks_round_up_to_a_size_vllm_takes():
    pytest.importorskip("vllm")
    from rlcli.generation.vllm_engine import _vllm_lora_rank

    assert [_vllm_lora_rank(r) for r in (1, 4, 8, 9, 300)] == [1, 8, 8, 16, 320]
    with pytest.raises(UsageError, match="up to rank 512"):
        _vllm_lora_rank(1024)


@pytest.fixture
def lora_engine(tiny64):  # noqa: F811
    from rlcli.generation.vllm_engine import shared_engine

    engine = shared_engine(str(tiny64), **ENGINE_OPTIONS, max_lora_rank=LORA_RANK)
    engine.serve_base()  # another test may have left an adapter in it
    return engine


@pytest.mark.slow
@needs_vllm
def test_adapter_sync_samples_the_trained_adapter(lora_engine, hf_model, prompts, tmp_path):  # noqa: F811
    from rlcli.generation.vllm_engine import sync_weights

    seeds = [11, 12, 13]
    before = lora_engine.generate(prompts, seeds, SAMPLED)
    for prompt, sample in zip(prompts, before):
        assert gap(hf_model, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE

    policy = lora_model(hf_model)  # B is not zero: the adapter changes the policy
    sync_weights(lora_engine, policy)
    first = lora_engine.generate(prompts, seeds, SAMPLED)
    first_folder = lora_engine.adapter.lora_path
    for prompt, sample in zip(prompts, first):
        assert gap(policy, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE
        with policy.disable_adapter():
            assert gap(policy, prompt, sample, SAMPLED.logprob_temperature) > 0.01  # not the base

    # An update: the engine must serve the new adapter, not the one it cached under the old id.
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    sync_weights(lora_engine, policy)
    second = lora_engine.generate(prompts, seeds, SAMPLED)
    for prompt, sample in zip(prompts, second):
        assert gap(policy, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE
    assert [s.ids for s in second] != [s.ids for s in first]
    assert not Path(first_folder).exists()  # the scratch save of the adapter it replaced

    # A checkpoint folder that holds the adapter is served from where it is.
    policy.save_pretrained(tmp_path / "ckpt")
    sync_weights(lora_engine, policy, adapter_folder=tmp_path / "ckpt")
    assert lora_engine.adapter.lora_path == str(tmp_path / "ckpt")
    assert lora_engine.generate(prompts, seeds, SAMPLED) == second

    lora_engine.serve_base()
    assert (tmp_path / "ckpt" / "adapter_config.json").is_file()  # not the engine's to remove
    assert [s.ids for s in lora_engine.generate(prompts, seeds, SAMPLED)] == [s.ids for s in before]


@pytest.mark.slow
@needs_vllm
def test_grpo_with_adapter_sync_logs_the_sync_and_a_zero_logprob_gap(tmp_path, tiny64):  # noqa: F811
    from rlcli.engine.grpo.loop import run_grpo
    from test_train import DIGITS

    (tmp_path / "digits.py").write_text(DIGITS)  # a reward that varies within a group: a gradient
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        lora={"r": LORA_RANK, "alpha": 8},
        env={"name": "arithmetic", "max_turns": 1},
        rewards=[{"fn": f"{tmp_path / 'digits.py'}:digits"}],
        # checkpoint_every 2: iteration 1 syncs from a scratch save, iteration 2 from train/1's checkpoint.
        grpo={"iterations": 3, "lr": 3e-2, "checkpoint_every": 2, "drop_zero_var_groups": False},
        rollout={"vllm_sync": "adapter"},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    assert len(metric(ctx, "perf/time_sync_s")) == 3
    gaps = metric(ctx, "train/engine_logprob_gap")
    assert gaps and max(gaps) < LOGPROB_TOLERANCE, gaps  # every rollout came from the trained adapter
    from rlcli.generation.vllm_engine import _shared

    assert _shared[1].adapter.lora_path == str(ctx.run_dir / "checkpoints" / "iter-0001")

    # `rlcli rollout` of a checkpoint loads it merged (no adapter left in the model): the engine serves
    # the checkpoint's folder, and what it samples is that checkpoint's policy.
    from rlcli.engine.rollout import load_rollout_policy, run_rollout_stage
    from rlcli.store.checkpoints import checkpoints

    first = checkpoints(ctx.store)[0]
    run_rollout_stage(ctx, stage="again", policy=str(first.id), split="train")
    assert _shared[1].adapter.lora_path == first.path
    _, trained, _ = load_rollout_policy(ctx, str(first.id))
    turns = list(
        ctx.rundb.db.query("select t.* from turns t join episodes e on e.id = t.episode_id where e.stage = 'again'")
    )
    assert turns
    for turn in turns:
        check_logprobs(trained, turn)


# --- sleep mode ------------------------------------------------------------------------------------


def test_auto_sleeps_only_when_the_engine_shares_the_trainers_gpu(tmp_path):
    from rlcli.generation.vllm_engine import shares_gpu, sleeps_around_updates

    assert shares_gpu("cuda", "cuda:0") and shares_gpu("cuda:1", "cuda:1")
    assert not shares_gpu("cuda:0", "cuda:1")  # gpu_2x: engine and trainer on their own GPUs
    assert not shares_gpu("cpu", "cpu")  # host memory is not what sleep frees

    def sleeps(*overrides: str) -> bool:
        recipe = write_recipe(tmp_path / "r.yaml", model={"name": "tiny-random", "device": "cpu"})
        return sleeps_around_updates(load_recipe(recipe, list(overrides)))

    assert not sleeps()  # auto on a CPU
    assert not sleeps("rollout.vllm_sleep=false")
    assert sleeps("rollout.vllm_sleep=true")  # asked for: the engine then refuses it on a CPU (below)
    with pytest.raises(UsageError, match="the rollout worker samples during it"):
        sleeps("rollout.vllm_sleep=true", "grpo.max_staleness=1")


@needs_vllm
@pytest.mark.skipif(DEVICE != "cpu", reason="the CUDA build of vLLM has a sleep mode, and no CPU engine to refuse it")
def test_sleep_mode_on_a_cpu_is_refused_in_one_sentence(tmp_path, tiny64):  # noqa: F811
    from helpers import run_in_process

    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": str(tiny64), "device": "cpu"},  # a head size vLLM's CPU build serves
        rollout={"tasks": 1, "group_size": 1, "engine": "vllm", "vllm_sleep": True},
    )
    done = run_in_process(["rollout", "-r", str(recipe), "--policy", "base"], tmp_path / "runs")
    assert done.returncode == 2, done.stderr
    assert "rollout.vllm_sleep true: vLLM has no sleep mode on cpu" in done.stderr
    assert "Traceback" not in done.stderr
