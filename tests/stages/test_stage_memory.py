"""What a stage built is gone when it ends (engine/memory.py), and each stage's GPU memory per device
(engine/context.py, GpuPeak).

`rlcli run` over sft -> grpo -> eval -> dpo -> eval, in this process: weak references to every model,
optimizer, scheduler, Trainer, GRPO learner and vLLM engine that a stage builds, recorded as they are
built, and looked at when the next stage starts and when the command is over. A stage that fails leaves
nothing alive either, though its caller holds the exception. The vLLM run shares the session's engine
with tests/models/test_vllm_engine.py (same model, same options): GRPO reuses it, the eval after GRPO keeps it,
DPO shuts it down, and the last eval starts it again for the tests after.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from helpers import DEVICE, cli, make_ctx, run_in_process, write_recipe
from test_vllm_engine import KV_CACHE_BYTES, needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)

STAGES = ["sft", "grpo", "eval", "dpo", "eval"]
ENTRIES = {  # module, function: what the pipeline calls for each stage
    "sft": ("rlcli.engine.sft", "run_sft"),
    "grpo": ("rlcli.engine.grpo.loop", "run_grpo"),
    "dpo": ("rlcli.engine.dpo", "run_dpo"),
    "eval": ("rlcli.engine.evaluate", "run_eval"),
}


class Built:
    """Weak references to what each stage built, in the order it was built."""

    def __init__(self) -> None:
        self.refs: list[tuple[int, str, str, weakref.ref]] = []  # (stage's position, stage, kind, ref)
        self.ids: list[int] = []  # each one's id() when it was recorded, alive
        self.position, self.stage = -1, "setup"
        self.seen: list[tuple[str, list[tuple[int, str, str]]]] = []  # each stage's start: what was alive

    def record(self, kind: str, thing: object) -> None:
        self.refs.append((self.position, self.stage, kind, weakref.ref(thing)))
        self.ids.append(id(thing))

    def alive(self) -> list[tuple[int, str, str]]:
        return [(position, stage, kind) for position, stage, kind, ref in self.refs if ref() is not None]

    def engine_ids(self, position: int) -> set[int]:
        """The engines a stage sampled with (ids taken while they were alive)."""
        return {i for (p, _, kind, _), i in zip(self.refs, self.ids) if kind == "vllm engine" and p == position}


@pytest.fixture
def built(monkeypatch) -> Built:
    """Record what every stage builds, and what is still alive when each stage starts."""
    import importlib

    import transformers

    import rlcli.engine.grpo.learner
    import rlcli.generation.vllm_engine as vllm_engine
    import rlcli.models.loading
    from rlcli.engine.grpo.learner import GrpoTrainer

    built = Built()

    def recording_init(cls: type, kind: str) -> None:
        real = cls.__init__

        def init(self, *args, **kwargs):
            real(self, *args, **kwargs)
            built.record(kind, self)

        monkeypatch.setattr(cls, "__init__", init)

    recording_init(torch.optim.Optimizer, "optimizer")
    recording_init(torch.optim.lr_scheduler.LRScheduler, "scheduler")
    recording_init(transformers.Trainer, "trainer")  # TRL's SFTTrainer and DPOTrainer
    recording_init(GrpoTrainer, "grpo learner")

    real_load = rlcli.models.loading.load_policy

    def load_policy(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        built.record("model", model)
        return model, tokenizer

    monkeypatch.setattr(rlcli.models.loading, "load_policy", load_policy)
    monkeypatch.setattr(rlcli.engine.grpo.learner, "load_policy", load_policy)
    real_engine = vllm_engine.policy_engine  # the module imports vllm only when an engine starts

    def policy_engine(*args, **kwargs):
        engine = real_engine(*args, **kwargs)
        built.record("vllm engine", engine)
        return engine

    monkeypatch.setattr(vllm_engine, "policy_engine", policy_engine)

    for stage, (module_name, name) in ENTRIES.items():
        module = importlib.import_module(module_name)
        real_entry = getattr(module, name)

        def entry(*args, _stage=stage, _real=real_entry, **kwargs):
            built.seen.append((_stage, built.alive()))
            built.position, built.stage = len(built.seen) - 1, _stage
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, entry)
    return built


def _recipe(tmp_path, **sections):
    # A reward that tells the random model's replies apart, so that GRPO's groups give DPO pairs.
    (tmp_path / "parity.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n"
    )
    base = dict(
        run={"name": "t", "seed": 0, "stages": STAGES},
        sft={"source": "expert", "demos": 2, "batch_size": 2, "micro_batch_size": 2},
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16},
        rewards=[{"fn": f"{tmp_path / 'parity.py'}:score"}],
        grpo={"iterations": 1, "lr": 1e-3, "beta": 0.04},  # beta: the SFT adapter is GRPO's KL reference
        dpo={"batch_size": 2, "micro_batch_size": 2, "lr": 1e-3},
        eval={"tasks": 2, "checkpoints": ["latest"]},
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return write_recipe(tmp_path / "r.yaml", **base)


def _check_each_stage_freed_the_one_before(built: Built) -> None:
    assert [stage for stage, _ in built.seen] == STAGES
    kinds = {(stage, kind) for _, stage, kind, _ in built.refs}
    # Every stage built what the check is about (else it would pass for want of anything to free).
    for wanted in [("sft", "model"), ("sft", "trainer"), ("sft", "optimizer"), ("sft", "scheduler")]:
        assert wanted in kinds
    for wanted in [("grpo", "model"), ("grpo", "grpo learner"), ("grpo", "optimizer"), ("grpo", "scheduler")]:
        assert wanted in kinds
    for wanted in [("dpo", "model"), ("dpo", "trainer"), ("dpo", "optimizer"), ("eval", "model")]:
        assert wanted in kinds
    for position, (stage, alive) in enumerate(built.seen):
        left = [(p, s, kind) for p, s, kind in alive if kind != "vllm engine"]
        assert left == [], f"when {stage} (stage {position}) started, these earlier stages' objects were alive: {left}"
    assert [a for a in built.alive() if a[2] != "vllm engine"] == []


def test_each_stage_frees_its_model_optimizer_and_trainer_before_the_next(tmp_path, built):
    """The HF sampler: no engine, only what the stages build."""
    runs = tmp_path / "runs"
    done = run_in_process(["run", "-r", str(_recipe(tmp_path, rollout={"engine": "hf"}))], runs)
    assert done.returncode == 0, done.stderr
    _check_each_stage_freed_the_one_before(built)


@pytest.mark.slow
@needs_vllm
def test_the_vllm_engine_stays_for_eval_and_goes_before_dpo(tmp_path, tiny64, built):  # noqa: F811
    """The recipe's engine is the session's (tests/models/test_vllm_engine.py, ENGINE_OPTIONS): GRPO reuses it."""
    from rlcli.generation import vllm_engine

    recipe = _recipe(
        tmp_path,
        model={"name": str(tiny64), "max_length": 1024, "dtype": "float32", "device": DEVICE},
        rollout={"engine": "vllm", "vllm_memory": KV_CACHE_BYTES},
    )
    done = run_in_process(["run", "-r", str(recipe)], tmp_path / "runs")
    assert done.returncode == 0, done.stderr
    _check_each_stage_freed_the_one_before(built)
    grpo, first_eval, dpo, last_eval = 1, 2, 3, 4  # positions in STAGES
    engines_at = {
        position: [p for p, _, kind in built.seen[position][1] if kind == "vllm engine"]
        for position in (first_eval, dpo)
    }
    # The eval after GRPO samples with GRPO's engine (same options): kept, not started again.
    assert engines_at[first_eval] == [grpo] and len(built.engine_ids(grpo)) == 1
    assert built.engine_ids(first_eval) == built.engine_ids(grpo)
    # DPO trains with the HF Trainer: the engine was shut down, and let go, before it started.
    assert engines_at[dpo] == [], "the vLLM engine outlived GRPO and eval into DPO"
    # The last eval started one again, and the command leaves it to the process (the tests after reuse it).
    engine = next(ref for p, _, kind, ref in built.refs if p == last_eval and kind == "vllm engine")()
    assert engine is not None and engine.llm is not None and vllm_engine._shared[1] is engine


@pytest.mark.parametrize("failing", ["sft", "grpo", "dpo"])
def test_a_failing_stage_frees_what_it_built_though_its_exception_is_held(tmp_path, built, monkeypatch, failing):
    """In-process callers of the pipeline (bench/, the tests) catch a stage's error and go on: the error's
    traceback must not keep the stage's model, trainer and optimizer (the frames it went through hold them)."""
    import rlcli.engine.grpo.learner
    from rlcli.engine.dpo import DpoProgress
    from rlcli.engine.pipeline import run_all
    from rlcli.engine.sft import RichProgress

    def boom(*args, **kwargs):
        raise RuntimeError(f"{failing} failed mid-step")

    if failing == "sft":
        monkeypatch.setattr(RichProgress, "on_step_end", boom)  # inside the Trainer's loop
    elif failing == "grpo":
        monkeypatch.setattr(rlcli.engine.grpo.learner, "update_policy", boom)  # inside an update
    else:
        monkeypatch.setattr(DpoProgress, "on_step_end", boom)
    stages = STAGES[: STAGES.index(failing) + 1]
    ctx = make_ctx(_recipe(tmp_path, rollout={"engine": "hf"}, run={"stages": stages}), tmp_path / "runs")
    with pytest.raises(RuntimeError, match="failed mid-step") as failure:
        run_all(ctx)
    assert failure.value.__traceback__ is not None  # held here, as a caller that reports it later would
    kinds = {kind for _, stage, kind, _ in built.refs if stage == failing}
    assert {"model", "optimizer"} <= kinds
    # GRPO's learner object may outlive it in a closure the traceback holds (grpo/loop.py, _train), emptied.
    for _, _, kind, ref in built.refs:
        if kind == "grpo learner" and ref() is not None:
            assert not {"model", "optimizer", "scheduler"} & vars(ref()).keys()
    left = [alive for alive in built.alive() if alive[2] != "grpo learner"]
    assert left == [], f"alive after {failing} failed: {left}"


