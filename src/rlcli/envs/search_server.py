"""An MCP server (stdio) with the `search` and `open` tools of the multihop_search env, over its corpus.

    python -m rlcli.envs.search_server --corpus-seed 0 --corpus-size 300

A recipe offers them with `env.mcp_servers: [{command: [python, -m, rlcli.envs.search_server]}]` and
`env.kwargs: {python_tools: false}` (the same corpus_seed and corpus_size in both places). The tools
served are the env's own bound methods, with the JSON schema that rlcli builds for Python tools
(transformers' get_json_schema), so a model sees the same tool specs and gets the same results
through MCP as through Python tools.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.tools import Tool
from transformers.utils import get_json_schema

from rlcli.envs.factories import BUILTIN_PACKAGE


def mcp_tool(fn: Callable[..., str]) -> Tool:
    """The MCP tool that calls `fn`: named, described and specified as get_json_schema reads them."""
    spec = get_json_schema(fn)["function"]
    # MCP would take the whole docstring (Args included) as the description, and a pydantic schema
    # of the signature (no argument descriptions) as the parameters: both are replaced.
    tool = Tool.from_function(fn, name=spec["name"], description=spec["description"], structured_output=False)
    return tool.model_copy(update={"parameters": spec["parameters"]})


def build_server(corpus_seed: int | None = None, corpus_size: int | None = None) -> MCPServer[Any]:
    """The server for the corpus of multihop_search with these kwargs (None: the env's default)."""
    # The env itself, not load_env's: that one wraps an env with tools in ToolUse, whose `tools` are specs.
    module = importlib.import_module(f"{BUILTIN_PACKAGE}.multihop_search")
    kwargs = {"corpus_seed": corpus_seed, "corpus_size": corpus_size}
    env = module.make_env(**{k: v for k, v in kwargs.items() if v is not None})
    return MCPServer("rlcli-search", tools=[mcp_tool(fn) for fn in env.tools])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlcli.envs.search_server",
        description="The multihop_search env's tools as an MCP server (stdio).",
    )
    parser.add_argument("--corpus-seed", type=int, help="the env's corpus_seed (default: the env's default)")
    parser.add_argument("--corpus-size", type=int, help="the env's corpus_size (default: the env's default)")
    args = parser.parse_args(argv)
    try:
        server = build_server(args.corpus_seed, args.corpus_size)
    except ValueError as exc:  # a corpus the env refuses, such as --corpus-size 3
        parser.error(str(exc))
    server.run("stdio")


if __name__ == "__main__":
    main()
