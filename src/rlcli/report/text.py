"""Text from a run, as a terminal may show it: model replies, env observations, errors, and names
users chose (stages, label sets, reward components).

Light on purpose (no database, no tables): the CLI imports it as it starts.
"""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text

from rlcli.console import printable


def literal(value: Any, style: str = "") -> Text:
    """A cell, title or panel body: printable, and never read as Rich markup (a `[/x]` in a name
    would fail the whole view)."""
    return Text(printable(value), style=style)


def tool_call_note(message: dict[str, Any]) -> str | None:
    """The record of the call a tool message answers (tool_use.py puts it under `call`), as one line:
    search({"query": "Quellmar"}) · 0.012 s · cut 1,200 characters · error: ...; None for other messages."""
    record = message.get("call")
    if not isinstance(record, dict):
        return None
    arguments = json.dumps(record.get("arguments", {}), ensure_ascii=False)
    parts = [f"{message.get('name', '?')}({arguments})", f"{record.get('latency_s', 0.0):.3f} s"]
    if record.get("truncated_chars"):
        parts.append(f"cut {record['truncated_chars']:,} characters")
    if record.get("error"):
        parts.append(f"error: {record['error']}")
    return " · ".join(parts)