# --- the engine decision ----------------------------------------------------------------------------


def test_the_engine_stays_only_for_a_stage_that_samples_with_it():
    from rlcli.engine.memory import keeps_engine

    assert keeps_engine("grpo", samples_with_vllm=True) and keeps_engine("eval", samples_with_vllm=True)
    assert not keeps_engine("dpo", samples_with_vllm=True) and not keeps_engine("sft", samples_with_vllm=True)
    assert keeps_engine(None, samples_with_vllm=True)  # the command ends: the process's, for what comes next in it
    assert keeps_engine("dpo", samples_with_vllm=False)  # the HF sampler built none: an engine here is not the run's


# --- GPU memory per device --------------------------------------------------------------------------

GB = 10**9


def test_one_gpu_records_its_allocated_and_reserved_peaks():
    from rlcli.engine.context import gpu_memory_metrics

    metrics = gpu_memory_metrics({0: (3 * GB, 4 * GB)}, None)
    assert metrics == {"perf/gpu_mem_peak_gb": 3.0, "perf/vllm_mem_gb": None, "perf/gpu_mem_reserved_gb": 4.0}
    # A second device that held nothing is not "used": no per-device keys.
    assert gpu_memory_metrics({0: (3 * GB, 4 * GB), 1: (0, 0)}, 31.5) == {**metrics, "perf/vllm_mem_gb": 31.5}
    assert gpu_memory_metrics({}, None) == {}


