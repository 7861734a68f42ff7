"""What the bubblewrap sandbox costs per python_exec call: env.code_sandbox none vs bwrap.

    .venv/bin/python bench/sandbox.py             # 40 calls per mode and program (~1 min)
    .venv/bin/python bench/sandbox.py --quick     # 8 calls per mode and program (~15 s)
    .venv/bin/python bench/sandbox.py --calls 100 --parallel 4

What is measured: the wall-clock of one `python_exec` call as an episode makes it (the tool's function,
`python_exec_tool(bwrap)`: a scratch folder, the supervisor, `python -I main.py`, the output read back,
the folder removed), with its code run with the limits alone (none) or in bubblewrap (bwrap), for two
programs: `print(1)` (the fixed cost) and `import numpy` (a typical model-written program's start).
Calls of the two modes alternate, so that a busy neighbour slows both alike; after one warm-up call
each, --calls timed calls per mode and program (--parallel at once, from as many threads, as
env.parallel_tools or episodes side by side make them; at most python_exec's 4 run at once). The table
gives the median and 90th percentile in ms per call and the median's difference, the overhead.

The calls use one core each and no torch; on a 2-core machine shared with other work the figures move
with the load average, printed first (run it alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PROGRAMS = {"print(1)": "print(1)", "import numpy": "import numpy\nprint(numpy.__version__)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per mode and program")
    parser.add_argument("--parallel", type=int, default=1, help="calls at once (threads)")
    parser.add_argument("--quick", action="store_true", help="8 calls per mode and program")
    args = parser.parse_args()
    calls = 8 if args.quick else args.calls

    from rlcli.envs.python_exec import python_exec_tool
    from rlcli.envs.sandbox import bwrap_problem

    problem = bwrap_problem()
    if problem is not None:
        sys.exit(f"bubblewrap cannot run here: {problem}")
    tools = {"none": python_exec_tool(bwrap=False), "bwrap": python_exec_tool(bwrap=True)}
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores; {calls} calls per cell, {args.parallel} at once")

    def timed(mode: str, code: str) -> float:
        start = time.perf_counter()
        out = tools[mode](code)
        elapsed = time.perf_counter() - start
        if "[" in out:  # a status line: the call failed, and its time means nothing
            raise SystemExit(f"{mode} call failed: {out}")
        return elapsed

    rows = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for name, code in PROGRAMS.items():
            for mode in tools:  # warm-up: the page cache, bubblewrap's probe
                timed(mode, code)
            seconds: dict[str, list[float]] = {mode: [] for mode in tools}
            for _ in range(0, calls, args.parallel):
                for mode in tools:  # alternating, so that the load weighs on both alike
                    batch = min(args.parallel, calls - len(seconds[mode]))
                    seconds[mode] += pool.map(lambda _, mode=mode: timed(mode, code), range(batch))
            median = {mode: statistics.median(s) * 1000 for mode, s in seconds.items()}
            p90 = {mode: statistics.quantiles(s, n=10)[-1] * 1000 for mode, s in seconds.items()}
            rows.append((name, median, p90))

    print()
    print("| program | none ms (median / p90) | bwrap ms (median / p90) | overhead ms | bwrap / none |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, median, p90 in rows:
        print(
            f"| `{name}` | {median['none']:.0f} / {p90['none']:.0f} | {median['bwrap']:.0f} / {p90['bwrap']:.0f} | "
            f"{median['bwrap'] - median['none']:+.0f} | {median['bwrap'] / median['none']:.2f}x |"
        )


if __name__ == "__main__":
    main()
