"""The CUDA paths that a CPU can check: the bf16 choice, the order in which a
sleeping vLLM engine wakes for a weight load, per-stage GPU memory in `runs show`, the quantised base
served by vLLM, and the engine's start leaving run.threads and freeing the engine before it.
bench/gpu_smoke.py runs the same paths on a GPU."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from helpers import DEVICE, cli, make_ctx, sequence_logprobs, write_recipe
from test_vllm_engine import ENGINE_OPTIONS, LOGPROB_TOLERANCE, needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)


def test_auto_dtype_is_bf16_only_where_the_run_s_gpu_computes_it_natively(monkeypatch):
    from rlcli.models.loading import resolve_dtype

    # cuda:0 an H100, cuda:1 a T4: torch.cuda.is_bf16_supported() says yes for both (emulation counts).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: {0: (9, 0), 1: (7, 5)}[index or 0])
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cuda:1") == torch.bfloat16  # asked for: the user's choice


class RecordingLLM:
    """Stands in for vllm.LLM's sleep API, which only the CUDA build has: it records the calls."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.llm_engine = self

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake_up {','.join(tags) if tags else 'all'}")

    def collective_rpc(self, method, kwargs=None) -> None:
        if kwargs:
            list(kwargs["weights_iterator"])
        self.calls.append(f"rpc {getattr(method, '__name__', method)}")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")


def test_a_sleeping_engine_wakes_its_weights_loads_then_wakes_its_kv_cache(monkeypatch):
    from rlcli.generation.vllm_engine import VllmEngine

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = VllmEngine.__new__(VllmEngine)
    engine.llm, engine.sleep_mode, engine.asleep = RecordingLLM(calls), True, True
    engine.load_weights({"w": torch.zeros(1)})
    assert calls[:6] == [
        "empty_cache",  # what the update left reserved goes back before the weights wake (TRL's order)
        "wake_up weights",
        "rpc reload_weights",
        "rpc _repack_tied_cpu_weights",
        "empty_cache",  # the load's temporaries go before the KV cache comes back
        "wake_up kv_cache",
    ]
    assert not engine.asleep
    calls.clear()
    engine.load_weights({"w": torch.zeros(1)})  # awake: nothing to wake
    assert not any(call.startswith(("wake_up", "empty_cache")) for call in calls)


def test_runs_show_lists_each_stage_s_gpu_memory_when_recorded(tmp_path, capsys):
    runs = tmp_path / "runs"
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), runs)
    ctx.rundb.mark_stage(ctx.run, "sft", "done")
    ctx.rundb.mark_stage(ctx.run, "train/0", "done")
    ctx.rundb.log_metrics(ctx.run, "sft", 0, {"perf/gpu_mem_peak_gb": 3.25})
    ctx.rundb.log_metrics(ctx.run, "train/0", 0, {"perf/gpu_mem_peak_gb": 5.5, "perf/vllm_mem_gb": 31.75})
    code, out, err = cli(capsys, "--runs-dir", runs, "runs", "show", "t")
    assert code == 0, err
    assert "GPU GB" in out and "vLLM GB" in out
    assert "3.25" in out and "5.50" in out and "31.75" in out
    code, out, _ = cli(capsys, "--runs-dir", runs, "runs", "show", "t", "--json")
    assert code == 0
    stages = {s["name"]: s for s in json.loads(out)["stages"]}
    assert stages["train/0"]["gpu_mem_peak_gb"] == 5.5 and stages["train/0"]["vllm_mem_gb"] == 31.75


def test_a_stage_records_its_gpu_peak_where_cuda_is_in_use(tmp_path, capsys):
    runs = tmp_path / "runs"
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), runs)
    held = []
    ctx.stage("sft", lambda: held.append(torch.ones(1 << 20, device=DEVICE)) or {"steps": 1})  # 4 MB
    peaks = ctx.rundb.metrics("t", "perf/gpu_mem_peak_gb")
    code, out, err = cli(capsys, "--runs-dir", runs, "runs", "show", "t")
    assert code == 0, err
    if DEVICE == "cpu":  # nothing measured, no columns: a CPU run's view is as before
        assert peaks == [] and "GPU GB" not in out
    else:
        assert [p.stage for p in peaks] == ["sft"] and peaks[0].value >= 4e-3
        assert "GPU GB" in out


@pytest.mark.slow
@needs_vllm
def test_vllm_samples_a_4bit_recipe_s_base_through_its_quantised_weights(tmp_path, tiny64):  # noqa: F811
    """`base` on vLLM is what the 4-bit trainer starts from, not the checkpoint's dense weights: its
    recorded logprobs are the 4-bit model's."""
    pytest.importorskip("bitsandbytes")
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.models.loading import load_policy
    from rlcli.store.blobs import unpack_floats, unpack_ids
    from test_vllm_rollout import vllm_recipe

    recipe = vllm_recipe(tmp_path, tiny64, quantization={"mode": "4bit", "compute_dtype": "float32"})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    model, _ = load_policy(ctx.recipe.model, ctx.recipe.lora, ctx.recipe.quantization, trainable=False)
    with sqlite3.connect(tmp_path / "runs" / "rlcli.db") as conn:
        turns = conn.execute("select prompt_ids, completion_ids, logprobs from turns").fetchall()
    assert turns
    for prompt_blob, completion_blob, logprobs in turns:
        prompt, completion = unpack_ids(prompt_blob), unpack_ids(completion_blob)
        recomputed = sequence_logprobs(model, prompt + completion, len(prompt))
        assert recomputed.tolist() == pytest.approx(unpack_floats(logprobs), abs=LOGPROB_TOLERANCE)


@pytest.mark.slow
@needs_vllm
def test_a_new_engine_shuts_the_old_one_down_and_keeps_the_run_s_threads(tiny64):  # noqa: F811
    from rlcli.generation.sampler import SamplingConfig
    from rlcli.generation.vllm_engine import shared_engine

    first = shared_engine(str(tiny64), **ENGINE_OPTIONS)
    threads = torch.get_num_threads()
    second = shared_engine(str(tiny64), **{**ENGINE_OPTIONS, "max_model_len": 512})
    try:
        assert first.llm is None  # shut down before the second started
        assert torch.get_num_threads() == threads
        [sample] = second.generate([[1, 2, 3]], [0], SamplingConfig(temperature=1.0, max_new_tokens=4))
        assert sample.ids
    finally:
        shared_engine(str(tiny64), **ENGINE_OPTIONS)  # the session's engine again, for the tests after
