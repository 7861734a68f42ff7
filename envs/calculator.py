"""calculator: tool use - call a `calculator` tool for a hard product, read its result, then answer.

The agent calls the tool with a JSON tool call, `<tool_call>{"name": "calculator", "arguments":
{"expression": "1234 * 5678"}}</tool_call>`, and gets the result back as a `tool` message; then it
answers with `<answer>NUMBER</answer>`. Reward 1.0 only when the answer is right AND the tool
was used: the task is to learn the tool, not to guess. The tool spec is offered through the chat
template (`tools`) and, for templates that ignore tools, spelled out in the system prompt too.
"""

from __future__ import annotations

import json
import random

from rlcli.envs.parsing import parse_answer_tag, parse_last_number, parse_tool_call, safe_arithmetic

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 1234 * 5678"}},
            "required": ["expression"],
        },
    },
}


class Calculator:
    tools = [TOOL]

    def __init__(self, digits: int = 4, max_calls: int = 3):
        self.digits, self.max_calls = digits, max_calls

    def reset(self, seed: int):
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        self.a, self.b = rng.randint(lo, hi), rng.randint(lo, hi)
        self.answer = self.a * self.b
        self.calls, self.last_result = 0, None
        system = (
            "You can use a calculator tool. To call it, reply with exactly: "
            '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call> '
            "You will get the result. Then give the final answer as <answer>NUMBER</answer>."
        )
        question = f"What is {self.a} * {self.b}?"
        return [{"role": "system", "content": system}, {"role": "user", "content": question}], {
            "task": {"question": question, "answer": self.answer}
        }

    def step(self, action: str):
        answer = parse_answer_tag(action)
        if answer is not None:
            value = parse_last_number(answer)
            correct = value == self.answer and self.calls > 0
            if value == self.answer and not self.calls:
                feedback = "Right number, but the calculator was not used."
            else:
                feedback = "Correct." if correct else f"Wrong, the answer is {self.answer}."
            return feedback, float(correct), True, False, {"success": correct, "tool_calls": self.calls}
        call = parse_tool_call(action)
        if call is None or call["name"] != "calculator":
            return (
                "Call the calculator with a <tool_call> JSON, or answer with <answer>NUMBER</answer>.",
                0.0,
                False,
                False,
                {"tool_calls": self.calls},
            )
        self.calls += 1
        if self.calls > self.max_calls:
            return "Too many calculator calls.", 0.0, False, True, {"success": False, "tool_calls": self.calls}
        try:
            result = safe_arithmetic(str(call["arguments"].get("expression", "")))
            content = json.dumps({"result": result})
            self.last_result = result
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
            content = json.dumps({"error": str(exc) or type(exc).__name__})
        return (
            [{"role": "tool", "name": "calculator", "content": content}],
            0.0,
            False,
            False,
            {"tool_calls": self.calls},
        )

    def expert_action(self) -> str:
        if self.last_result is None:
            call = {"name": "calculator", "arguments": {"expression": f"{self.a} * {self.b}"}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return f"<answer>{self.last_result}</answer>"


def make_env(digits: int = 4, max_calls: int = 3) -> Calculator:
    return Calculator(digits, max_calls)
