"""The console that progress, notes and errors go to: stderr, so that --json output on stdout stays
clean. One for the whole program, with how a number reads on it, and what any text printed to a
terminal is escaped with; it imports nothing from rlcli, so any module may print through it."""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderHook, RenderResult
from rich.segment import Segment

# C0 and C1 control characters but tab and newline, and Unicode's bidirectional controls. A terminal acts
# on the first (ESC sequences retitle the window, clear the screen, plant links or write the clipboard);
# the second reorder what follows them on the line (after U+202E, "report_gpj.exe" reads "report_exe.jpg").
# A model's reply, an env's observation, a file's path or a name a user chose may hold any of them.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: Any) -> str:
    """The text with its control characters written out (ESC as \\x1b, U+202E as \\u202e)."""
    return CONTROL.sub(_written_out, str(value))


def _written_out(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class _Printable:
    """A renderable whose text is printable(): rich's own styles and cursor moves are segments of their
    own (styles, control codes), so they pass untouched."""

    def __init__(self, renderable: ConsoleRenderable) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.renderable, options):
            yield segment if segment.control else Segment(printable(segment.text), segment.style)


class _PrintableOutput(RenderHook):
    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        return [_Printable(renderable) for renderable in renderables]


def terminal_console(**options: Any) -> Console:
    """A rich Console (with these options) that prints everything through printable(): the one boundary
    where text reaches the terminal, whichever command, table or note it comes from."""
    console = Console(**options)
    console.push_render_hook(_PrintableOutput())
    return console


# A pipe or a file has no width, and rich then assumes 80 columns, folding a wide table into several
# lines a row (`rlcli runs show RUN > report.txt`). Piped, rlcli prints 160 columns wide, which keeps
# its tables one line a row; a terminal keeps its own width, and COLUMNS overrides both.
PIPED_WIDTH = 160


def width_for(stream: TextIO) -> int | None:
    """The width to print to stream at: None (rich's own choice) for a terminal or with COLUMNS set."""
    if os.environ.get("COLUMNS") or stream.isatty():
        return None
    return PIPED_WIDTH


# highlight=False: rich would colour the numbers and paths inside messages at random.
err_console = terminal_console(stderr=True, soft_wrap=True, highlight=False, width=width_for(sys.stderr))


def number(value: float, digits: int = 4) -> str:
    """A number a person reads: from 10**(digits-1) up, whole with thousands separators (1,570 tok/s,
    not 1.57e+03); below, `digits` significant digits (0.1235, 12.5, 3e-05)."""
    if math.isfinite(value) and abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"
