"""Opening a run for a command that works on it: the recipe validated (and planned against the GPU),
the run database opened, the run locked, created or resumed with its recipe recorded; and its status
following the command. A command that fails before any stage has started leaves the run as it found it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rlcli.console import err_console
from rlcli.engine.context import RunContext
from rlcli.errors import RlcliError, UsageError
from rlcli.store.names import SFT_STAGE

if TYPE_CHECKING:
    from rlcli.recipe import Recipe
    from rlcli.store.db import RunDB


@contextlib.contextmanager
def open_run(
    recipe_path: Path | None,
    run: str | None,
    runs_dir: Path | None,
    overrides: list[str] | None,
    force: bool = False,
    stages: list[str] | None = None,
) -> Iterator[RunContext]:
    """Validate the recipe, open the database, lock the run, record it; yield a RunContext.
    stages: what the command runs (sft, grpo, dpo, eval), for the memory plan on a GPU; None: the recipe's.

    A command that fails before any stage of the run has started leaves the run as it found it (or
    absent, if it made it): a typo in a command line must not mark a run failed or rewrite its recipe.
    """
    from rlcli.engine.games import check_opponents
    from rlcli.engine.preflight import check_recipe
    from rlcli.engine.task_data import task_data_hashes
    from rlcli.recipe import load_recipe, recipe_file
    from rlcli.store.db import RunDB, check_run_name, default_runs_dir
    from rlcli.store.run_folders import MARKER, claim_run_folder, holds_no_output
    from rlcli.store.stages import RunLock
    from rlcli.usercode import code_hashes

    if recipe_path is None and run is None:
        raise UsageError("Give a recipe with --recipe/-r FILE (or --run NAME to continue a recorded run).")
    # A bad recipe or run name must fail before anything is written, the database file included.
    if run is not None:
        check_run_name(run)
    if recipe_path is not None:
        recipe_path = recipe_file(recipe_path)  # a shipped recipe's name (-r quickstart): its file
    recipe = load_recipe(recipe_path, overrides or []) if recipe_path is not None else None
    runs_dir = Path(runs_dir) if runs_dir else default_runs_dir()
    if recipe is not None:
        recipe.run.name = check_run_name(run or recipe.run.name)
        check_recipe(recipe, stages, sft_done=_sft_done(runs_dir, recipe.run.name))
    rundb = RunDB.open(runs_dir)
    try:
        if recipe is None:
            assert run is not None  # no recipe path, so a run name (checked above)
            recipe = _recorded_recipe(rundb, run, overrides or [])
            check_recipe(recipe, stages, sft_done=_sft_done(runs_dir, run))
        name = recipe.run.name
        rundb.check_case_twin(name)  # before the folder is made
        # The run's folder, made (with its marker) before the lock goes in it; a new run refuses a
        # folder rlcli did not make.
        new_folder = claim_run_folder(runs_dir, name, recorded=rundb.get_run(name) is not None)
        with RunLock(runs_dir, name) as lock:
            # User env and reward files are loaded from the working directory, like the recipe's paths; an
            # agent's task files are watched as they are.
            code = code_hashes(recipe.env.name, [r.fn for r in recipe.rewards], Path.cwd())
            code |= task_data_hashes(recipe.env)
            _warn_code_changes(rundb, name, code)
            before = rundb.run_state(name)
            # A recorded run that has produced nothing (its stages failed or were stopped before they
            # stored anything) starts over with the recipe given, which may correct the one it failed on.
            starts_over = before.row is not None and not rundb.has_outputs(name) and holds_no_output(runs_dir, name)
            try:
                rundb.start_run(
                    name,
                    recipe,
                    str(recipe_path) if recipe_path else None,
                    force=force,
                    code=code,
                    starts_over=starts_over,
                )
                try:
                    ctx = RunContext(recipe, rundb, name, runs_dir, console=err_console)
                    check_opponents(ctx)  # needs the run's checkpoints; before any work
                    yield ctx
                except BaseException:
                    rundb.restore_run(before)
                    raise
            except BaseException:
                if new_folder and rundb.get_run(name) is None:
                    (runs_dir / name / MARKER).unlink(missing_ok=True)
                    lock.remove_folder()  # no run, no folder: as the command found them
                raise
    finally:
        rundb.close()


def _recorded_recipe(rundb: RunDB, run: str, overrides: list[str]) -> Recipe:
    """The stored recipe of a recorded run (continued without -r), with the command line's overrides."""
    from rlcli.recipe import apply_override, validate_recipe

    data = rundb.run_recipe(run).to_dict()
    for item in overrides:
        apply_override(data, item)
    recipe = validate_recipe(data, f"run {run!r}")
    recipe.run.name = run
    return recipe


