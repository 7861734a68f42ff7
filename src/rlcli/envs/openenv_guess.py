"""guess_number as an OpenEnv environment server: the example behind recipes/openenv_guess.yaml.

An OpenEnv env package ships a FastAPI app made by `create_app(Environment, Action, Observation)`
(its `server/app.py`, named `app` in its openenv.yaml); this module is one, small enough to read,
which works offline with `openenv-core` alone (pip install 'rlcli[openenv]'). rlcli serves it with
`env.name: openenv:rlcli.envs.openenv_guess` (docs/environments.md, "OpenEnv"), or serve it yourself
and point rlcli at its URL:

    python -m uvicorn rlcli.envs.openenv_guess:app --port 8000
    rlcli envs try openenv:http://127.0.0.1:8000 --policy human

The game is rlcli's built-in guess_number: find a hidden whole number in [low, high] (reset
arguments, default 1-16) in at most `max_guesses` guesses (default 4) from "Higher."/"Lower."
feedback. The action is one string, the reply; the observation's one string field, `prompt`, is what
the agent reads; `success` says whether the number was found, which is how rlcli learns the verdict
(OpenEnv's servers do not send an observation's metadata). Reward 1 for the right guess, else 0.
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """The agent's reply, e.g. "My guess: 8"; its last whole number is the guess."""

    message: str = Field(..., description="The reply; its last whole number is the guess.")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="What the agent reads: the rules, then feedback.")
    success: bool = Field(default=False, description="The number was found.")
    guesses_left: int = Field(default=0, description="Guesses left in this episode.")


class GuessNumberEnvironment(Environment):
    """One episode per session; every session has its own instance, so sessions run side by side."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.low, self.high, self.target, self.left = 1, 16, 1, 0

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        low: int = 1,
        high: int = 16,
        max_guesses: int = 4,
        **kwargs: Any,
    ) -> GuessObservation:
        if low >= high or max_guesses < 1:
            raise ValueError(f"expected low < high and max_guesses >= 1, got {low}, {high}, {max_guesses}")
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.low, self.high, self.left = low, high, max_guesses
        self.target = random.Random(seed).randint(low, high)
        prompt = (
            f"I picked a whole number from {low} to {high}. Guess it in at most {max_guesses} guesses. "
            "Reply with exactly: My guess: <number>. I will answer higher or lower."
        )
        return GuessObservation(prompt=prompt, guesses_left=self.left, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        if not numbers:
            self.left -= 1
            return self._answer("Invalid reply. Answer exactly: My guess: <number>.")
        guess = int(numbers[-1])
        self.left -= 1
        if guess == self.target:
            return GuessObservation(prompt=f"Correct! It was {self.target}.", success=True, done=True, reward=1.0)
        return self._answer("Higher." if guess < self.target else "Lower.")

    def _answer(self, feedback: str) -> GuessObservation:
        if self.left <= 0:
            text = f"{feedback} No guesses left: it was {self.target}."
            return GuessObservation(prompt=text, done=True, reward=0.0)
        text = f"{feedback} Guess again ({self.left} left)."
        return GuessObservation(prompt=text, guesses_left=self.left, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessNumberEnvironment,
    GuessAction,
    GuessObservation,
    env_name="rlcli_guess_number",
    max_concurrent_envs=256,  # a session per live episode: a rollout chunk's episodes play side by side
)
