"""guess_number: find a hidden integer in a range from "higher"/"lower" feedback (multi-turn).

The agent answers "My guess: K" (a bare number at the end is accepted too). Reward 1.0 on the
right guess, which ends the episode; the rollout's env.max_turns (or the max_turns kwarg) caps it.
The expert (`demonstrator="bisect"`) plays binary search, so it always succeeds within
ceil(log2(high - low + 1)) turns. `demonstrator="random"` guesses uniformly among the numbers the
feedback still allows: demonstrations that teach the rules and the format but not the efficient
strategy, which leaves reinforcement learning something to discover (the quickstart uses it).
"""

from __future__ import annotations

import random
import re

from rlcli.env import parse_last_number


class GuessNumber:
    DEMONSTRATORS = ("bisect", "random")

    def __init__(self, low: int = 1, high: int = 32, max_turns: int | None = None, demonstrator: str = "bisect"):
        if low >= high:
            raise ValueError(f"low ({low}) must be below high ({high})")
        if demonstrator not in self.DEMONSTRATORS:
            raise ValueError(f"demonstrator must be one of {', '.join(self.DEMONSTRATORS)}, got {demonstrator!r}")
        self.low, self.high, self.max_turns, self.demonstrator = low, high, max_turns, demonstrator

    def reset(self, seed: int):
        rng = random.Random(seed)
        self.target = rng.randint(self.low, self.high)
        self.demo_rng = random.Random(rng.random())  # the random demonstrator's choices, fixed by the seed
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
        if self.demonstrator == "random":
            return f"My guess: {self.demo_rng.randint(self.lo, self.hi)}"
        return f"My guess: {(self.lo + self.hi) // 2}"


def make_env(low: int = 1, high: int = 32, max_turns: int | None = None, demonstrator: str = "bisect") -> GuessNumber:
    return GuessNumber(low, high, max_turns, demonstrator)
