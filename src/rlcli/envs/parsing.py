"""Reading actions out of model replies: answer tags, numbers, tool calls, and safe arithmetic.

Environment files import these (`from rlcli.envs.parsing import parse_last_number`); the built-in
rewards read numbers with the same parser, so an env and a reward never disagree on a reply.
"""

from __future__ import annotations

import ast
import re

from rlcli.envs.tool_calls import parse_tool_calls

# Thousands separators are allowed ("1,234"), and so is ".5". A minus sign right after a digit is a
# dash, not a sign: "3-5" is 3 and 5 (a range or a difference ends with 5), while "-5" alone is -5.
NUMBER = re.compile(r"(?<![\d.])-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")


def find_numbers(text: str) -> list[str]:
    """Every number in the text as written, without thousands separators: "3-5 or -1,234.5" -> 3, 5, -1234.5."""
    return [number.replace(",", "") for number in NUMBER.findall(text)]


def parse_last_number(text: str) -> float | int | None:
    """The last number in the text, an int when it is whole ("5.0" -> 5); None when there is none."""
    numbers = find_numbers(text)
    if not numbers:
        return None
    value = float(numbers[-1])
    return int(value) if value.is_integer() else value


def parse_answer_tag(text: str) -> str | None:
    """The stripped content of the last <answer>...</answer> block; None when there is none."""
    found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return found[-1].strip() if found else None


def parse_tool_call(text: str) -> dict | None:
    """The first tool call {"name": ..., "arguments": {...}} in a reply, in any format tool_calls.py
    reads (<tool_call> tags, bare JSON); None when there is none. rlcli itself answers calls for envs
    with native tools (docs/tools.md); this is for an env that reads a call itself."""
    found = parse_tool_calls(text)
    return found.calls[0] if found.calls else None


def safe_arithmetic(expression: str) -> float | int:
    """Evaluate + - * / // % ** and parentheses on numbers, nothing else (no eval of model text)."""
    ops = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
        ast.FloorDiv: lambda a, b: a // b,
        ast.Mod: lambda a, b: a % b,
        ast.Pow: lambda a, b: a**b,
    }

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
