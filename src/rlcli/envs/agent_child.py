"""Runs one episode of an agent program given as `agent:path/file.py:function` (or a module), in a process
of its own.

`python -m rlcli.envs.agent_child FILE-OR-MODULE FUNCTION` reads {"client": {base_url, api_key, model}, "task": {...}}
as one JSON object on stdin, calls FUNCTION(client, task) (awaiting it when it is a coroutine function),
and writes its return value as the last stdout line, {"result": value}: the protocol of `agent-cmd`
programs, so that both kinds of agent are run, timed and killed alike (envs/agents.py). Only the standard
library is imported here, so the agent's process holds what the agent imports and nothing of rlcli's.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    target, name = argv[0], argv[1]
    if target.endswith(".py"):
        path = Path(target)
        spec = importlib.util.spec_from_file_location(f"rlcli_agent_{path.stem}", path)
        if spec is None or spec.loader is None:
            print(f"{path} is not a Python file", file=sys.stderr)
            return 2
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        sys.path.insert(
            0, str(path.resolve().parent)
        )  # the agent's own modules beside it, as `python file.py` finds them
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    given = json.loads(sys.stdin.read())
    fn = getattr(module, name)
    result = fn(given["client"], given["task"])
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    sys.stdout.write("\n" + json.dumps({"result": result}) + "\n")
    return 0


async def _wait(awaitable: object) -> object:
    return await awaitable  # type: ignore[misc]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
