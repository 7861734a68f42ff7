"""guess_number: find a hidden integer in a range from "higher"/"lower" feedback (multi-turn).

The agent answers "My guess: K" (a bare number at the end is accepted too). Reward 1.0 on the
right guess, which ends the episode; the rollout's env.max_turns (or the max_turns kwarg) caps it.
The expert plays binary search, so it always succeeds within ceil(log2(high - low + 1)) turns.
"""

from __future__ import annotations

import random
import re

from rlcli.envs.parsing import parse_last_number


class GuessNumber:
    def __init__(self, low: int = 1, high: int = 32, max_turns: int | None = None):
        if low >= high:
            raise ValueError(f"low ({low}) must be below high ({high})")
        self.low, self.high, self.max_turns = low, high, max_turns

    def reset(self, seed: int):
        self.target = random.Random(seed).randint(self.low, self.high)
        self.lo, self.hi, self.turns = self.low, self.high, 0
        system = (
            f"You are playing a guessing game. I picked a whole number from {self.low} to {self.high}. "
            "Each turn, guess it. Reply with exactly: My guess: <number>. I will answer higher or lower."
        )
        user = f"Guess the number ({self.low}-{self.high})."
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], {
            "task": {"target": self.target, "low": self.low, "high": self.high}
        }

    def step(self, action: str):
        self.turns += 1
        truncated = self.max_turns is not None and self.turns >= self.max_turns
        match = re.search(r"guess\s*:?\s*(-?\d+)", action, flags=re.I)
        guess = int(match.group(1)) if match else parse_last_number(action)
        if not isinstance(guess, int):
            return "Invalid reply. Answer exactly: My guess: <number>.", 0.0, False, truncated, {"valid": False}
        if guess == self.target:
            return f"Correct! It was {self.target}.", 1.0, True, False, {"valid": True, "success": True}
        if guess < self.target:
            self.lo = max(self.lo, guess + 1)
            feedback = "Higher."
        else:
            self.hi = min(self.hi, guess - 1)
            feedback = "Lower."
        info = {"valid": True}
        if truncated:
            info["success"] = False
        return f"{feedback} Guess again.", 0.0, False, truncated, info

    def expert_action(self) -> str:
        return f"My guess: {(self.lo + self.hi) // 2}"


def make_env(low: int = 1, high: int = 32, max_turns: int | None = None) -> GuessNumber:
    return GuessNumber(low, high, max_turns)
