"""Playing episodes: live episodes advance one turn per batched sampling call (EpisodeRunner), through
the turn loop that engine/games.py's GameRunner shares (play_in_passes, EnvRounds, and engine/turns.py's
TurnPlayer, which also keeps each turn's tokens exact).

Failures are settled within the stage, so that a stage run once and a stage resumed store the
same episodes: an episode whose env was lost with a worker killed during another episode's call is
played again from its start, in the same chunk, with the same seeds (play_in_passes); one whose
own call timed out is played again env.timeout_retries times, then stored as env_timeout. A stored
episode is final: running its stage again plays only the episodes it has not stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from rlcli.engine.turns import Action, EpisodeSpec, LiveEpisode, RolloutLimits, TurnPlayer
from rlcli.envs.workers import EnvHost, EnvReply
from rlcli.generation.sampler import Sampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LINGER = 0.1  # share of the last round's time (its sampling calls, mostly) spent waiting for more envs to answer

#
# EpisodeRunner (below) plays single-agent episodes, GameRunner (engine/games.py) the seats of two-player
# games. Both run an env per episode or game through the same three pieces: `play_in_passes` plays a
# chunk again until no failure that need not recur is left, `EnvRounds` resets the envs of one pass and
# hands back, round by round, the ones whose env has answered, and `TurnPlayer` turns one episode's
# replies into its conversation, its prompts and its recorded turns. What differs stays in the
# runners: which episodes a reply is for, and which sampler plays whose turn.

_Played = TypeVar("_Played", bound="Replayable")


class Replayable(Protocol):
    """What `play_in_passes` plays: an episode, or a game (its seats' episodes)."""

    def again(self: _Played) -> _Played: ...


def play_in_passes(
    chunk: list[_Played],
    play: Callable[[list[_Played]], None],
    episodes: Callable[[_Played], list[LiveEpisode]],
    timeout_retries: int,
) -> list[_Played]:
    """Play a chunk (each item at an env of its own, its `episodes` the ones it plays) to its end, in
    order. An item one of whose episodes lost its env with a worker killed during another episode's call
    is played again from its start, on a fresh worker, as is one that timed out while
    env.timeout_retries allows; its seeds make it sample what the lost attempt would have, so the chunk
    ends as if nothing had been lost. A pass loses envs when one of its episodes' calls times out or
    crashes, and that episode ends (or is retried a bounded number of times), so the passes end; a
    worker that dies between calls loses envs with no episode to blame, so a pass whose every item was
    lost stores them as failed rather than playing them again for ever."""
    items = list(chunk)
    todo = list(range(len(items)))
    while todo:
        play([items[i] for i in todo])
        if all(any(ep.env_lost for ep in episodes(items[i])) for i in todo):
            break
        todo = [i for i in todo if any(ep.plays_again(timeout_retries) for ep in episodes(items[i]))]
        for i in todo:
            items[i] = items[i].again()
    return items


class EnvRounds:
    """The envs of one pass, an env per episode or game, named by its index in the pass.

    `rounds` yields, round after round, the envs whose reply made them ready for a turn; in between,
    the runner samples their turns and sends each its `step` (or `expert_step`), or `release`s it.
    Making the pass resets the envs: with workers, they reset while the runner starts its sampler.
    """

    def __init__(self, envs: EnvHost, seeds: list[int]) -> None:
        self.envs = envs
        self.index_of = {envs.reset(seed): i for i, seed in enumerate(seeds)}
        self.key_of = {i: key for key, i in self.index_of.items()}
        self.in_env = len(seeds)  # calls sent and not answered yet
        self.round_s = 0.0  # how long the runner took over the last round: its sampling calls, mostly

    def rounds(self, answer: Callable[[int, EnvReply], bool]) -> Iterator[list[int]]:
        """Until every call has been answered: take each reply in with `answer(index, reply)`, which
        says whether that env's play is over (it is then released), and yield the others, in index
        order."""
        while self.in_env:
            replies = self._gather(self.in_env, LINGER * self.round_s)
            self.in_env -= len(replies)
            ready = []
            for reply in replies:
                index = self.index_of[reply.key]
                if answer(index, reply):
                    self.envs.release(reply.key)
                else:
                    ready.append(index)
            if ready:
                start = time.perf_counter()
                yield sorted(ready)
                self.round_s = time.perf_counter() - start

    def step(self, index: int, action: str) -> None:
        self.envs.step(self.key_of[index], action)
        self.in_env += 1

    def expert_step(self, index: int) -> None:
        """The expert acts inside the env's host, right before its step."""
        self.envs.expert_step(self.key_of[index])
        self.in_env += 1

    def release(self, index: int) -> None:
        """An env whose play ended during the runner's turn (the context budget)."""
        self.envs.release(self.key_of[index])

    def _gather(self, waiting: int, linger_s: float) -> list[EnvReply]:
        """Replies to some of the `waiting` calls: wait for a first one, then up to linger_s for more,
        so that envs answering together share the next sampling call instead of splitting it."""
        replies = self.envs.replies()
        until = time.perf_counter() + linger_s
        while len(replies) < waiting and (left := until - time.perf_counter()) > 0:
            more = self.envs.replies(left)
            if not more:
                break
            replies += more
        return replies


class EpisodeRunner:
    """Plays a chunk of episodes to the end with one policy (a model's sampler, or the env's expert).

    The envs live in `envs` (see envs/workers.py): in this process, or in worker processes that
    answer as they finish. Each sampling call takes the episodes whose env has answered since the
    last one, so with workers a slow env holds up only its own episode (continuous batching of
    turns); in this process every env answers at once and every live episode shares each call.
    An episode's tokens depend on its seeds and prompts only (the Sampler contract), so which
    episodes share a call changes nothing in what is sampled.
    """

    def __init__(
        self,
        envs: EnvHost,
        limits: RolloutLimits,
        sampler: Sampler | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.envs = envs
        self.limits = limits
        self.sampler = sampler
        self.turns = TurnPlayer(limits, tokenizer, expert=sampler is None)

    def run(self, specs: list[EpisodeSpec], on_turns: Callable[[int], None] | None = None) -> list[LiveEpisode]:
        """Play these episodes to their end, in order, each played again as `play_in_passes` says."""
        episodes = [LiveEpisode(spec) for spec in specs]
        return play_in_passes(
            episodes, lambda todo: self._play(todo, on_turns), lambda ep: [ep], self.limits.timeout_retries
        )

    def _play(self, episodes: list[LiveEpisode], on_turns: Callable[[int], None] | None) -> None:
        """One pass: every episode from its reset to its end, the sampler started afresh for them
        (episode k in its row k)."""
        envs = EnvRounds(self.envs, [ep.spec.env_seed for ep in episodes])
        if self.sampler is not None:
            self.sampler.start([ep.spec.sample_seed for ep in episodes])
        acted: dict[int, Action] = {}  # episode -> the action its env is stepping on

        def answer(i: int, reply: EnvReply) -> bool:
            if reply.op == "reset":
                self.turns.begin(episodes[i], reply)
            else:
                self.turns.record(episodes[i], acted.pop(i, None), reply)
            return episodes[i].done

        for ready in envs.rounds(answer):
            if self.sampler is None:  # the expert acts inside the env's host, right before its step
                for i in ready:
                    envs.expert_step(i)
                continue
            actions = self.turns.act([episodes[i] for i in ready], ready, self.sampler)
            for i, action in zip(ready, actions):
                if episodes[i].done:  # ended while building its prompt (context budget)
                    envs.release(i)
                    continue
                acted[i] = action
                envs.step(i, action.text)
            if on_turns:
                on_turns(sum(len(a.ids) for a in actions))
