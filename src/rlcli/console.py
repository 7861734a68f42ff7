"""The console that progress, notes and errors go to: stderr, so that --json output on stdout stays
clean. One for the whole program, with how a number reads on it; it imports nothing from rlcli, so any
module may print through it."""

from __future__ import annotations

import math
import os
import sys
from typing import TextIO

from rich.console import Console

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
err_console = Console(stderr=True, soft_wrap=True, highlight=False, width=width_for(sys.stderr))


def number(value: float, digits: int = 4) -> str:
    """A number a person reads: from 10**(digits-1) up, whole with thousands separators (1,570 tok/s,
    not 1.57e+03); below, `digits` significant digits (0.1235, 12.5, 3e-05)."""
    if math.isfinite(value) and abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"