def _warn_code_changes(rundb: RunDB, run: str, code: dict[str, str]) -> None:
    """A line for each env, reward or task file whose hash differs from the one the run last used."""
    for path in rundb.code_changes(run, code):
        err_console.print(
            f"warning: {path} changed since run {run!r} last used it; "
            "the new hash is recorded in its recipe history (rlcli runs show).",
            highlight=False,
        )


def _sft_done(runs_dir: Path, run: str) -> bool:
    """Whether the run's SFT stage is done, read before the run is opened for writing (a resumed `rlcli run`
    from another folder must not be refused over SFT data it will not read again)."""
    from rlcli.store.db import DB_NAME, RunDB

    if not (runs_dir / DB_NAME).is_file():
        return False
    try:
        rundb = RunDB.open(runs_dir, read_only=True)
    except UsageError:  # a database rlcli cannot read: opening it for the run says why
        return False
    try:
        row = rundb.stage(run, SFT_STAGE)
        return row is not None and row.done
    finally:
        rundb.close()


def startup_summary(ctx: RunContext, stages: list[str] | None) -> str:
    """One line of what a stage command is about to run where, and what the `auto` settings chose
    (marked "(auto)"): the model, its adapter and precision, the device, the generation engine (on a
    GPU, vLLM's share of it and its sleep level), torch's threads, and the stages, when the command
    runs the recipe's (stages None; else the command names its stage)."""
    import torch

    from rlcli.generation.engines import generation_engine
    from rlcli.models.loading import load_dtype, resolve_device

    def chosen(setting: str | int | None) -> str:
        return " (auto)" if setting in ("auto", None) else ""

    recipe = ctx.recipe
    device = resolve_device(recipe.model.device)
    dtype = str(load_dtype(recipe.model, recipe.quantization, device)).removeprefix("torch.")
    model = [recipe.model.name]
    if recipe.lora is not None:
        model.append(f"LoRA r{recipe.lora.r}")
    if recipe.quantization.mode != "none":
        model.append(recipe.quantization.mode)
    model.append(f"{dtype}{chosen(recipe.model.dtype)} on {device}{chosen(recipe.model.device)}")
    engine = generation_engine(recipe)
    engine_text = f"engine {engine}{chosen(recipe.rollout.engine)}"
    if engine == "vllm" and device.startswith("cuda"):
        from rlcli.generation.memory_plan import plan_on_this_machine

        plan = plan_on_this_machine(recipe, stages or [])
        if plan is not None and plan.choices.vllm_memory is not None:
            sleep = plan.choices.sleep_level
            engine_text += f", {plan.choices.vllm_memory:.0%} of the GPU, " + (
                f"sleep level {sleep}" if sleep else "no sleep"
            )
    threads = torch.get_num_threads()
    parts = [
        f"run {ctx.run}: {', '.join(model)}",
        engine_text,
        f"{threads} torch thread{'s' if threads != 1 else ''}{chosen(recipe.run.threads)}",
    ]
    if stages is None:
        from rlcli.engine.pipeline import planned_stages

        parts.append(f"stages {', '.join(planned_stages(recipe))}")
    return " · ".join(parts)


@contextlib.contextmanager
def tracked(ctx: RunContext) -> Iterator[None]:
    """The run's status follows the command: running, then done or failed."""
    ctx.store.set_status("running")
    try:
        yield
    except KeyboardInterrupt:
        # Typer turns Ctrl-C into exit 130 before main() could say how to go on.
        ctx.store.set_status("failed", "interrupted")
        err_console.print("Interrupted; run the same command again to resume.")
        raise
    except BaseException as exc:
        # As main() reports it: an RlcliError's sentence, else the exception's type too.
        error = str(exc) if isinstance(exc, RlcliError) else f"{type(exc).__name__}: {exc}"
        ctx.store.set_status("failed", error)
        raise
    ctx.store.set_status("done")
