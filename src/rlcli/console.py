"""The console that progress, notes and errors go to: stderr, so that --json output on stdout stays
clean. One for the whole program, with how a number reads on it, and what any text printed to a
terminal is escaped with; it imports nothing from rlcli, so any module may print through it."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderHook, RenderResult
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
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
    own (styles, control codes), so they pass untouched. Printed to a pipe or a file, its lines end at
    their last character: rich pads a table's every line to the console's width with spaces."""

    def __init__(self, renderable: ConsoleRenderable) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        segments = console.render(self.renderable, options)
        if not console.is_terminal:
            segments = _without_trailing_blanks(segments)
        for segment in segments:
            yield segment if segment.control else Segment(printable(segment.text), segment.style)


def _without_trailing_blanks(segments: Iterable[Segment]) -> Iterator[Segment]:
    """The segments with the blanks before each line break left out; a last line without one is kept
    as it is (text printed with end="" may go on)."""
    line: list[Segment] = []
    for segment in segments:
        if segment.control or "\n" not in segment.text:
            line.append(segment)
            continue
        *ended, rest = segment.text.split("\n")
        for text in ended:
            line.append(Segment(text, segment.style))
            yield from _rstripped(line)
            yield Segment("\n", segment.style)
            line = []
        line.append(Segment(rest, segment.style))
    yield from line


def _rstripped(line: list[Segment]) -> list[Segment]:
    while line and not line[-1].control and not line[-1].text.rstrip(" "):
        line.pop()
    if line and not line[-1].control:
        line[-1] = Segment(line[-1].text.rstrip(" "), line[-1].style)
    return line


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


class RunProgress:
    """The overall progress of a command that runs a run's stages (`rlcli run`, `train grpo`). At a
    terminal: one bar at the foot of stderr, under the bars of the stage at work, with the stage, the
    step within it (GRPO's iteration) and an estimate of the time it has left. Anywhere else (a pipe, a
    log file), where a bar would print only once it ended: a plain line as each stage begins and as
    each step ends."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.title = ""
        self.stages: list[str] = []
        self.index = 0  # the stage at work
        self.depth = 0  # running() blocks open: train grpo's inside rlcli run's shows through the outer one
        self.bar: Progress | None = None  # at a terminal, while running
        self.task: TaskID | None = None
        self.pace: tuple[float, int] | None = None  # (clock, steps done) at the stage's first count here

    @contextlib.contextmanager
    def running(self, title: str, stages: list[str]) -> Iterator[None]:
        """Show the progress of `stages`, in their order, until the block ends; the first is at work."""
        self.depth += 1
        try:
            if self.depth > 1:
                yield
                return
            self.title, self.stages = title, stages
            if self.console.is_terminal:
                self.bar = Progress(
                    # markup=False: the run's name is the user's (mine[red])
                    TextColumn("{task.description}", style="bold", markup=False),
                    BarColumn(),
                    TextColumn("{task.fields[step]}", markup=False),
                    TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                    # The results printed on stdout meanwhile stay there (paused() makes room for them).
                    redirect_stdout=False,
                )
                self.task = self.bar.add_task("", total=len(stages), step="")
                self.bar.start()
            self.stage(0)
            try:
                yield
            finally:
                if self.bar is not None:
                    self.bar.stop()
                self.bar = self.task = None
        finally:
            self.depth -= 1

    def stage(self, index: int) -> None:
        """stages[index] begins."""
        self.index, self.pace = index, None
        name, count = self.stages[index], len(self.stages)
        where = f" (stage {index + 1}/{count})" if count > 1 else ""
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, description=f"{self.title}: {name}{where}", completed=index, step="")
        elif count > 1:
            self.console.print(f"progress: stage {index + 1}/{count}, {name}", highlight=False, markup=False)

    def steps(self, done: int, total: int, unit: str) -> None:
        """`done` of the stage's `total` steps are done (its first count here: where it starts or resumes).
        The time left is estimated from the pace of the steps done in this process."""
        now = time.monotonic()
        if self.pace is None:
            self.pace = (now, done)
        started, done_before = self.pace
        step = f"{unit} {done}/{total}"
        if done_before < done < total:
            step += f", about {duration((now - started) / (done - done_before) * (total - done))} left"
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=self.index + done / max(total, 1), step=step)
        elif done > done_before:
            self.console.print(f"progress: {self.stages[self.index]}, {step}", highlight=False, markup=False)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The bar off the terminal for the block: what it prints on stdout (a stage's result table)
        goes where the bar was, not through it."""
        if self.bar is None:
            yield
            return
        self.bar.stop()
        try:
            yield
        finally:
            self.bar.start()


def duration(seconds: float) -> str:
    """A rough span of time a person reads: 40 s, 3 min, 1 h 20 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"
