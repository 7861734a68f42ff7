"""Help text in click's conventions, where Typer's rich help departs from them.

Typer's rich help (typer 0.2x: `TyperOption.display_type_rich`, `TyperArgument._usage_display_name`)
shows a value type after every option, flags included (`--force <bool>`, `--help <bool>`), though a
flag takes no value; and it writes a required argument in braces in the usage line
(`rlcli runs show [OPTIONS] {run}`), which reads as a set of choices. Click writes `--force` and
`RUN`. Both methods are replaced here once, for every command, the generated `--help` included,
which no per-option metavar could reach. If a Typer release renames them, help falls back to
Typer's own rendering (tests/unit/test_cli.py then fails on `<bool>` or `{`).

A help text is written as a docstring, its paragraphs folded to fit the source. Rich help keeps a
paragraph's line breaks (every paragraph in a group's list of commands, every paragraph but the
first in a command's own help), so that `rlcli recipes --help` broke lines mid-sentence. Each command
and group gets its help with every paragraph on one line, for the terminal to wrap, but the
"Examples:" paragraph, whose lines are commands, one a line.
"""

from __future__ import annotations

import inspect
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

# The paragraph of a command's help that lists example command lines, kept a line each.
EXAMPLES = "Examples:"


def unfolded(text: str | None) -> str | None:
    """Help text with each paragraph on one line, but the Examples paragraph, a line each, flush left:
    Typer dedents a paragraph's lines after its first, but only where it begins the text it renders."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        "\n".join(line.strip() for line in p.split("\n")) if p.startswith(EXAMPLES) else " ".join(p.split("\n"))
        for p in paragraphs
    )


def _install() -> None:
    option_type = getattr(TyperOption, "display_type_rich", None)
    if option_type is not None and not getattr(option_type, "_rlcli", False):

        def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
            if self.is_flag or self.count:
                return None  # a flag takes no value: nothing to show after it
            return option_type(self, ctx)

        display_type_rich._rlcli = True  # type: ignore[attr-defined]
        setattr(TyperOption, "display_type_rich", display_type_rich)  # noqa: B010

    if hasattr(TyperArgument, "_usage_display_name") and hasattr(TyperArgument, "display_name_raw"):

        def usage_display_name(self: TyperArgument) -> str:
            name = self.metavar if self.metavar is not None else (self.name or "").upper()
            if not self.required:
                name = f"[{name}]"
            return name + ("..." if self.nargs != 1 else "")

        setattr(TyperArgument, "_usage_display_name", usage_display_name)  # noqa: B010

    for command_class in (TyperCommand, TyperGroup):
        init = command_class.__init__
        if getattr(init, "_rlcli", False):
            continue

        def unfolding_init(self: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, *args, **{**kwargs, "help": unfolded(kwargs.get("help"))})

        unfolding_init._rlcli = True  # type: ignore[attr-defined]
        setattr(command_class, "__init__", unfolding_init)  # noqa: B010


_install()
