"""Loading an environment named by a recipe: a built-in, a file, a module, or an adapter URI."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rlcli.envs.factories import (
    ADAPTERS,
    BUILTIN_PACKAGE,
    CODE_SANDBOX,
    asks_code_sandbox,
    builtin_names,
    resolve_factory,
)
from rlcli.envs.protocol import Env, EnvFactory
from rlcli.envs.tool_use import ToolUseSpec, with_tools
from rlcli.errors import UsageError

# The pip extra that installs each adapter's library (pyproject.toml).
ADAPTER_EXTRAS = {"openenv": "openenv", "verifiers": "verifiers", "miniwob": "web"}


def list_builtin_envs() -> list[tuple[str, str]]:
    """(name, first line of its docstring) for every built-in env, read without importing it."""
    folder = importlib.resources.files(BUILTIN_PACKAGE)
    out = []
    for name in builtin_names():
        doc = ast.get_docstring(ast.parse(folder.joinpath(f"{name}.py").read_text())) or ""
        out.append((name, doc.strip().splitlines()[0] if doc else ""))
    return out


def load_env(
    name: str, kwargs: dict[str, Any] | None = None, root: Path | None = None, tools: ToolUseSpec | None = None
) -> EnvFactory:
    """A factory making a fresh env per call, from a built-in name, a file, a module, or an adapter URI.
    Its envs answer the policy's tool calls (tool_use.py) when they have tools of their own or `tools`
    (the recipe's tool settings) names some. An env whose factory takes `code_sandbox` and is given
    `tools` gets their answer for code the model wrote (env.code_sandbox's), unless env.kwargs sets it."""
    spec = tools or ToolUseSpec()
    code_sandbox = None if tools is None else ("bwrap" if spec.tools.code_in_bwrap else "none")
    return with_tools(_load_factory(name, dict(kwargs or {}), root, code_sandbox), spec)


def _load_factory(name: str, kwargs: dict[str, Any], root: Path | None, code_sandbox: str | None) -> EnvFactory:
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
    factory = resolve_factory(target, attr or None, root or Path.cwd(), name)
    if code_sandbox is not None and asks_code_sandbox(factory):
        kwargs.setdefault(CODE_SANDBOX, code_sandbox)
    _check_kwargs(factory, kwargs, name)
    return lambda: _construct(factory, kwargs, name)


def _construct(factory: Callable[..., Env], kwargs: dict[str, Any], name: str) -> Env:
    """A fresh env; a ValueError from its constructor is the env refusing its env.kwargs (a maze
    `render: png`), which is bad input, not a crash."""
    try:
        return factory(**kwargs)
    except ValueError as exc:
        raise UsageError(f"env {name!r} refused env.kwargs {kwargs}: {exc}.") from None


def _check_kwargs(factory: Callable[..., Env], kwargs: dict[str, Any], name: str) -> None:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise UsageError(f"env.kwargs for {name!r} do not fit its factory: {exc}.") from None
    except ValueError:  # no signature available (builtins): let the call itself complain
        pass
