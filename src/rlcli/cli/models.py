"""`rlcli models`: the registered short names and the local model cache.

Cheap to import: rlcli.models.cache imports torch and transformers only inside its functions.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from rlcli.cli.common import JsonOpt, console
from rlcli.models import cache as models

app = typer.Typer(
    help="Registered models and the local model cache ($RLCLI_MODELS, else $RLCLI_HOME/models, else ~/.cache/rlcli/models).",
    no_args_is_help=True,
)


@app.command("pull")
def pull(
    name: Annotated[
        str,
        typer.Argument(
            help="Registered model: " + "; ".join(f"{n}: {desc}" for n, (_, desc) in models.REGISTRY.items()) + ".",
            show_default=False,
        ),
    ],
) -> None:
    """Build a registered model into the cache (once) and print its folder."""
    print(models.pull_model(name))


@app.command("list")
def list_cmd(as_json: JsonOpt = False) -> None:
    """List the registered models (pulled or not) and other model folders in the cache."""
    rows = models.list_models()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("name", "kind", "size")
    table.add_column("path", overflow="fold")  # the path is what users copy; never cut it
    for row in rows:
        size = f"{row['size_bytes'] / 1e6:.1f} MB" if row["size_bytes"] is not None else "not pulled"
        table.add_row(row["name"], row["kind"], size, row["path"])
    console.print(table)
