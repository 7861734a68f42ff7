"""`rlcli export`: a run's checkpoint merged into its base model, and optionally pushed to the hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rlcli.cli.common import err_console, open_recorded_run
from rlcli.errors import UsageError

app = typer.Typer()

PushOpt = Annotated[
    str | None,
    typer.Option(
        "--push-to-hub",
        help="Upload to this Hugging Face Hub repo (ORG/NAME, or NAME under your user), with a generated card "
        "(README.md); needs a token (`hf auth login` or HF_TOKEN).",
        show_default=False,
    ),
]
PrivateOpt = Annotated[
    bool,
    typer.Option("--private", help="With --push-to-hub: create the repo private (an existing public one is refused)."),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="With --push-to-hub: write the folder and card that would be uploaded, and upload nothing "
        "(no token or network needed).",
    ),
]

PushJsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help='Print {"folder", "repo_id", "url", "files" (those uploaded), "uploaded"} instead of the URL or folder.',
    ),
]


@app.command("export")
def export_cmd(
    cli_ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run name.")],
    merge: Annotated[
        Path | None,
        typer.Option(
            "--merge",
            help="Folder to write the merged full model to (with --push-to-hub, the folder uploaded; default "
            "there: <runs-dir>/<run>/hub-model, replaced each time).",
            show_default=False,
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="latest (the newest checkpoint), best (the best held-out success), sft or a checkpoint id "
            "(default: best with grpo.keep_best, else latest).",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export in that folder.")] = False,
    push_to_hub: PushOpt = None,
    private: PrivateOpt = False,
    dry_run: DryRunOpt = False,
    as_json: PushJsonOpt = False,
) -> None:
    """Write a run's checkpoint merged into its base model, loadable with from_pretrained; with
    --push-to-hub, add a model card (the recipe, the eval table, the training curves) and upload it.

    Prints the folder written, or with --push-to-hub (and no --dry-run) the repo's URL."""
    from rlcli.models.loading import export_merged
    from rlcli.report import hub
    from rlcli.store.checkpoints import checkpoint_note, resolve_checkpoint

    if merge is None and push_to_hub is None:
        raise UsageError("Give --merge DIR (the folder to write) or --push-to-hub ORG/NAME, or both.")
    check_push_options(push_to_hub, private, dry_run)
    store = open_recorded_run(cli_ctx, run)
    try:
        recipe = store.recipe()
        # grpo.keep_best: the run's result is its best checkpoint, not its last.
        checkpoint = checkpoint or ("best" if recipe.grpo.keep_best else "latest")
        found = resolve_checkpoint(store, checkpoint)
        note = checkpoint_note(store, checkpoint)
        if note:
            err_console.print(f"export: {note}", highlight=False)
        if found is None:
            raise UsageError(
                f"Run {run!r}: {checkpoint} is the base model, which needs no export."
                if note
                else f"Run {run!r} has no checkpoint to export yet."
            )
        # The default folder is rlcli's, in the run's folder: replaced unasked, as `runs plot` replaces its PNG.
        folder = merge or store.rundb.path.parent / run / "hub-model"
        repo = push_to_hub

        def card(staging: Path) -> dict[str, bytes]:
            assert repo is not None and found is not None  # only passed with --push-to-hub, for a checkpoint
            return hub.model_card_files(store, repo, found, staging)

        export_merged(
            recipe.model,
            recipe.lora,
            recipe.quantization,
            found.path,
            folder,
            overwrite or merge is None,
            extra=card if repo else None,
        )
    finally:
        store.rundb.close()
    err_console.print(f"Merged model written to [bold]{folder}[/bold]")
    finish_push(folder, repo, "model", private, dry_run, as_json, run, recipe.run.license is None)


def check_push_options(repo: str | None, private: bool, dry_run: bool) -> None:
    """The refusals of --push-to-hub, --private and --dry-run, before anything is read or written."""
    from rlcli.report import hub

    if repo is None:
        if private or dry_run:
            raise UsageError(f"{'--private' if private else '--dry-run'} goes with --push-to-hub ORG/NAME.")
        return
    hub.check_repo_id(repo)
    if not dry_run:
        hub.check_can_push()


def finish_push(
    folder: Path,
    repo: str | None,
    repo_type: str,
    private: bool,
    dry_run: bool,
    as_json: bool,
    run: str,
    no_license: bool,
    rows: dict[str, int] | None = None,
) -> None:
    """Upload the staged folder unless --dry-run; print the URL (or the folder), or the JSON result."""
    from rlcli.report import hub

    result: dict[str, object] = {"folder": str(folder), "repo_id": repo, "url": None, "files": None, "uploaded": False}
    if rows is not None:
        result["rows"] = rows
    if repo is not None:
        result["files"] = hub.staged_files(folder)
        if no_license:
            err_console.print(f"note: {hub.LICENSE_NOTE}", highlight=False)
        if dry_run:
            err_console.print(f"--dry-run: {folder} holds what would be uploaded to {repo}; nothing was uploaded.")
        else:
            err_console.print(f"Uploading {folder} to {repo} ...", highlight=False)
            result["url"] = hub.push_folder(folder, repo, repo_type, private, f"rlcli: {repo_type} of run {run}")
            result["uploaded"] = True
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(result["url"] or folder)
