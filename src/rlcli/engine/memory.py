"""What a stage leaves behind when it ends: nothing the next one does not need.

`rlcli run` runs its stages in one process (SFT -> GRPO -> DPO -> eval), so a stage's model, optimizer
and scheduler (a Hugging Face Trainer's, GRPO's learner, an eval's policy) must be gone before the next
one loads its own. They are the stage's locals, gone when it returns, but three things kept them:

- the vLLM engine, which the process kept to the end: `release_stage_memory`, called by the pipeline
  between stages and by the stage commands when they end, shuts it down unless the next stage samples
  with it (ENGINE_STAGES), collects the garbage and hands torch's cached CUDA blocks back to the driver;
- vLLM itself: an import error it keeps in a module global holds, through its traceback, every frame
  on the stack when vLLM was first imported, the stage that started the engine included
  (drop_import_errors, in release_stage_memory);
- a failing stage's traceback, which holds the frames it went through for as long as anyone holds the
  exception: the training stages (`frees_on_failure`, GrpoTrainer.release), the pipeline and the stage
  commands clear their locals (drop_frames).

Imports neither torch nor vLLM: what is not loaded has nothing to free.
"""

from __future__ import annotations

import functools
import gc
import sys
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# The stages that sample with the policy's vLLM engine (vllm_engine.policy_engine). Its options (the
# key shared_engine compares) come from the recipe alone, so GRPO and eval of one recipe share one
# engine; SFT and DPO train with the Hugging Face Trainer, which wants the engine's memory.
ENGINE_STAGES = ("grpo", "distill", "eval")


def release_stage_memory(*, keep_engine: bool, failure: BaseException | None = None) -> None:
    """After a stage: shut the process's vLLM engine down unless `keep_engine`, collect the garbage,
    and empty torch's CUDA cache where this process has initialised CUDA.

    failure: the exception a failed stage is leaving with; the locals of the frames it went through
    are cleared first (drop_frames)."""
    if failure is not None:
        drop_frames(failure)
    if not keep_engine and "rlcli.generation.vllm_engine" in sys.modules:  # never import vLLM's module to free
        from rlcli.generation.vllm_engine import shutdown_shared_engine

        shutdown_shared_engine()
    if "vllm" in sys.modules:
        drop_import_errors("vllm")
    gc.collect()
    torch = cuda_torch()
    if torch is not None:
        torch.cuda.empty_cache()


def keeps_engine(next_stage: str | None, samples_with_vllm: bool) -> bool:
    """Whether the vLLM engine a stage leaves stays for the next: when the next stage samples with it
    (ENGINE_STAGES) or there is none (the command, and with it the process, ends; an in-process caller
    such as the tests goes on with it); it goes before sft and dpo. A recipe that samples with the HF
    sampler built no engine, and leaves alone one the process holds for something else."""
    return not samples_with_vllm or next_stage is None or next_stage in ENGINE_STAGES


def frees_on_failure(work: Callable[P, T]) -> Callable[P, T]:
    """A stage's work (the function that holds its model, trainer and optimizer) that, when it fails,
    leaves its exception no locals to hold: drop_frames, then the exception goes on."""

    @functools.wraps(work)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return work(*args, **kwargs)
        except BaseException as exc:
            drop_frames(exc)
            raise

    return wrapped


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of the frames exc went through, now finished: the model, batches and activations
    they hold go, and the traceback keeps its lines for the error report. The frames still running (the
    caller's, and those above it) keep theirs."""
    traceback.clear_frames(exc.__traceback__)


def drop_import_errors(package: str) -> None:
    """Drop the tracebacks of the exceptions that the package's modules keep in their globals.

    vLLM 0.32 keeps the error of an optional import that failed (vllm/multimodal/media/audio.py,
    `_torchcodec_import_exc`, where torchcodec is not installed, as on a CPU). Its traceback holds the
    module's frame, and through that frame's callers every frame on the stack when vLLM was first
    imported, which is when rlcli starts the engine: GRPO's, with its trainer (policy, optimizer,
    reference), or an eval's, with its policy. They would never be freed. The exceptions keep their
    messages. Cheap: vLLM's globals only (about 15,000 values, 10 ms)."""
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        if name != package and not name.startswith(prefix):
            continue
        try:  # not getattr: a lazily loaded module would load itself to answer
            names = object.__getattribute__(module, "__dict__")
        except (AttributeError, TypeError):
            continue
        for value in list(names.values()):
            if issubclass(type(value), BaseException) and value.__traceback__ is not None:
                value.__traceback__ = None


def cuda_torch() -> Any:
    """torch, where this process has imported it and initialised CUDA; else None (nothing to measure
    or free, and no import of torch to find that out)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None
