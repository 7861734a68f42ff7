"""Native tool calls: an env whose policy calls tools, and rlcli runs them.

`ToolUse` wraps an env. Its tools are the env's own callables (`tools = [self.search, ...]`: functions
or bound methods with type hints and a docstring), the recipe's `env.tools` (Python functions, the
built-in `python_exec`) and the tools of the recipe's `env.mcp_servers`. A reply that calls tools (see
tool_calls.py) is answered by rlcli: each call runs, in order or side by side (`env.parallel_tools`),
and each result goes back as a `tool` message, which the chat template renders, token-exact as every
observation is; the env's `step` is not called and the turn's reward is 0. A reply without calls goes
to the env's `step` as before, so an env only judges answers.

Each tool message carries its call's record under `call` (arguments, error, latency, characters cut),
which chat templates ignore and `runs episodes`, the HTML page and the export show. A malformed call
gets an error message the model can read; `env.malformed_tool_calls: end` ends the episode instead.

Where it runs: beside the env, in the main process (env.workers 0) or in each env worker, which starts
its own MCP servers once (tools.toolbox_for) and stops them when it ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlcli.envs.factories import takes_code_sandbox
from rlcli.envs.protocol import Env, EnvFactory
from rlcli.envs.sandbox import use_bwrap
from rlcli.envs.subprocesses import hide_environment
from rlcli.envs.tool_calls import parse_tool_calls
from rlcli.envs.tools import (
    McpServerSpec,
    ToolBox,
    ToolCall,
    ToolResult,
    ToolsSpec,
    check_tools,
    refuse_clashing_names,
    toolbox_for,
)
from rlcli.errors import UsageError

if TYPE_CHECKING:
    from rlcli.recipe import EnvSection


@dataclass(frozen=True)
class ToolUseSpec:
    """The recipe's tool settings, as env workers receive them."""

    tools: ToolsSpec = ToolsSpec()
    parallel: bool = False  # env.parallel_tools: a turn's calls side by side
    malformed: Literal["continue", "end"] = "continue"  # env.malformed_tool_calls
    # The policy's response template as JSON, where its tokenizer declares one (transformers'
    # `response_template`, read by parse_response): its calls are read that way instead.
    response_template: str | None = None


def tool_use_spec(env_cfg: EnvSection, root: str | Path, tokenizer: object = None) -> ToolUseSpec:
    """The recipe's tool settings; root: where relative paths (file.py tools, a server's cwd) resolve;
    tokenizer: the policy's, whose response template (if it declares one) reads its calls."""
    servers = tuple(
        McpServerSpec(tuple(server.command), tuple(sorted(server.env.items())), server.cwd)
        for server in env_cfg.mcp_servers
    )
    # Made a yes or no here, in the main process before any stage: bwrap that cannot run is refused, auto
    # says once which it took, and workers get the answer. Code the model wrote runs in python_exec, or in
    # an env that takes code_sandbox (a coding env's tests).
    runs_code = "python_exec" in env_cfg.tools or takes_code_sandbox(env_cfg.name, Path(root))
    code_in_bwrap = runs_code and use_bwrap(env_cfg.code_sandbox, "env.code_sandbox")
    servers_in_bwrap = bool(servers) and use_bwrap(env_cfg.sandbox, "env.sandbox")
    tools = ToolsSpec(
        tuple(env_cfg.tools),
        servers,
        str(root),
        env_cfg.tool_time_limit(),
        env_cfg.tool_result_chars,
        code_in_bwrap,
        servers_in_bwrap,
    )
    if "python_exec" in tools.functions:
        hide_environment()  # model-written code (here, or in an env worker below) cannot read its API keys
    template = getattr(tokenizer, "response_template", None)
    declared = json.dumps(template) if isinstance(template, dict) else None
    return ToolUseSpec(tools, env_cfg.parallel_tools, env_cfg.malformed_tool_calls, declared)


def callable_tools(env: object) -> list[Callable[..., Any]]:
    """The env's own tools that rlcli runs: the callables in its `tools` (dict specs it handles itself)."""
    return [tool for tool in getattr(env, "tools", None) or [] if callable(tool)]


def declared_tools(env: object) -> dict[str, str]:
    """The tools the env declares as dict specs and answers itself in `step`: name -> where it comes from."""
    named = {}
    for tool in getattr(env, "tools", None) or []:
        described = tool.get("function", tool) if isinstance(tool, dict) else None
        name = described.get("name") if isinstance(described, dict) else None
        if isinstance(name, str):
            named[name] = f"the env's declared tool spec {name!r}"
    return named


