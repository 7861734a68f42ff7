"""arithmetic: one question, one numeric answer, reward 1.0 when it is right (single-turn, verifiable).

"What is 17 + 25? Answer with just the number." Difficulty by kwargs: `digits` per operand and
`ops` (any of "+-*"). The task fields `question` and `answer` are there for reward functions.
"""

from __future__ import annotations

import random

from rlcli.envs.parsing import parse_last_number


class Arithmetic:
    def __init__(self, digits: int = 2, ops: str = "+"):
        if digits < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError("digits must be >= 1 and ops a non-empty string of + - *")
        self.digits, self.ops = digits, ops

    def reset(self, seed: int):
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        self.answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        self.question = f"What is {a} {op} {b}? Answer with just the number."
        return self.question, {"task": {"question": self.question, "answer": self.answer}}

    def step(self, action: str):
        correct = parse_last_number(action) == self.answer
        feedback = "Correct." if correct else f"Wrong, the answer is {self.answer}."
        return feedback, float(correct), True, False, {"success": correct}

    def expert_action(self) -> str:
        return str(self.answer)


def make_env(digits: int = 2, ops: str = "+") -> Arithmetic:
    return Arithmetic(digits, ops)
