"""How many cores the run's torch threads use, and whether the machine has them free."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def busy_cores(window_s: float = 0.3) -> float:
    """How many cores other processes keep busy now: the machine's non-idle CPU time over a short
    window, during which this process sleeps. Unlike the load average it does not remember the
    last minute (the previous rlcli command, say). Where /proc/stat is missing: the load average."""

    def idle_and_total() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = idle_and_total()
        time.sleep(window_s)
        idle1, total1 = idle_and_total()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if total1 == total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def set_threads(threads: int | None, warn: Callable[[str], None]) -> None:
    """Give torch `threads` threads (None: leave its default, one per core); warn when other
    processes leave fewer idle cores than that.

    Torch's parallel regions wait for their slowest thread, so one thread whose core another process
    took slows every step down, far more than the share of the core it lost.
    """
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    used = threads or usable_cores()
    cores = usable_cores()
    busy = busy_cores()
    idle = max(cores - round(busy), 0)  # a third of a core is an occasional neighbour, not a taken core
    if idle < used:
        fewer = f"set run.threads to {max(idle, 1)} or " if used > max(idle, 1) else ""
        warn(
            f"warning: other processes keep {busy:.1f} of {cores} cores busy, leaving {idle} idle for this "
            f"run's {used} torch threads; each thread that loses its core slows every step down: {fewer}run "
            "when the machine is quieter."
        )
