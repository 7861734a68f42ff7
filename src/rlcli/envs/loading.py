"""Loading an environment named by a recipe: a built-in, a file, a module, or an adapter URI."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rlcli.envs.protocol import Env, EnvFactory
from rlcli.envs.tool_use import ToolUseSpec, with_tools
from rlcli.errors import UsageError
from rlcli.usercode import import_file

# The top-level envs/ folder of the source tree, installed as this package (see pyproject.toml), so a
# wheel carries the built-ins and they are found the same way in an editable install.
BUILTIN_PACKAGE = "rlcli.builtin_envs"
ADAPTERS = {
    "textarena": "rlcli.envs.adapters.textarena",
    "reasoning_gym": "rlcli.envs.adapters.reasoning_gym",
    "gymnasium": "rlcli.envs.adapters.gymnasium",
    "openenv": "rlcli.envs.adapters.openenv",
    "verifiers": "rlcli.envs.adapters.verifiers",
    "miniwob": "rlcli.envs.adapters.miniwob",
}
# The pip extra that installs each adapter's library (pyproject.toml).
ADAPTER_EXTRAS = {"openenv": "openenv", "verifiers": "verifiers", "miniwob": "web"}


def list_builtin_envs() -> list[tuple[str, str]]:
    """(name, first line of its docstring) for every built-in env, read without importing it."""
    folder = importlib.resources.files(BUILTIN_PACKAGE)
    out = []
    for name in _builtin_names():
        doc = ast.get_docstring(ast.parse(folder.joinpath(f"{name}.py").read_text())) or ""
        out.append((name, doc.strip().splitlines()[0] if doc else ""))
    return out


def load_env(
    name: str, kwargs: dict[str, Any] | None = None, root: Path | None = None, tools: ToolUseSpec | None = None
) -> EnvFactory:
    """A factory making a fresh env per call, from a built-in name, a file, a module, or an adapter URI.
    Its envs answer the policy's tool calls (tool_use.py) when they have tools of their own or `tools`
    (the recipe's tool settings) names some."""
    return with_tools(_load_factory(name, dict(kwargs or {}), root), tools or ToolUseSpec())


def _load_factory(name: str, kwargs: dict[str, Any], root: Path | None) -> EnvFactory:
    if name.startswith("agent:") or name == "agent-cmd":
        raise UsageError(
            f"env {name!r} is an agent program, which only the stages that roll out the policy play (rollout, "
            "train grpo, eval); this command needs an env with reset and step."
        )
    scheme, sep, rest = name.partition(":")
    if sep and scheme in ADAPTERS:
        try:
            module = importlib.import_module(ADAPTERS[scheme])
        except ModuleNotFoundError as exc:
            extra = ADAPTER_EXTRAS.get(scheme, "envs")
            raise UsageError(
                f"env.name {name!r} needs the {exc.name!r} package: pip install 'rlcli[{extra}]'."
            ) from None
        # An adapter whose envs share something per process (a server, a loaded environment) makes its
        # factory itself, checking what it can at once (a recipe fails before any stage, not per episode).
        if hasattr(module, "make_factory"):
            return cast("EnvFactory", module.make_factory(rest, **kwargs))
        return lambda: module.make_env(rest, **kwargs)
    target, _, attr = name.partition(":")
    factory = _resolve_factory(target, attr or None, root or Path.cwd(), name)
    _check_kwargs(factory, kwargs, name)
    return lambda: _construct(factory, kwargs, name)


def _construct(factory: Callable[..., Env], kwargs: dict[str, Any], name: str) -> Env:
    """A fresh env; a ValueError from its constructor is the env refusing its env.kwargs (a maze
    `render: png`), which is bad input, not a crash."""
    try:
        return factory(**kwargs)
    except ValueError as exc:
        raise UsageError(f"env {name!r} refused env.kwargs {kwargs}: {exc}.") from None


def _builtin_names() -> list[str]:
    files = importlib.resources.files(BUILTIN_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".py") for f in files if f.name.endswith(".py") and not f.name.startswith("_"))


def _resolve_factory(target: str, attr: str | None, root: Path, name: str) -> Callable[..., Env]:
    if target.endswith(".py"):
        path = Path(target)
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise UsageError(f"env.name {name!r}: no file {path}.")
        module = import_file(path)
    elif "." not in target and target in _builtin_names():
        module = importlib.import_module(f"{BUILTIN_PACKAGE}.{target}")
    elif "." in target or attr:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"env.name {name!r}: cannot import {target} ({exc}).") from None
    else:
        builtins = ", ".join(_builtin_names())
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


def _check_kwargs(factory: Callable[..., Env], kwargs: dict[str, Any], name: str) -> None:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise UsageError(f"env.kwargs for {name!r} do not fit its factory: {exc}.") from None
    except ValueError:  # no signature available (builtins): let the call itself complain
        pass
