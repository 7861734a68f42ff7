"""The multihop_search task as an agent an OpenAI-SDK user would write: a loop over chat completions with
two function tools, `search` and `open`, run against rlcli's endpoint by `recipes/multihop_search_agent.yaml`.

The env form (envs/multihop_search.py) and this agent pose the same questions with the same system
prompt, and the policy sees the same text: its tool calls come back to it as the `<tool_call>` blocks
it wrote (the endpoint writes them so for a chat template, such as SmolLM2's, that has no place for
tool calls) and each result as a `tool` message. What differs is who runs the loop: here the agent
does, with the `openai` package, as it would against any OpenAI-compatible server.

The agent takes the question and the encyclopedia from the env's generator (the task's seed picks the
question), and returns {"reward": 1.0 or 0.0, "success": ...}; the recipe's `tool_budget` reward counts
its `tool` messages as it counts the env's.
"""

from __future__ import annotations

import inspect
import json

from openai import OpenAI
from rlcli.builtin_envs.multihop_search import REMINDER, MultihopSearch, normalise

from rlcli.envs.parsing import parse_answer_tag

# The env form's tools as rlcli describes them from its methods' docstrings (envs/tools.py), so that a
# template that writes tools into the prompt writes the same text for both forms.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": 'Search the encyclopedia: the 3 best matching documents, one per line as "id: title: first sentence".',
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "Words to look for, such as a name."}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Open a document of the encyclopedia: its id, title and full text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "doc_id": {"type": "string", "description": "The document's id as search lists it, such as d0042."}
                },
                "required": ["doc_id"],
            },
        },
    },
]


def solve(client: dict, task: dict) -> dict:
    """One episode: at most task["max_calls"] chat completions (the env form's env.max_turns)."""
    world = MultihopSearch(task.get("corpus_seed", 0), task.get("corpus_size", 300), task.get("hops", 3))
    messages, info = world.reset(task["seed"])
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    for _ in range(task.get("max_calls", 4)):
        reply = api.chat.completions.create(model=client["model"], messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": _run(world, call.function)})
            continue
        answer = parse_answer_tag(message.content or "")
        if answer is not None:
            correct = normalise(answer) == normalise(info["task"]["answer"])
            return {"reward": float(correct), "success": correct}
        messages.append({"role": "user", "content": REMINDER})
    return {"reward": 0.0, "success": False}


def _run(world: MultihopSearch, function) -> str:
    """A call's result; a call the tools cannot take is told so in the words of the env form's tool runner
    (envs/tools.py), so that both forms show the model the same text."""
    tools = {"search": world.search, "open": world.open}
    tool = tools.get(function.name)
    if tool is None:
        return f"Unknown tool {function.name!r}: the tools are {', '.join(tools)}."
    arguments = json.loads(function.arguments)  # the endpoint sends the arguments it read, as JSON
    if not isinstance(arguments, dict):
        return f"Arguments for {function.name} must be a JSON object, got {type(arguments).__name__}."
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as exc:
        return f"Bad arguments for {function.name}: {exc}."
    try:
        return str(tool(**arguments))
    except Exception as exc:
        return f"{function.name} raised {type(exc).__name__}: {exc}"
