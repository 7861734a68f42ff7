"""What every stage needs: the validated recipe, the run database, the run's name and folder."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

from rich.console import Console

from rlcli.console import RunProgress, err_console
from rlcli.engine.memory import cuda_torch
from rlcli.recipe import Recipe
from rlcli.store.db import RunDB
from rlcli.store.records import GPU_PEAK_KEY, GPU_RESERVED_KEY, VLLM_MEMORY_KEY
from rlcli.store.run_store import RunStore
from rlcli.store.stages import run_stage

if TYPE_CHECKING:
    from typing_extensions import Self


class StageResult(Protocol):
    """A stage's typed result: stored as to_dict() gives it, read back with from_dict once the stage is done."""

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self: ...


Result = TypeVar("Result", bound=StageResult)
T = TypeVar("T")


@dataclass
class RunContext:
    recipe: Recipe
    rundb: RunDB
    run: str
    runs_dir: Path
    # Progress bars and notes go to stderr, so that --json output on stdout stays clean.
    console: Console = field(default_factory=lambda: err_console)
    progress: RunProgress = field(init=False)  # the command's overall progress, on the console
    # The command's start-up summary (engine/opening.py), made and printed once, as its work begins
    # (announce): a command refused before any work prints its one sentence alone, and loads nothing.
    summary: Callable[[], str] | None = None

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir)
        self.progress = RunProgress(self.console)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run

    def announce(self) -> None:
        """Print the start-up summary, the first time only."""
        if self.summary is not None:
            summary, self.summary = self.summary, None
            self.console.print(summary(), highlight=False, markup=False)

    @property
    def store(self) -> RunStore:
        """The run database bound to this run, what the store's per-run functions take."""
        return RunStore(self.rundb, self.run)

    @overload
    def stage(
        self,
        name: str,
        work: Callable[[], dict[str, Any] | None],
        params: dict[str, Any] | None = None,
        *,
        commit: Callable[[dict[str, Any]], None] | None = None,
        **options: Any,
    ) -> dict[str, Any]: ...

    @overload
    def stage(
        self,
        name: str,
        work: Callable[[], Result],
        params: dict[str, Any] | None = None,
        *,
        result: type[Result],
        commit: Callable[[Result], None] | None = None,
        **options: Any,
    ) -> Result: ...

    def stage(
        self,
        name: str,
        work: Callable[[], Any],
        params: dict[str, Any] | None = None,
        *,
        result: type[StageResult] | None = None,
        commit: Callable[[Any], None] | None = None,
        **options: Any,
    ) -> Any:
        """`run_stage` on this run; options are run_stage's other keywords (identity, new_stage_hint).

        With a `result` type, `work` returns one, `commit` gets it, and so does the caller: the one
        work returned, or, for a stage already done, the one read back from its stored result.
        On a GPU the stage's peak memory (per device) is recorded with it (GPU_MEMORY_KEYS), in the
        transaction that marks it done."""
        self.announce()
        peak = GpuPeak()
        made: list[StageResult] = []  # what a typed stage's work returned

        def stored_work() -> dict[str, Any] | None:
            value = peak.measure(work)
            if result is None:
                return value
            made.append(value)
            return value.to_dict()

        def commit_with_memory(stored: dict[str, Any]) -> None:
            if commit is not None:
                commit(made[0] if made else stored)
            memory = peak.metrics()
            if memory:
                self.store.log_metrics(name, 0, memory)

        stored = run_stage(self.store, name, stored_work, params, commit=commit_with_memory, **options)
        if result is None:
            return stored
        return made[0] if made else result.from_dict(stored)


# A stage's peak memory per CUDA device index: (torch's allocated bytes, its reserved bytes).
DevicePeaks = dict[int, tuple[int, int]]

# The peaks seen so far by each stage in progress, outermost first: a stage inside another (train/3
# inside grpo/1) resets torch's peak counters, so it hands its own peaks on to the stage around it.
_open_peaks: list[DevicePeaks] = []


class GpuPeak:
    """A stage's peak GPU memory, per device. Nothing is measured unless this process has initialised
    CUDA, so CPU runs (and commands that never import torch) pay nothing."""

    def __init__(self) -> None:
        self.peaks: DevicePeaks | None = None

    def measure(self, work: Callable[[], T]) -> T:
        torch = cuda_torch()
        if torch is not None:
            if _open_peaks:
                _open_peaks[-1] = merged_peaks(_open_peaks[-1], _device_peaks(torch))
            for index in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(index)
        _open_peaks.append({})
        try:
            result = work()
        finally:
            inner = _open_peaks.pop()
        torch = cuda_torch()  # the stage may have been the first to use CUDA
        if torch is not None:
            self.peaks = merged_peaks(inner, _device_peaks(torch))
            if _open_peaks:
                _open_peaks[-1] = merged_peaks(_open_peaks[-1], self.peaks)
        return result

    def metrics(self) -> dict[str, float | None]:
        if self.peaks is None:
            return {}
        engine_gb = None
        if "rlcli.generation.vllm_engine" in sys.modules:  # never import vLLM's module just to ask
            from rlcli.generation.vllm_engine import shared_engine_reserved_gb

            engine_gb = shared_engine_reserved_gb()
        return gpu_memory_metrics(self.peaks, engine_gb)


def gpu_memory_metrics(peaks: DevicePeaks, engine_gb: float | None) -> dict[str, float | None]:
    """A stage's GPU_MEMORY_KEYS from its peaks per device: the largest device's allocated and reserved
    peaks (one GPU's figures, whatever the number of GPUs), the vLLM engine's share, and, when the stage
    used more than one device, each one's under its own key (perf/gpu_mem_peak_gb/cuda:1)."""
    if not peaks:
        return {}
    metrics: dict[str, float | None] = {
        GPU_PEAK_KEY: max(allocated for allocated, _ in peaks.values()) / 1e9,
        VLLM_MEMORY_KEY: engine_gb,
        GPU_RESERVED_KEY: max(reserved for _, reserved in peaks.values()) / 1e9,
    }
    used = {index: peak for index, peak in sorted(peaks.items()) if any(peak)}
    if len(used) > 1:
        for index, (allocated, reserved) in used.items():
            metrics[f"{GPU_PEAK_KEY}/cuda:{index}"] = allocated / 1e9
            metrics[f"{GPU_RESERVED_KEY}/cuda:{index}"] = reserved / 1e9
    return metrics


def merged_peaks(a: DevicePeaks, b: DevicePeaks) -> DevicePeaks:
    """The larger of two peaks on each device."""
    merged = dict(a)
    for index, (allocated, reserved) in b.items():
        before = merged.get(index, (0, 0))
        merged[index] = (max(before[0], allocated), max(before[1], reserved))
    return merged


def _device_peaks(torch: Any) -> DevicePeaks:
    return {
        index: (torch.cuda.max_memory_allocated(index), torch.cuda.max_memory_reserved(index))
        for index in range(torch.cuda.device_count())
    }
