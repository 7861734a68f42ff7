"""Reading the tool calls in a model's reply, in the formats that chat templates teach.

- Qwen2.5, Qwen3, Hermes and most open templates: each call a JSON object inside
  `<tool_call>...</tool_call>`, several in a row for several calls.
- Llama 3.x: the reply is the JSON object itself, `{"name": ..., "parameters": {...}}` (after the
  `<|python_tag|>` special token, which decoding drops), several separated by `;` or new lines.
- Mistral: `[TOOL_CALLS]` (a special token, dropped) then a JSON list of calls.
- A tokenizer that declares its output format (transformers' `response_template`): read with it.

The arguments may be named `arguments` or `parameters`, and may be an object or a JSON string of one.
One parser reads all three, so that an env needs no setting per model family, and an expert's demo in
the `<tool_call>` form is read whatever the policy. A tagged block that does not hold a call is a
malformed call: the model is told what was wrong (it tried to call and failed), where bare JSON that is
not a call is just text (an answer may well contain braces).

Whatever the reply, reading it never raises: JSON nested past Python's recursion limit, a number too long
to convert, or arguments nested deeper than MAX_NESTING (a bound, so that what writes them next, the
database or a tool's transport, stays far from that limit) make a malformed call, or text. A reply that cannot be read is thus
the model's failure, scored like any other answer, never an env failure, which would drop the episode
from training and from eval's success rate.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", flags=re.S)
# Deepest nesting of lists and objects in a call's arguments; real calls nest a few levels.
MAX_NESTING = 100


@dataclass
class ToolCallParse:
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name": str, "arguments": dict}, in order
    malformed: list[str] = field(default_factory=list)  # one sentence per block that was meant as a call

    def __bool__(self) -> bool:
        return bool(self.calls or self.malformed)


def hermes_tool_call(name: str, arguments: Any) -> str:
    """A tool call as Hermes-style chat templates (Qwen's among them) write it, and as parse_tool_calls reads
    it whatever the policy: how experts call, and how the endpoint writes a call for a template that has no
    place for tool calls."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def parse_tool_calls(text: str, response_template: str | None = None, tools: list[dict] | None = None) -> ToolCallParse:
    """The calls in a reply: as the model's response template reads them where its tokenizer declares
    one (a JSON string; see _template_calls), else its `<tool_call>` blocks, else its bare JSON calls."""
    if response_template is not None:
        return _template_calls(text, response_template, tools)
    tagged = TAGGED.findall(text)
    if tagged:
        found = ToolCallParse()
        for raw in tagged:
            call, problem = _as_call(_json(raw.strip()))
            if call is not None:
                found.calls.append(call)
            else:
                found.malformed.append(f"malformed <tool_call> block {_shorten(raw.strip())}: {problem}")
        return found
    return ToolCallParse(calls=[call for value in _json_values(text) for call in _bare_calls(value)])


def _template_calls(text: str, response_template: str, tools: list[dict] | None) -> ToolCallParse:
    """The calls transformers' parse_response finds with the tokenizer's response template (a model's own
    description of its output format; transformers 5.19 and later read it). The reply alone is parsed
    (prefix ""): rollouts keep the sampled text, not the template's pre-written part of the turn."""
    from transformers.utils.chat_parsing import parse_response

    described: list[dict | Callable[..., Any]] = list(tools or [])  # typed as parse_response takes them
    try:
        message = parse_response(text, json.loads(response_template), prefix="", tools=described or None)
    except (ValueError, RecursionError) as exc:  # a region the template could not read: not JSON, too deep
        return ToolCallParse(malformed=[f"the reply does not read as the model's tool-call format: {_first_line(exc)}"])
    found = ToolCallParse()
    for item in message.get("tool_calls") or []:
        call, problem = _as_call(item.get("function", item) if isinstance(item, dict) else item)
        if call is not None:
            found.calls.append(call)
        else:
            found.malformed.append(f"malformed tool call {_shorten(_as_text(item))}: {problem}")
    return found


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        return ValueError(f"not JSON ({exc.msg} at character {exc.pos})")
    except RecursionError:
        return ValueError("not JSON that can be read (nested too deeply)")
    except ValueError as exc:  # an integer of more digits than Python converts
        return ValueError(f"not JSON that can be read ({_first_line(exc)})")


def _as_text(item: Any) -> str:
    try:
        return json.dumps(item, default=str)
    except (ValueError, RecursionError):  # a structure too deep (or circular) to write as JSON
        return reprlib.repr(item)


def _as_call(value: Any) -> tuple[dict[str, Any] | None, str]:
    """A call, or None and why not: expected {"name": "...", "arguments": {...}}."""
    expected = 'expected {"name": "<tool>", "arguments": {...}}'
    if isinstance(value, ValueError):
        return None, f"{value}; {expected}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None, f"no tool name; {expected}"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's form: the arguments as a JSON string
        arguments = _json(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None, f"the arguments are not a JSON object; {expected}"
    if _nested_deeper(arguments, MAX_NESTING):
        return None, f"the arguments nest deeper than {MAX_NESTING} levels; {expected}"
    return {"name": value["name"], "arguments": arguments}, ""


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels in value; without recursion, as value may
    nest nearly as deep as Python's recursion limit."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON object or list in the text, left to right."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while (start := _next_open(text, at)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except RecursionError:  # nested too deep to read: text, and so is every value inside it
            at = _end_of_nesting(text, start)
            continue
        except ValueError:  # not JSON (or a number too long to read): text
            at = start + 1
            continue
        values.append(value)
        at = end
    return values


def _end_of_nesting(text: str, start: int) -> int:
    """Where the brackets opened at start close (or the text's end), counting those outside JSON strings."""
    depth, in_string, escaped = 0, False, False
    for at in range(start, len(text)):
        char = text[at]
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                return at + 1
    return len(text)


def _next_open(text: str, at: int) -> int:
    positions = [p for p in (text.find("{", at), text.find("[", at)) if p >= 0]
    return min(positions) if positions else -1


def _bare_calls(value: Any) -> list[dict[str, Any]]:
    """A bare JSON value as calls: an object with a name and arguments/parameters, or a list of them;
    anything else is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not ({"arguments", "parameters"} & item.keys()):
            return []
        call, _ = _as_call(item)
        if call is None:
            return []
        calls.append(call)
    return calls


def _shorten(raw: str, limit: int = 60) -> str:
    return repr(raw if len(raw) <= limit else raw[:limit] + "...")
