"""Subprocesses that die with the rlcli process that started them, even when it is killed -9.

A server an env or a tool talks to (an MCP server, an OpenEnv environment server) must not outlive
rlcli: a kill -9 runs no clean-up, and the server would live on, re-parented to init. On Linux,
`die_with_parent(argv)` makes the command ask the kernel, before it becomes the server, to SIGKILL it
when its parent dies (PR_SET_PDEATHSIG). The kernel means the *thread* that started it: start the
process from a thread that lives as long as it should (the main thread, an event loop's, or one that
waits on the process). Elsewhere argv is returned as it is, and the caller's own clean-up is all there is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# Run as `python -I -S -c DIE_WITH_PARENT PARENT_PID ARGV...` on Linux: ask the kernel to SIGKILL this
# process when the thread that started it ends (PR_SET_PDEATHSIG = 1; the request survives exec), give
# up if that parent is already gone, then become the server.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """argv, run so that on Linux the kernel kills it when the thread starting it (this process's) ends."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]