def test_two_gpus_record_the_largest_device_and_each_one():
    from rlcli.engine.context import gpu_memory_metrics, merged_peaks

    metrics = gpu_memory_metrics({0: (30 * GB, 40 * GB), 1: (5 * GB, 6 * GB)}, 20.0)
    assert metrics == {
        "perf/gpu_mem_peak_gb": 30.0,  # the largest device's, not the sum: one GPU's figure, as before
        "perf/vllm_mem_gb": 20.0,
        "perf/gpu_mem_reserved_gb": 40.0,
        "perf/gpu_mem_peak_gb/cuda:0": 30.0,
        "perf/gpu_mem_reserved_gb/cuda:0": 40.0,
        "perf/gpu_mem_peak_gb/cuda:1": 5.0,
        "perf/gpu_mem_reserved_gb/cuda:1": 6.0,
    }
    # Each figure is its own device's largest: reserved may peak on another device than allocated.
    assert gpu_memory_metrics({0: (2 * GB, 9 * GB), 1: (3 * GB, 4 * GB)}, None)["perf/gpu_mem_reserved_gb"] == 9.0
    assert merged_peaks({0: (1, 5), 1: (7, 7)}, {0: (3, 2), 2: (1, 1)}) == {0: (3, 5), 1: (7, 7), 2: (1, 1)}


