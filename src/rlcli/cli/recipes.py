"""`rlcli recipes ...`: list and copy the shipped recipes, check recipe files, and show the recipe
schema (also rendered to docs/recipe.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from rlcli.cli.common import JsonOpt, Overrides, console, err_console
from rlcli.errors import UsageError, shorten

if TYPE_CHECKING:  # rlcli.recipe imports pydantic: only the commands that need it load it
    from rlcli.generation.memory_plan import MemoryPlan
    from rlcli.recipe import FieldDoc, SectionDoc

app = typer.Typer(help="List, copy and check recipes, and show the recipe schema.", no_args_is_help=True)

REGENERATE_DOCS = "rlcli recipes explain --markdown > docs/recipe.md"
RESUME_SAFE_NOTE = "Can change on resume without --force."


@app.command("list")
def recipes_list(as_json: JsonOpt = False) -> None:
    """The shipped recipes, each with its purpose (the first line of its header). Run one with
    `-r NAME`, or copy it out to edit with `rlcli recipes copy NAME`.

    With --json: a list of objects with "name", "purpose" and "path"."""
    from rich.table import Table

    from rlcli.recipe import recipe_purpose, shipped_recipes
    from rlcli.report.text import literal

    rows = [(name, recipe_purpose(path), path) for name, path in shipped_recipes().items()]
    if as_json:
        print(json.dumps([{"name": n, "purpose": p, "path": str(f)} for n, p, f in rows], indent=2))
        return
    table = Table(show_edge=False)
    table.add_column("recipe", no_wrap=True)
    table.add_column("purpose")
    for name, purpose, _ in rows:
        table.add_row(literal(name, style="bold"), literal(purpose))  # a header may hold [brackets]
    console.print(table)


@app.command("copy")
def recipes_copy(
    name: Annotated[str, typer.Argument(help="A shipped recipe (rlcli recipes list).", show_default=False)],
    dest: Annotated[
        Path | None,
        typer.Argument(
            help="Where to write it: a file, or a folder to put my-NAME.yaml in (default: ./my-NAME.yaml).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Copy a shipped recipe out to edit; never replaces an existing file. Prints the new file's path.

    The copy is its own: its run is named after its file (my-NAME by default, never the shipped run's
    name), its header's commands name it, and a first line says that the notes below (timings,
    results) were measured on the shipped recipe.

    Examples:
      rlcli recipes copy quickstart  # ./my-quickstart.yaml, run my-quickstart
      rlcli recipes copy arithmetic experiments/add-lr.yaml
    """
    from rlcli.recipe import copied_recipe_text, copy_run_name, shipped_recipes
    from rlcli.store.db import check_run_name

    shipped = shipped_recipes()
    if name not in shipped:
        raise UsageError(f"No shipped recipe named {name!r}; expected one of: {', '.join(shipped)}.")
    target = dest or Path(f"my-{name}.yaml")
    if target.is_dir():
        target = target / f"my-{name}.yaml"
    if target.exists():
        raise UsageError(
            f"{target} already exists; expected a new file (rlcli never overwrites one): name another DEST."
        )
    if not target.parent.is_dir():
        raise UsageError(f"{target.parent} is not a folder; expected DEST in an existing folder.")
    run = copy_run_name(name, target)
    try:
        check_run_name(run)
    except UsageError as exc:
        raise UsageError(f"{str(exc).rstrip('.')}; a copy's run is named after its file: rename {target}.") from None
    with target.open("x") as out:  # "x": a file made meanwhile is not replaced either
        out.write(copied_recipe_text(name, target, run))
    print(target)


