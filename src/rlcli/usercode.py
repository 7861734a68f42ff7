"""Importing the user's own Python files: environments (envs/x.py) and reward functions (rewards.py:fn).

A recipe that names a file runs that file's code, like running a script.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from rlcli.errors import UsageError


def import_file(path: Path) -> ModuleType:
    """The module defined by a .py file, imported once per process, as `import` would.

    Any failure is a UsageError naming the file: it does not exist, or running it raised.
    """
    if not path.is_file():
        raise UsageError(f"file {path} does not exist.")
    # Named after the full path, so two rewards.py files in different folders do not replace each other.
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"rlcli_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # not a name Python imports (the callers pass .py files)
        raise UsageError(f"file {path} is not a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"loading {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def code_files(env_name: str, reward_fns: list[str]) -> list[str]:
    """The .py files a recipe names (env.name as path.py[:name] or agent:path.py:name, and reward fns as
    path.py[:name]), as it names them."""
    env_file = env_name.removeprefix("agent:").rpartition(":")[0] if env_name.startswith("agent:") else env_name
    targets = [env_file.partition(":")[0]] + [fn.rpartition(":")[0] for fn in reward_fns if ":" in fn]
    return sorted({t for t in targets if t.endswith(".py")})


def code_hashes(env_name: str, reward_fns: list[str], base: Path) -> dict[str, str]:
    """SHA-256 of each code file a recipe names, found from `base` as loading finds them; missing files are left out."""
    paths = {name: base / name for name in code_files(env_name, reward_fns)}
    return {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in paths.items() if path.is_file()}
