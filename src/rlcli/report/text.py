"""Text from a run, as a terminal may show it: model replies, env observations, errors, and names
users chose (stages, label sets, reward components).

Light on purpose (no database, no tables): the CLI imports it as it starts.
"""

from __future__ import annotations

import re
from typing import Any

from rich.text import Text

# C0 and C1 control characters but tab and newline: a terminal acts on them (ESC sequences retitle
# the window, clear the screen, plant links or write the clipboard), and a model's reply or an env's
# observation may hold any of them.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: Any) -> str:
    """The text with its control characters written out (ESC as \\x1b)."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def literal(value: Any, style: str = "") -> Text:
    """A cell, title or panel body: printable, and never read as Rich markup (a `[/x]` in a name
    would fail the whole view)."""
    return Text(printable(value), style=style)