def check_tool_names(spec: ToolUseSpec, factory: EnvFactory) -> None:
    """Preflight, before any stage, for a recipe with tools: start, list and stop them (a UsageError for a
    bad one), and make one env, so that a name given twice (by the env's own tools or declared specs,
    env.tools with its built-ins, the MCP servers) is refused before the run is written, rather than one
    tool silently answering the other's calls, or every episode failing."""
    try:
        made = factory()
    except UsageError:
        raise
    except Exception as exc:  # it would fail every episode of the stage all the same
        raise UsageError(
            f"The env could not be made to list its tools ({type(exc).__name__}: {exc}); "
            "expected an env that starts, since the recipe gives it tools."
        ) from None
    env = made.env if isinstance(made, ToolUse) else made  # wrapped when it has tools of its own
    own = ToolBox(ToolsSpec(), callable_tools(env))
    refuse_clashing_names(declared_tools(env), own.sources(), check_tools(spec.tools))


def with_tools(factory: EnvFactory, spec: ToolUseSpec) -> EnvFactory:
    """The factory's envs, wrapped in ToolUse when there are tools for rlcli to run; others unchanged."""
    recipe_tools = bool(spec.tools.functions or spec.tools.mcp_servers)

    def make() -> Env:
        env = factory()
        return ToolUse(env, spec) if recipe_tools or callable_tools(env) else env

    return make


class ToolUse:
    """An env with native tool calls (see the module docstring)."""

    def __init__(self, env: Env, spec: ToolUseSpec) -> None:
        self.env, self.spec = env, spec
        self.shared = toolbox_for(spec.tools) if spec.tools.functions or spec.tools.mcp_servers else None
        # The env's own tools hold its state (the episode's corpus, say): a box of their own, per env.
        own = callable_tools(env)
        self.own = ToolBox(ToolsSpec(timeout_s=spec.tools.timeout_s, max_result_chars=spec.tools.max_result_chars), own)
        # Preflight refuses these before any stage (check_tool_names); here for envs made without it.
        refuse_clashing_names(declared_tools(env), self.own.sources(), self.shared.sources() if self.shared else {})
        declared = [tool for tool in getattr(env, "tools", None) or [] if isinstance(tool, dict)]
        specs = [*declared, *self.own.specs(), *(self.shared.specs() if self.shared else [])]
        self.tools: list[dict] | None = specs or None  # what the chat template shows

    def reset(self, seed: int) -> tuple[Any, dict]:
        return self.env.reset(seed)

    def expert_action(self) -> str:
        return self.env.expert_action()  # type: ignore[attr-defined]  # an env without one fails its episode, as unwrapped

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]:
        found = parse_tool_calls(action, self.spec.response_template, self.tools)
        if not found:
            return self.env.step(action)
        calls = [ToolCall(call["name"], call["arguments"]) for call in found.calls]
        if self.spec.parallel and len(calls) > 1:
            with ThreadPoolExecutor(len(calls)) as pool:
                results = list(pool.map(self._call, calls))
        else:
            results = [self._call(call) for call in calls]
        messages = [_tool_message(result) for result in results]
        messages += [{"role": "tool", "content": f"Error: {problem}"} for problem in found.malformed]
        end = bool(found.malformed) and self.spec.malformed == "end"
        return messages, 0.0, end, False, {"tool_calls": len(calls), "malformed_tool_calls": len(found.malformed)}

    def _call(self, call: ToolCall) -> ToolResult:
        if call.name in self.own.names() or self.shared is None:
            return self.own.call(call)
        return self.shared.call(call)


CALL_RECORD = "call"  # a tool message's record of its call: arguments, error, latency, cut characters


def _tool_message(result: ToolResult) -> dict[str, Any]:
    record = {k: v for k, v in asdict(result).items() if k not in ("name", "content")}
    return {"role": "tool", "name": result.name, "content": result.content, CALL_RECORD: record}


def without_call_records(messages: list[Any]) -> list[Any]:
    """Messages as the model sees them: a tool message's call record (which holds the call's latency)
    left out, so that two equal answers compare equal."""
    return [{k: v for k, v in m.items() if k != CALL_RECORD} if isinstance(m, dict) else m for m in messages]
