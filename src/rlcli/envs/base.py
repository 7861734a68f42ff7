"""The environment protocol, action parsing helpers, loading envs from recipes, task splits.

An environment is any object with
    reset(seed) -> (observation, info)
    step(action_text) -> (observation, reward, terminated, truncated, info)
in the spirit of gymnasium. An observation is chat content: a string (one user message) or a
list of message dicts ({"role": "system" | "user" | "tool", "content": ...}). `info["task"]`
from reset carries the task fields that reward functions read; `info["success"]` from step is
the episode's verdict. Optional: `tools` (function specs for the chat template),
`expert_action()` (a scripted action that solves the task, for demonstrations).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlcli.errors import UsageError

BUILTIN_DIR = Path(__file__).resolve().parents[3] / "envs"
ADAPTERS = {
    "textarena": "rlcli.envs.adapters.textarena",
    "reasoning_gym": "rlcli.envs.adapters.reasoning_gym",
    "gymnasium": "rlcli.envs.adapters.gymnasium",
}


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int) -> tuple[Any, dict]: ...

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]: ...


class EnvFailure(Exception):
    """An environment raised, returned garbage, or took too long; the episode fails, the stage goes on."""


def as_messages(observation: Any) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation):
        return [dict(m) for m in observation]
    raise EnvFailure(f"observation must be a string or a list of chat messages, got {type(observation).__name__}")


def call_with_timeout(fn: Callable, timeout_s: float, *args: Any) -> Any:
    """Run an env call in a worker thread; a raise or a time-out becomes EnvFailure."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # the env's own failure, reported as the episode's error
            result["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise EnvFailure(f"{getattr(fn, '__name__', 'env call')} exceeded the {timeout_s:g}s step time limit")
    if "error" in result:
        exc = result["error"]
        raise EnvFailure(f"{type(exc).__name__}: {exc}")
    return result["value"]


# --- parsing actions ---------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_answer_tag(text: str) -> str | None:
    found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return found[-1].strip() if found else None


def parse_last_number(text: str) -> float | int | None:
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = float(found[-1])
    return int(value) if value.is_integer() else value


def parse_tool_call(text: str) -> dict | None:
    """A JSON tool call {"name": ..., "arguments": {...}}, inside <tool_call> tags or bare."""
    tagged = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S)
    candidates = tagged or re.findall(r"\{.*\}", text, flags=re.S)
    for raw in candidates:
        try:
            call = json.loads(raw.strip())
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            return {"name": call["name"], "arguments": args if isinstance(args, dict) else {}}
    return None


def safe_arithmetic(expression: str) -> float | int:
    """Evaluate + - * / // % ** and parentheses on numbers, nothing else (no eval of model text)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b}

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return ops[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return walk(ast.parse(expression.strip(), mode="eval"))


# --- splits ----------------------------------------------------------------------------


def task_seed(split: str, index: int, eval_seed_start: int = 1_000_000) -> int:
    """Train tasks use seeds [0, eval_seed_start), eval tasks [eval_seed_start, ...): disjoint by construction."""
    if split == "train":
        if index >= eval_seed_start:
            raise UsageError(f"Train task {index} would reach the eval seeds (env.eval_seed_start={eval_seed_start}).")
        return index
    if split == "eval":
        return eval_seed_start + index
    raise UsageError(f"Unknown task split {split!r}: expected train or eval.")


# --- loading ----------------------------------------------------------------------------


def list_builtin_envs() -> list[tuple[str, str]]:
    out = []
    for path in sorted(BUILTIN_DIR.glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out.append((path.stem, doc.strip().splitlines()[0] if doc else ""))
    return out


def load_env(name: str, kwargs: dict[str, Any] | None = None, root: Path | None = None) -> Callable[[], Any]:
    """A factory making a fresh env per call, from a built-in name, a file, a module, or an adapter URI."""
    kwargs = dict(kwargs or {})
    scheme, sep, rest = name.partition(":")
    if sep and scheme in ADAPTERS:
        try:
            module = importlib.import_module(ADAPTERS[scheme])
        except ModuleNotFoundError as exc:
            raise UsageError(f"env.name {name!r} needs the {exc.name!r} package: pip install 'rlcli[envs]'.") from None
        factory = lambda: module.make_env(rest, **kwargs)  # noqa: E731
    else:
        target, _, attr = name.partition(":")
        factory_fn = _resolve_factory(target, attr or None, root or Path.cwd(), name)
        _check_kwargs(factory_fn, kwargs, name)
        factory = lambda: factory_fn(**kwargs)  # noqa: E731
    return factory


def _resolve_factory(target: str, attr: str | None, root: Path, name: str) -> Callable[..., Any]:
    if target.endswith(".py"):
        path = Path(target)
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise UsageError(f"env.name {name!r}: no file {path}.")
        module = _import_file(path)
    elif "." not in target and (BUILTIN_DIR / f"{target}.py").is_file():
        module = _import_file(BUILTIN_DIR / f"{target}.py")
    elif "." in target or attr:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"env.name {name!r}: cannot import {target} ({exc}).") from None
    else:
        builtins = ", ".join(n for n, _ in list_builtin_envs())
        raise UsageError(
            f"Unknown env {name!r}: expected a built-in ({builtins}), a file envs/x.py[:Factory], "
            "package.module:factory, or textarena:/reasoning_gym:/gymnasium: URI."
        )
    if attr:
        if not hasattr(module, attr):
            raise UsageError(f"env.name {name!r}: {module.__name__} has no {attr!r}.")
        return getattr(module, attr)
    if hasattr(module, "make_env"):
        return module.make_env
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and c.__module__ == module.__name__ and hasattr(c, "reset") and hasattr(c, "step")]
    if len(classes) == 1:
        return classes[0]
    raise UsageError(f"env.name {name!r}: define make_env(**kwargs) or name the factory as {name}:Factory.")


def _import_file(path: Path) -> Any:
    module_name = f"rlcli_env_{path.stem}_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise UsageError(f"{path} failed to import: {type(exc).__name__}: {exc}") from None
    return module


def _check_kwargs(factory: Callable[..., Any], kwargs: dict[str, Any], name: str) -> None:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise UsageError(f"env.kwargs for {name!r} do not fit its factory: {exc}.") from None
    except ValueError:  # no signature available (builtins): let the call itself complain
        pass
