"""OpenEnv apps for tests/envs/test_openenv.py, served by the openenv: adapter from this module (the
adapter's server has rlcli's Python path, where pytest put this folder).

- `trouble`: an echo env that holds one session per server (create_app's default), whose step
  sleeps on "sleep", kills its server on "die", ends the episode on "stop", and whose action
  refuses messages over 40 characters (a validation error).
- `counter`: an action with a required int beside its string, which a text reply cannot fill.
"""

from __future__ import annotations

import os
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    message: str = Field(max_length=40)


class EchoObservation(Observation):
    echoed: str = Field(default="")


class TroubleEnvironment(Environment):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        return EchoObservation(echoed=f"ready {seed}")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        message = getattr(action, "message", "")
        if message == "sleep":
            time.sleep(3)
        if message == "die":
            os._exit(3)
        return EchoObservation(echoed=message, done=message == "stop", reward=1.0)

    @property
    def state(self) -> State:
        return State()


trouble = create_app(TroubleEnvironment, EchoAction, EchoObservation)


class CountAction(Action):
    word: str
    count: int


counter = create_app(TroubleEnvironment, CountAction, EchoObservation)
