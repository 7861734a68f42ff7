"""A verifiers environment (v1 API), shipped as the example for `env.name: verifiers:rlcli.envs.verifiers_guess`.

Guess a secret whole number from 1 to `high` (taskset config, default 16) in at most `max_guesses`
(default 5) replies; after each wrong guess the environment answers "higher" or "lower". It is
written the way a verifiers environment is written for any trainer: a Taskset whose load() yields
the tasks, a Task whose @vf.reward methods are the rubric (read off the conversation, so rlcli's
`verifiers` reward can re-score them), and an Env whose run() talks to its agent turn by turn.
Nothing in it knows about rlcli.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Guess the secret number. Reply with one whole number, nothing else."


class GuessConfig(vf.TasksetConfig):
    high: int = 16
    max_guesses: int = 5
    size: int = 200


class GuessData(vf.TaskData):
    secret: int
    high: int
    max_guesses: int


def guesses(trace: vf.Trace) -> list[int | None]:
    """The number each reply names (None for a reply without one)."""
    found = [re.search(r"-?\d+", message.content or "") for message in trace.assistant_messages]
    return [int(match.group()) if match else None for match in found]


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)  # type: ignore[untyped-decorator]  # verifiers' decorators are untyped
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        return float(task.secret in guesses(trace))

    @vf.reward(weight=0.2)  # type: ignore[untyped-decorator]
    async def numbers_only(self, trace: vf.Trace) -> float:
        """The share of replies that are a bare number, as the prompt asks."""
        replies = [(message.content or "").strip() for message in trace.assistant_messages]
        return sum(bool(re.fullmatch(r"-?\d+", reply)) for reply in replies) / max(1, len(replies))


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        data = task.data
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(data.max_guesses - 1):
                guess = guesses(interaction.trace)[-1]
                if segment.terminated or guess == data.secret:
                    break
                if guess is None:
                    feedback = "That is not a number. Reply with one whole number."
                else:
                    feedback = "Higher." if guess < data.secret else "Lower."
                segment = await interaction.turn(feedback)


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        rng = random.Random(0)
        for _ in range(self.config.size):
            yield GuessTask(
                GuessData(
                    prompt=f"I am thinking of a number from 1 to {self.config.high}. What is your guess?",
                    system_prompt=SYSTEM_PROMPT,
                    secret=rng.randint(1, self.config.high),
                    high=self.config.high,
                    max_guesses=self.config.max_guesses,
                ),
                self.config.task,
            )


__all__ = ["GuessEnv", "GuessTaskset"]