class FakeCuda:
    """torch.cuda's peak counters on two devices, for a machine without CUDA."""

    def __init__(self) -> None:
        self.now = {0: (0, 0), 1: (0, 0)}
        self.peak = dict(self.now)

    def use(self, device: int, allocated: int, reserved: int) -> None:
        self.now[device] = (allocated, reserved)
        self.peak[device] = tuple(max(a, b) for a, b in zip(self.peak[device], self.now[device]))

    def device_count(self) -> int:
        return 2

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak[device] = self.now[device]

    def max_memory_allocated(self, device: int) -> int:
        return self.peak[device][0]

    def max_memory_reserved(self, device: int) -> int:
        return self.peak[device][1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a fake CUDA stands in where there is none")
def test_a_stage_inside_another_hands_its_peaks_per_device_to_the_outer_one(tmp_path, monkeypatch):
    import types

    import rlcli.engine.context
    from rlcli.engine.context import GpuPeak

    cuda = FakeCuda()
    monkeypatch.setattr(rlcli.engine.context, "cuda_torch", lambda: types.SimpleNamespace(cuda=cuda))
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")

    def inner():
        cuda.use(1, 8 * GB, 10 * GB)
        cuda.use(1, 1 * GB, 10 * GB)  # freed, the cache kept
        return {}

    def outer():
        cuda.use(0, 2 * GB, 3 * GB)
        ctx.stage("train/0", inner)  # resets the counters: its peak goes to the outer stage by hand
        return {}

    ctx.stage("grpo/1", outer)
    recorded = {(m.stage, m.key): m.value for m in ctx.rundb.metrics(ctx.run)}
    assert recorded[("train/0", "perf/gpu_mem_peak_gb")] == 8.0
    assert recorded[("train/0", "perf/gpu_mem_reserved_gb")] == 10.0
    # The outer stage's 2 GB stayed on device 0 through the inner one, which so used both devices.
    assert recorded[("train/0", "perf/gpu_mem_peak_gb/cuda:0")] == 2.0
    assert recorded[("train/0", "perf/gpu_mem_peak_gb/cuda:1")] == 8.0
    assert recorded[("grpo/1", "perf/gpu_mem_peak_gb")] == 8.0
    assert recorded[("grpo/1", "perf/gpu_mem_peak_gb/cuda:0")] == 2.0
    assert recorded[("grpo/1", "perf/gpu_mem_peak_gb/cuda:1")] == 8.0
    assert recorded[("grpo/1", "perf/gpu_mem_reserved_gb/cuda:1")] == 10.0
    assert GpuPeak().metrics() == {}  # nothing measured: nothing recorded


def test_runs_show_lists_the_reserved_peak_beside_the_allocated_one(tmp_path, capsys):
    import json

    runs = tmp_path / "runs"
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), runs)
    ctx.rundb.mark_stage(ctx.run, "sft", "done")
    ctx.rundb.log_metrics(ctx.run, "sft", 0, {"perf/gpu_mem_peak_gb": 3.25, "perf/gpu_mem_reserved_gb": 4.5})
    code, out, err = cli(capsys, "--runs-dir", runs, "runs", "show", "t")
    assert code == 0, err
    assert "GPU GB" in out and "reserved" in out and "3.25" in out and "4.50" in out
    code, out, _ = cli(capsys, "--runs-dir", runs, "runs", "show", "t", "--json")
    [stage] = json.loads(out)["stages"]
    assert stage["gpu_mem_peak_gb"] == 3.25 and stage["gpu_mem_reserved_gb"] == 4.5 and stage["vllm_mem_gb"] is None
