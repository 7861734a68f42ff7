"""Asynchronous GRPO (grpo.max_staleness: k > 0): a worker process samples rollouts ahead while the trainer updates.

The trainer (grpo/loop.py's run_grpo) runs label/i and train/i as the synchronous loop does; the
rollout stages are played by a rollout worker, a process of its own (spawned) that loads its own copy
of the policy (load_policy) on rollout.device once, with its own sampler (make_sampler: hf or vllm),
takes each new version's LoRA adapter into it in place (WorkerPolicy), and
writes its stages and episodes into the same run database (WAL: one writer at a time, the other
waiting under the busy timeout).

Messages over a pipe. Trainer -> worker:
  ("weights", v, folder, policy) the weights after train/v (v = -1: the starting point; policy: their
                                 PolicyRef) are in folder (None: the base model): the checkpoint folder
                                 train/v saved, or, between checkpoints, a weights-only folder under <run>/policy/
  ("rollout", j, tasks)          play rollout/j on these tasks with the newest weights received
  ("stop",)
Worker -> trainer: ("done", j, seconds, version), or ("usage" | "error", text) when it stops on a failure.

Schedule. At the start of iteration i the trainer asks for rollout/i..i+k (those not asked for yet)
and draws their tasks then, so what a curriculum draw knows follows the trainer's progress, not
timing. It has pushed train/i-1's weights by then, so rollout/j is never sampled with weights older
than train/j-1-k. Before reporting a rollout done, the worker takes in every push that has come; it
starts the next rollout as soon as it is asked. With k = 1 rollout/j is thus always sampled with
train/j-2's weights (the starting point's for j <= 1), whatever the timing; with k > 1 the newest
weights at the start of a rollout depend on timing. Every episode records its weights either way.

Versions and staleness. An episode's `policy` (a PolicyRef, store/names.py) names the weights that
sampled it: train/<v>, or base or sft for the starting point (version -1). Iteration i trains on
rollout/i with staleness i - 1 - v: the updates between the weights that sampled an episode and those
being updated (0 in the synchronous loop), logged as train/staleness_mean and train/staleness_max.

Off-policy correction: decoupled PPO (AReaL). The ratio's pi_old is the proximal policy, the
trainer's weights at the start of the iteration's update, so clipping bounds each step as in PPO;
the gap between it and the behaviour policy that sampled a stale episode is corrected by the
importance weight pi_prox / pi_behav from the recorded rollout logprobs, truncated at grpo.tis_cap
(ASYNC_TIS_CAP when null). A fresh episode's weight is 1 (with tis_cap set, every episode gets the
truncated weight, as in the synchronous loop, where it corrects the sampler's numerics).

Resume after kill -9 of either process: the worker dies with the trainer (PR_SET_PDEATHSIG, and the
pipe's end), and the trainer stops with one sentence when the worker dies. Rollout stages are
ordinary resumable stages: one cut off continues chunk by chunk, and those sampled ahead and not
trained on yet are reused when their episodes are within the bound of the iteration that trains
them. Episodes that are not (grpo.max_staleness lowered on resume, to 0 say) are set aside into the
stage stale/rollout/<j>/<n> with their turns and labels, counted in a run event (stale_rollouts)
and in train/discarded_episodes, and the stage plays them again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.engine.context import RunContext
from rlcli.engine.grpo.staleness import START_VERSION, set_aside_stale
from rlcli.errors import RlcliError, UsageError
from rlcli.generation.sampler import Sampler
from rlcli.store.iterations import RolloutPlan
from rlcli.store.names import (
    PolicyRef,
    rollout_stage,
)
from rlcli.store.records import EpisodeSummary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.recipe import Recipe


def thread_split(threads: int | None) -> tuple[int, int]:
    """(trainer, worker) torch threads: run.threads, else the usable cores, split in two (the worker
    gets half, rounded down, at least one): two processes each running a thread per core would take
    each other's cores, which slows torch down far more than sharing them out."""
    from rlcli.engine.threads import usable_cores

    total = threads or usable_cores()
    worker = max(1, total // 2)
    return max(1, total - worker), worker


def worker_device(recipe: Recipe) -> tuple[str, str | None]:
    """(the worker's device as it sees it, its CUDA_VISIBLE_DEVICES or None): rollout.device, else
    model.device. A GPU is made the worker's only visible one, so an in-process vLLM engine (which
    takes the first visible GPU) can run on any of them."""
    from rlcli.models.loading import resolve_device

    device = resolve_device(recipe.rollout.device or recipe.model.device)
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device, None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    n = int(index or 0)
    if ids is not None and n >= len(ids):
        raise UsageError(f"rollout.device is {device}, but CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPUs.")
    return "cuda:0", ids[n] if ids is not None else str(n)


# --- the trainer's side --------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutWorkerSpec:
    """What the rollout worker needs to open the run as the trainer did."""

    runs_dir: str
    run: str
    recipe: dict[str, Any]
    device: str
    threads: int
    parent_pid: int
    root: str  # the trainer's working directory: recipes name env and reward files from it
    sys_path: list[str]


class RolloutWorker:
    """The trainer's handle on the rollout worker: asks for rollouts, pushes weights, waits for results."""

    def __init__(self, ctx: RunContext, threads: int):
        self.ctx = ctx
        self.k = ctx.recipe.grpo.max_staleness
        self.asked: set[int] = set()
        self.fresh: dict[int, bool] = {}  # rollout j -> not done before this process asked for it
        self.finished: dict[int, tuple[float, int]] = {}  # rollout j -> (seconds, version) from the worker
        self.used_version = START_VERSION  # the newest weights the worker has reported using
        device, visible = worker_device(ctx.recipe)
        self.device = device if visible is None else f"GPU {visible}"  # the worker calls it cuda:0
        spec = RolloutWorkerSpec(
            str(Path(ctx.runs_dir).resolve()),
            ctx.run,
            ctx.recipe.to_dict(),
            device,
            threads,
            os.getpid(),
            str(Path.cwd()),
            list(sys.path),
        )
        context = multiprocessing.get_context("spawn")  # a forked copy of a process running torch can deadlock
        self.conn, theirs = context.Pipe()
        # Not a daemon: daemons may not start processes, and its env workers (env.workers) are some.
        self.process = context.Process(target=serve_rollouts, args=(theirs, spec), name="rlcli-rollout")
        with _environment("CUDA_VISIBLE_DEVICES", visible):  # read by the child when it starts
            self.process.start()
        theirs.close()  # only the worker holds its end now: its death reads as EOF here

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        shutil.rmtree(push_root(self.ctx), ignore_errors=True)

    def push(self, version: int, folder: str | Path | None, policy: PolicyRef) -> None:
        """The weights after train/`version` (or the starting point's, `policy`) are in `folder`."""
        self._send(("weights", version, None if folder is None else str(folder), policy))

    def ask_through(self, it: int) -> None:
        """Ask for rollout/it..it+k, those not asked for yet (see the module docstring)."""
        from rlcli.engine.curriculum import iteration_tasks
        from rlcli.store.stages import stage_done

        for j in range(it, min(it + self.k, self.ctx.recipe.grpo.iterations - 1) + 1):
            if j in self.asked:
                continue
            set_aside_stale(self.ctx, j, self.k)
            self.fresh[j] = not stage_done(self.ctx.store, rollout_stage(j))
            self._send(("rollout", j, iteration_tasks(self.ctx, j)))
            self.asked.add(j)

    def wait(self, it: int) -> tuple[EpisodeSummary, dict[str, float], bool]:
        """Wait for rollout/it; return its stage result, the timings of a fresh one, and whether it was."""
        start = time.perf_counter()
        while it not in self.finished:
            wait([self.conn, self.process.sentinel])
            self._read()
        waited = time.perf_counter() - start
        seconds, version = self.finished.pop(it)
        self.used_version = max(self.used_version, version)
        prune_pushes(self.ctx, self.used_version)
        row = self.ctx.store.stage(rollout_stage(it))
        assert row is not None and row.result  # the worker reports a rollout done once its stage is stored
        timings = {"perf/time_rollout_s": seconds, "perf/time_wait_s": waited}
        return EpisodeSummary.from_dict(row.result), timings, self.fresh[it]

    def _read(self) -> None:
        while True:
            try:
                if not self.conn.poll():
                    if self.process.is_alive():
                        return
                    message = None
                else:
                    message = self.conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None:
                self.process.join(timeout=5)
                raise RlcliError(
                    f"The rollout worker process died (exit code {self.process.exitcode}); run the command again "
                    "to resume."
                )
            if message[0] == "done":
                _, j, seconds, version = message
                self.finished[j] = (seconds, version)
            elif message[0] == "usage":
                raise UsageError(message[1])
            else:
                raise RlcliError(f"The rollout worker stopped: {message[1]}")

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            self._read()  # it is gone: say why
            raise


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """os.environ[name] = value for the duration (None: unchanged)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def push_root(ctx: RunContext) -> Path:
    """Where the trainer puts the weights of iterations that save no checkpoint, for the worker to load."""
    return ctx.run_dir / "policy"


def push_folder(ctx: RunContext, it: int) -> Path:
    return push_root(ctx) / f"iter-{it:04d}"


def prune_pushes(ctx: RunContext, used: int) -> None:
    """Remove the weights-only folders older than the newest the worker has used: it never goes back."""
    root = push_root(ctx)
    if root.is_dir():
        for folder in root.iterdir():
            if folder.name.startswith("iter-") and folder.name[5:].isdigit() and int(folder.name[5:]) < used:
                shutil.rmtree(folder, ignore_errors=True)


# --- inside the worker ---------------------------------------------------------------------


def serve_rollouts(conn: Connection, spec: RolloutWorkerSpec) -> None:
    """The worker's life: play the rollouts asked for, in order, until told to stop or the trainer is gone."""
    from rlcli.envs.subprocesses import exit_with_parent

    exit_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops this process
    sys.path[:] = spec.sys_path
    os.chdir(spec.root)
    try:
        _serve_rollouts(conn, spec)
    except UsageError as exc:
        conn.send(("usage", str(exc)))
    except RlcliError as exc:
        conn.send(("error", str(exc)))
    except EOFError:  # the trainer is gone
        return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _serve_rollouts(conn: Connection, spec: RolloutWorkerSpec) -> None:
    import torch
    from rich.console import Console

    from rlcli.recipe import Recipe
    from rlcli.store.db import RunDB

    torch.set_num_threads(spec.threads)
    recipe = Recipe.model_validate(spec.recipe)
    recipe = recipe.model_copy(
        update={
            "model": recipe.model.model_copy(update={"device": spec.device}),
            "rollout": recipe.rollout.model_copy(update={"device": spec.device}),
        }
    )
    rundb = RunDB.open(spec.runs_dir)
    # The trainer's console shows the run; rollout progress bars from a second process would garble it.
    ctx = RunContext(recipe, rundb, spec.run, Path(spec.runs_dir), console=Console(stderr=True, quiet=True))
    weights: tuple[int, str | None, PolicyRef] | None = None  # (version, folder, policy): the newest pushed
    loaded = WorkerPolicy(recipe)
    asked: deque[tuple[int, list[int]]] = deque()
    policy: tuple[tuple[int, str | None, PolicyRef], Sampler, PreTrainedTokenizerBase] | None = None  # loaded

    def take(message: tuple) -> bool:
        nonlocal weights
        if message[0] == "weights":
            weights = message[1:]
        elif message[0] == "rollout":
            asked.append(message[1:])
        return message[0] != "stop"

    try:
        while True:
            if not asked:
                if not take(conn.recv()):
                    return
                continue
            j, tasks = asked.popleft()
            assert weights is not None  # the trainer pushes the starting weights before it asks for a rollout
            if policy is None or policy[0] != weights:
                policy = (weights, *loaded.load(weights[1]))
            start = time.perf_counter()
            _rollout(ctx, j, tasks, weights[2], policy[1], policy[2])
            seconds = time.perf_counter() - start
            while conn.poll():  # the pushes that came meanwhile: the next rollout uses the newest
                if not take(conn.recv()):
                    return
            conn.send(("done", j, seconds, weights[0]))
    finally:
        rundb.close()


class WorkerPolicy:
    """The worker's policy, read from disk once. With LoRA each new version's adapter (the folder the
    trainer saved, a few MB) goes into it in place, rather than the whole model being loaded again. On
    the HF sampler without quantization the adapter is merged into the weights, as an inference load
    merges it (load_policy; the separate branch slows decoding), starting each time from a copy of the
    base weights kept on the CPU, so that every version samples exactly as a fresh load of it would.
    A full model (no LoRA) is loaded whole: its checkpoint is the weights. The sampler is made anew per
    version: cheap for the HF sampler; the vLLM engine is the process's one, given the new weights."""

    def __init__(self, recipe: Recipe) -> None:
        from rlcli.generation.engines import generation_engine

        self.recipe = recipe
        self.model: Any = None
        self.tokenizer: Any = None
        self.merges = generation_engine(recipe) == "hf" and recipe.quantization.mode == "none"
        self.base: dict[str, Any] | None = None  # name -> base weight of each layer the adapter merges into

    def load(self, folder: str | None) -> tuple[Sampler, PreTrainedTokenizerBase]:
        """(sampler, tokenizer) over the weights in `folder` (None: the base model)."""
        from rlcli.generation.engines import make_sampler
        from rlcli.generation.sampler import sampling_config
        from rlcli.models.loading import load_policy

        recipe = self.recipe
        adapter = folder is not None and (Path(folder) / "adapter_config.json").is_file()
        if recipe.lora is None or (folder is not None and not adapter):
            self.model, self.tokenizer = load_policy(
                recipe.model, recipe.lora, recipe.quantization, adapter=folder, trainable=False
            )
        else:
            if self.model is None:
                self.model, self.tokenizer = load_policy(
                    recipe.model, recipe.lora, recipe.quantization, trainable=False
                )
            if folder is not None:
                self._put_adapter(folder)
        sampler = make_sampler(
            recipe,
            self.model,
            self.tokenizer,
            sampling_config(recipe.rollout),
            base=folder is None,
            checkpoint_folder=folder,
        )
        return sampler, self.tokenizer

    def _put_adapter(self, folder: str) -> None:
        import torch

        from rlcli.models.loading import put_adapter

        if self.base is not None:  # undo the last merge: peft's state back to unmerged, the weights to the base
            self.model.unmerge_adapter()
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    if name in self.base:
                        param.copy_(self.base[name])
        self.model = put_adapter(self.model, folder)
        if self.merges:
            if self.base is None:
                self.base = {
                    name: param.detach().to("cpu", copy=True)
                    for name, param in self.model.named_parameters()
                    if name.endswith("base_layer.weight")
                }
            self.model.merge_adapter()


def _rollout(
    ctx: RunContext, j: int, tasks: list[int], policy: PolicyRef, sampler: Sampler, tokenizer: PreTrainedTokenizerBase
) -> None:
    """rollout/j as the synchronous loop runs it: same stage, params, seeds and episodes."""
    from rlcli.engine.rollout import collect

    ctx.stage(
        rollout_stage(j),
        lambda: collect(
            ctx,
            stage=rollout_stage(j),
            policy=policy,
            sampler=sampler,
            tokenizer=tokenizer,
            task_indices=tasks,
            group_size=ctx.recipe.rollout.group_size,
            split="train",
            iteration=j,
            progress_label=f"rollout {j}",
        ),
        params=RolloutPlan(j, tasks, ctx.recipe.env.horizon(j)).to_params(),
    )
