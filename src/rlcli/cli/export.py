"""`rlcli export`: a run's checkpoint merged into its base model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlcli.cli.common import err_console, open_existing
from rlcli.errors import UsageError

app = typer.Typer()


@app.command("export")
def export_cmd(
    cli_ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run name.")],
    merge: Annotated[Path, typer.Option("--merge", help="Folder to write the merged full model to.")],
    checkpoint: Annotated[
        str,
        typer.Option(
            help="latest (with grpo.keep_best: the best), best (the best held-out success), sft or a checkpoint id."
        ),
    ] = "latest",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export in that folder.")] = False,
) -> None:
    """Write a run's checkpoint merged into its base model, loadable with from_pretrained."""
    from rlcli.models.loading import export_merged
    from rlcli.store.checkpoints import checkpoint_note, resolve_checkpoint

    rundb = open_existing(cli_ctx, f"No run named {run!r}")
    try:
        recipe = rundb.run_recipe(run)
        found = resolve_checkpoint(rundb, run, checkpoint)
        note = checkpoint_note(rundb, run, checkpoint)
        if note:
            err_console.print(f"export: {note}", highlight=False)
        if found is None:
            raise UsageError(
                f"Run {run!r}: {checkpoint} is the base model, which needs no export."
                if note
                else f"Run {run!r} has no checkpoint to export yet."
            )
        export_merged(recipe.model, recipe.lora, recipe.quantization, found.path, merge, overwrite)
    finally:
        rundb.close()
    err_console.print(f"Merged model written to [bold]{merge}[/bold]")
