"""calculator: tool use - call a `calculator` tool for a hard product, read its result, then answer.

The calculator is a native tool (docs/tools.md): the env offers its `calculator` method, the chat template
shows its schema, and rlcli runs each call the model writes (`<tool_call>{"name": "calculator",
"arguments": {"expression": "1234 * 5678"}}</tool_call>` in the Qwen/Hermes form; Llama's bare JSON
is read too) and sends the result back as a `tool` message. The model then answers with
`<answer>NUMBER</answer>`. Reward 1.0 only when the answer is right AND the tool was used: the task is
to learn the tool, not to guess. For templates that ignore tools, the system prompt spells the call out.
"""

from __future__ import annotations

import json
import random

from rlcli.envs.parsing import parse_answer_tag, parse_last_number, safe_arithmetic


class Calculator:
    def __init__(self, digits: int = 4, max_calls: int = 3):
        self.digits, self.max_calls = digits, max_calls
        self.tools = [self.calculator]

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

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses.

        Args:
            expression: The expression to evaluate, e.g. 1234 * 5678
        """
        self.calls += 1
        if self.calls > self.max_calls:
            raise RuntimeError(f"too many calculator calls (at most {self.max_calls}); answer now")
        try:
            result = safe_arithmetic(expression)
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
            return json.dumps({"error": str(exc) or type(exc).__name__})
        self.last_result = result
        return json.dumps({"result": result})

    def step(self, action: str):
        """A reply without a tool call: the answer, or a reminder of how to give one."""
        answer = parse_answer_tag(action)
        if answer is None:
            reminder = "Call the calculator with a <tool_call> JSON, or answer with <answer>NUMBER</answer>."
            return reminder, 0.0, False, False, {}
        value = parse_last_number(answer)
        correct = value == self.answer and self.calls > 0
        if value == self.answer and not self.calls:
            feedback = "Right number, but the calculator was not used."
        else:
            feedback = "Correct." if correct else f"Wrong, the answer is {self.answer}."
        return feedback, float(correct), True, False, {"success": correct}

    def expert_action(self) -> str:
        if self.last_result is None:
            call = {"name": "calculator", "arguments": {"expression": f"{self.a} * {self.b}"}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return f"<answer>{self.last_result}</answer>"


def make_env(digits: int = 4, max_calls: int = 3) -> Calculator:
    return Calculator(digits, max_calls)
