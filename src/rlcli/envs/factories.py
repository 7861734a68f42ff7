"""Finding an env's factory from the name a recipe gives it (a built-in, a file, a module), and what the
factory asks of the recipe (loading.py loads it; tool_use.py asks whether it runs code)."""

from __future__ import annotations

import importlib
import importlib.resources
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import cast

from rlcli.envs.protocol import Env
from rlcli.errors import UsageError
from rlcli.usercode import import_file

# The top-level envs/ folder of the source tree, installed as this package (see pyproject.toml), so a
# wheel carries the built-ins and they are found the same way in an editable install.
BUILTIN_PACKAGE = "rlcli.builtin_envs"
# The factory parameter of an env that runs code the model wrote (repair_tests' tests): rlcli passes it
# env.code_sandbox's answer, bwrap or none, as it runs python_exec (docs/environments.md).
CODE_SANDBOX = "code_sandbox"
ADAPTERS = {
    "textarena": "rlcli.envs.adapters.textarena",
    "reasoning_gym": "rlcli.envs.adapters.reasoning_gym",
    "gymnasium": "rlcli.envs.adapters.gymnasium",
    "openenv": "rlcli.envs.adapters.openenv",
    "verifiers": "rlcli.envs.adapters.verifiers",
    "miniwob": "rlcli.envs.adapters.miniwob",
}


def builtin_names() -> list[str]:
    files = importlib.resources.files(BUILTIN_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".py") for f in files if f.name.endswith(".py") and not f.name.startswith("_"))


def resolve_factory(target: str, attr: str | None, root: Path, name: str) -> Callable[..., Env]:
    if target.endswith(".py"):
        path = Path(target)
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise UsageError(f"env.name {name!r}: no file {path}.")
        module = import_file(path)
    elif "." not in target and target in builtin_names():
        module = importlib.import_module(f"{BUILTIN_PACKAGE}.{target}")
    elif "." in target or attr:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"env.name {name!r}: cannot import {target} ({exc}).") from None
    else:
        builtins = ", ".join(builtin_names())
        raise UsageError(
            f"Unknown env {name!r}: expected a built-in ({builtins}), a file envs/x.py[:Factory], "
            "package.module:factory, or a textarena:/reasoning_gym:/gymnasium:/openenv:/verifiers:/miniwob: URI."
        )
    if attr:
        if not hasattr(module, attr):
            raise UsageError(f"env.name {name!r}: {module.__name__} has no {attr!r}.")
        return getattr(module, attr)
    if hasattr(module, "make_env"):
        return module.make_env
    classes = [
        c
        for c in vars(module).values()
        if inspect.isclass(c) and c.__module__ == module.__name__ and hasattr(c, "reset") and hasattr(c, "step")
    ]
    if len(classes) == 1:
        return cast("Callable[..., Env]", classes[0])  # a class with reset and step: an env per call
    raise UsageError(f"env.name {name!r}: define make_env(**kwargs) or name the factory as {name}:Factory.")


def takes_code_sandbox(name: str, root: Path | None = None) -> bool:
    """Whether the env `name` (a built-in, file or module; adapters and agents never do) has a factory
    taking `code_sandbox`. A name that does not load says no here: loading it says why."""
    if ":" in name and name.partition(":")[0] in ("agent", *ADAPTERS) or name == "agent-cmd":
        return False
    target, _, attr = name.partition(":")
    try:
        return asks_code_sandbox(resolve_factory(target, attr or None, root or Path.cwd(), name))
    except UsageError:
        return False


def asks_code_sandbox(factory: Callable[..., Env]) -> bool:
    try:
        return CODE_SANDBOX in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature available (builtins)
        return False
