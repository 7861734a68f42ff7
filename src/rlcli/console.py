"""The console that progress, notes and errors go to: stderr, so that --json output on stdout stays
clean. One for the whole program; it imports nothing from rlcli, so any module may print through it."""

from __future__ import annotations

from rich.console import Console

# highlight=False: rich would colour the numbers and paths inside messages at random.
err_console = Console(stderr=True, soft_wrap=True, highlight=False)