@app.command("validate")
def recipes_validate(
    items: Annotated[
        list[str],
        typer.Argument(
            metavar="RECIPES... [OVERRIDES]",
            help="Recipe YAML files, or shipped recipes' names; then any overrides as dotted key=value "
            "(grpo.lr=1e-5), applied to each recipe as a stage command applies them.",
            show_default=False,
        ),
    ],
    as_json: JsonOpt = False,
    schema: Annotated[
        bool,
        typer.Option(
            "--schema",
            help="Check the schema only: the same answer on every machine (no model, env, reward, tracker or "
            "tool server is looked up).",
        ),
    ] = False,
) -> None:
    """Check recipes, with the overrides a command line would give them, as a stage command does before
    it starts: the schema and the run name, then the model known, reward functions resolvable, the env
    loadable with its kwargs, SFT's data there, trackers installed, MCP servers answering (loads no
    model). A line per recipe, passed or failed, on stdout; exits 2 if any fails.

    With --json: an object with "ok", "overrides" and "files" (each with "path", "ok" and a list of "errors").

    Examples:
      rlcli recipes validate my-recipe.yaml
      rlcli recipes validate my-recipe.yaml sft.source=data.jsonl grpo.lr=1e-5
      rlcli recipes validate --schema quickstart arithmetic
    """
    from rlcli.engine.preflight import check_recipe
    from rlcli.recipe import load_recipe
    from rlcli.store.db import check_run_name

    files, overrides = recipes_and_overrides(items)
    results = []
    for path in files:
        try:
            recipe = load_recipe(path, overrides)  # its errors name the file
            try:
                check_run_name(recipe.run.name)  # every command that runs the recipe checks it so
                if not schema:
                    check_recipe(recipe)
            except UsageError as exc:
                raise UsageError(f"{path}: {exc}") from None
        except UsageError as exc:
            results.append({"path": path, "ok": False, "errors": [shorten(str(exc))]})
            if not as_json:  # soft_wrap: a line a recipe, however long, for grep and the eye
                console.print(f"[red]✗[/red] {escape(shorten(str(exc)))}", highlight=False, soft_wrap=True)
        else:
            results.append({"path": path, "ok": True, "errors": []})
            if not as_json:
                console.print(f"[green]✓[/green] {escape(path)}", highlight=False, soft_wrap=True)
    ok = all(result["ok"] for result in results)
    if as_json:
        print(json.dumps({"ok": ok, "overrides": overrides, "files": results}, indent=2))
    if not ok:
        raise typer.Exit(2)


def recipes_and_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """`recipes validate`'s arguments: the recipes, then the overrides (key=value, not a file's path)."""
    overrides = [item for item in items if "=" in item and not Path(item).is_file()]
    files = [item for item in items if item not in overrides]
    if not files:
        raise UsageError(f"No recipe to validate among {' '.join(items)}; expected a recipe file or name first.")
    return files, overrides


@app.command("plan")
def recipes_plan(
    recipe: Annotated[str, typer.Argument(help="A recipe file, or a shipped recipe's name.", show_default=False)],
    overrides: Overrides = None,
    gpu_gb: Annotated[
        float | None,
        typer.Option("--gpu-gb", min=1, help="The card's memory in GB (default: this machine's first visible GPU)."),
    ] = None,
    gpus: Annotated[
        int | None, typer.Option("--gpus", min=1, help="How many such cards (default: the visible ones, else 1).")
    ] = None,
    capability: Annotated[
        float | None,
        typer.Option(
            "--capability",
            min=1,
            help="The card's CUDA compute capability, which decides bfloat16 (8.0) and FP8 in vLLM (8.9) "
            "(default: the visible GPU's, else 8.9: an L4, RTX 4090 or H100 and newer).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """What each stage of a recipe takes on each GPU, before anything runs: weights, LoRA and optimizer state,
    activations, vLLM's share and KV cache, CUDA context and the peak, against the card; and what the `auto`
    settings mean there. Computed from the model's config.json (no weights loaded). Exits 2 when a stage
    cannot fit, with the setting to change.

    With --json: "card", "gpus", "fits", "problems", "choices", "stages" (stage, device, peak_gb, parts_gb)."""
    from rlcli.engine.pipeline import planned_stages
    from rlcli.generation.memory_plan import GB, Card, plan_memory, visible_gpus
    from rlcli.recipe import load_recipe, recipe_file

    loaded = load_recipe(recipe_file(recipe), overrides or [])
    seen = visible_gpus()
    if gpu_gb is None and not seen:
        raise UsageError("No GPU is visible here; give the card's memory with --gpu-gb (e.g. --gpu-gb 24).")
    here = seen[0] if seen else None
    name = here.name if here is not None and gpu_gb is None else f"{gpu_gb:g} GB GPU"
    total = int(gpu_gb * GB) if gpu_gb is not None else here.total_bytes  # type: ignore[union-attr]
    cap = capability if capability is not None else (here.capability if here is not None and gpu_gb is None else 8.9)
    card = Card(name, total, cap)
    plan = plan_memory(loaded, planned_stages(loaded), card, gpus or max(len(seen), 1))
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        _print_plan(plan)
    if not plan.fits:
        if not as_json:
            for problem in plan.problems:
                err_console.print(f"[red]✗[/red] {problem}", highlight=False)
        raise typer.Exit(2)


def _print_plan(plan: MemoryPlan) -> None:
    from rich.table import Table

    from rlcli.generation.memory_plan import GB, HEADROOM

    def gb(size: float) -> str:
        return f"{size / GB:.1f}"

    card = plan.card
    cap = f", compute capability {card.capability:g}" if card.capability else ""
    title = f"{plan.model} on {plan.gpus} x {card.name} ({gb(card.total_bytes)} GB{cap}): GB per stage and device"
    # A row per part, a column per stage and device: the parts outnumber the stages.
    parts = list(dict.fromkeys(part for stage in plan.stages for part in stage.parts))
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for stage in plan.stages:
        table.add_column(f"{stage.stage}\n{stage.device}", justify="right")
    for part in parts:
        table.add_row(part, *(gb(stage.parts[part]) if stage.parts.get(part) else "" for stage in plan.stages))
    table.add_section()
    table.add_row("peak", *(gb(stage.peak) for stage in plan.stages), style="bold")
    limit = card.total_bytes * HEADROOM
    table.add_row("fits", *("yes" if stage.peak <= limit else "[red]no[/red]" for stage in plan.stages))
    console.print(table, highlight=False)
    console.print(f"config: {plan.shape_source}", highlight=False)
    for reason in plan.choices.why:
        console.print(f"- {reason}", highlight=False, markup=False)


@app.command("explain")
def recipes_explain(
    name: Annotated[
        str | None,
        typer.Argument(help="A section (grpo) or a field (grpo.lr); default: every section.", show_default=False),
    ] = None,
    as_json: JsonOpt = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help=f"Print the whole schema as Markdown: {REGENERATE_DOCS}")
    ] = False,
) -> None:
    """Show recipe sections and fields: type, default and what each one does."""
    from rlcli.recipe import schema_docs

    if markdown and (as_json or name):
        raise UsageError("--markdown prints the whole schema on its own; leave out NAME and --json.")
    sections = schema_docs(name)
    if markdown:
        print(schema_markdown(), end="")
    elif as_json:
        print(json.dumps([dataclasses.asdict(section) for section in sections], indent=2))
    else:
        _print_sections(sections)


def _print_sections(sections: list[SectionDoc]) -> None:
    from rich.markup import escape
    from rich.table import Table

    for section in sections:
        title = escape(f"{section.name} ({section.type}): {section.description}")
        # A field's name is never split; its type, default and description share the rest of the width
        # (four columns left the description a sliver of a terminal's 80).
        table = Table(title=title, title_justify="left", show_lines=True)
        table.add_column("field", no_wrap=True)
        table.add_column("type · default, then what it does", overflow="fold")
        for field in section.fields:
            default = "required" if field.required else f"default {_default_text(field)}"
            table.add_row(field.path, f"{field.type} · {default}\n{_description(field)}")
        console.print(table, markup=False, highlight=False)


def schema_markdown() -> str:
    """docs/recipe.md: every section and field of the recipe schema."""
    from rlcli.recipe import ALIAS_REPEAT_LIMIT, NESTING_LIMIT, schema_docs

    lines = [
        "# Recipe reference",
        "",
        f"Generated from `src/rlcli/recipe.py` by `{REGENERATE_DOCS}`; a test fails when the two differ.",
        "In a terminal, `rlcli recipes explain [SECTION[.FIELD]]` shows the same (`--json` for tools).",
        "",
        "A field left out of a recipe takes its default. Any field can be overridden on the command line by its",
        "dotted path: `rlcli train grpo -r r.yaml grpo.lr=1e-5 lora=null`.",
        "",
        "A recipe is read as `yaml.safe_load` reads YAML, with three refusals, each an error naming the line: a key",
        "written twice in one mapping (a section written twice would otherwise lose its first half without a word;",
        f"a key merged in by `<<: *name` may still be overridden), aliases (`*name`) repeating more than {ALIAS_REPEAT_LIMIT:,}",
        f"values in all, and values nested more than {NESTING_LIMIT} levels deep. Override values and `rlcli envs try -k`",
        "values are read the same way.",
        "",
    ]
    for section in schema_docs():
        lines += [f"## `{section.name}` ({section.type})", "", section.description, ""]
        lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for field in section.fields:
            default = _default_text(field) if field.required else f"`{_default_text(field)}`"
            cells = [f"`{field.path}`", field.type, default, _description(field)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _default_text(field: FieldDoc) -> str:
    # JSON is also YAML, and it keeps "007" (text) apart from 7 (a number).
    return "required" if field.required else json.dumps(field.default)


def _description(field: FieldDoc) -> str:
    return f"{field.description} {RESUME_SAFE_NOTE}" if field.resume_safe else field.description
