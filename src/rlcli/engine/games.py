"""Two-player games where a model plays the other seat (env.opponent self, pool, base, sft or an id).

The env (the TextArena adapter with `opponent: caller`) serves whichever seat is to move; this module
plays both seats of many games at once. Each seat is an episode of its own: its conversation holds
what that seat was shown and what it replied, its turns record the seat that acted (info `player`),
and its return is its zero-sum score. Every live game whose seat to move is the policy's shares one
batched sampling call, and every game whose seat to move is the opponent model's shares another, so
self-play does not serialise the games.

Which seats train: with `self` both (one game is two episodes of the group, sample indices 2g and
2g + 1, split into their seat's group for advantages); with any other model, the policy's seat only
(the seed's parity, as for opponents inside the env). The opponent model's moves reach the policy as
part of its observation: context, never trained on, and the opponent's episode is not stored.

A seat's turn is recorded when the env answers *for that seat*: at its next turn (what happened
since is its feedback) or when the game ends (its last observation and score). A game whose seat
ends early (env.max_turns, the context budget, a reply cut by the token cap) ends for both seats.

Opponents: `resolve_opponent` turns env.opponent (or an eval opponent) into an Opponent. `pool` draws
one of the run's earlier GRPO checkpoints per iteration, uniformly (pool:K: among the last K), from a
seed of the run, the stage and its checkpoints, so a resumed iteration draws the same one; before the
first checkpoint the iteration plays `self` and a run event says so. Opponent models sample on the
HF sampler (the vLLM engine holds the policy's weights only).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rlcli.engine.episode_runner import EnvRounds, play_in_passes
from rlcli.engine.turns import Action, EpisodeSpec, LiveEpisode, RolloutLimits, TurnPlayer
from rlcli.envs.protocol import as_messages
from rlcli.envs.workers import EnvHost, EnvReply
from rlcli.errors import UsageError
from rlcli.generation.sampler import sampling_config
from rlcli.generation.seeds import derive_seed
from rlcli.store.checkpoints import checkpoint_run, checkpoints, resolve_checkpoint, train_checkpoints
from rlcli.store.events import add_event
from rlcli.store.names import PolicyRef
from rlcli.store.records import EndReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.engine.context import RunContext
    from rlcli.generation.sampler import Sampler, SamplingConfig
    from rlcli.store.records import Checkpoint

POOL_EVENT = "pool_empty"  # a run event: pool had no checkpoint to draw, the iteration played self
INSIDE_ENV = ("random", "bot")


@dataclass
class Opponent:
    """Who plays the seat the policy does not: `name` is what each episode's task records (random,
    bot, self, base or ckpt-<id>); `sampler` a model's (the policy's own for self), None inside the env."""

    name: str
    sampler: Sampler | None = None

    @property
    def by_model(self) -> bool:
        return self.sampler is not None

    @property
    def self_play(self) -> bool:
        return self.name == "self"


def seat_specs(game: EpisodeSpec, run_seed: int, stage: str, self_play: bool) -> tuple[EpisodeSpec, EpisodeSpec]:
    """Seat 0's and seat 1's episode of game `game` (its sample_index g): with self-play both are the
    policy's, sample indices 2g and 2g + 1; else the policy's seat (the seed's parity) keeps the game's
    spec, and the opponent's gets sample index -1 and a seed of its own."""
    t, g = game.task_index, game.sample_index
    if self_play:
        specs = [
            replace(game, sample_index=2 * g + s, sample_seed=derive_seed(run_seed, stage, t, 2 * g + s))
            for s in (0, 1)
        ]
        return specs[0], specs[1]
    opponent = replace(game, sample_index=-1, sample_seed=derive_seed(run_seed, stage, "opponent", t, g))
    return (game, opponent) if policy_seat(game) == 0 else (opponent, game)


def policy_seat(game: EpisodeSpec) -> int:
    return game.env_seed % 2


def stored_keys(game: EpisodeSpec, self_play: bool) -> list[tuple[int, int]]:
    """The (task_index, sample_index) keys a game stores."""
    if self_play:
        return [(game.task_index, 2 * game.sample_index + s) for s in (0, 1)]
    return [(game.task_index, game.sample_index)]


@dataclass
class Game:
    """A game being played: its two seats' episodes, whose turn it is, and the replies awaiting the env."""

    spec: EpisodeSpec
    seats: list[LiveEpisode]
    trained: tuple[bool, bool]  # which seats the policy plays
    to_move: int = -1
    pending: dict[int, Action] = field(default_factory=dict)  # seat -> its reply the env has not answered for it
    over: bool = False

    def again(self) -> Game:
        return Game(self.spec, [ep.again() for ep in self.seats], self.trained)


class GameRunner:
    """Plays chunks of two-player games, both seats sampled (see the module docstring), through the turn
    loop EpisodeRunner uses (engine/episode_runner.py): a game is played at one env, its seats' episodes
    take their turns as a single-agent episode does, and a reply goes to the seat it is for."""

    def __init__(
        self,
        envs: EnvHost,
        limits: RolloutLimits,
        sampler: Sampler | None,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        opponent: Opponent,
        run_seed: int,
        stage: str,
    ) -> None:
        if sampler is None:
            raise UsageError(
                f"the expert plays two-player games against random or bot only, not against {opponent.name}"
            )
        self.envs, self.limits, self.sampler = envs, limits, sampler
        self.turns = TurnPlayer(limits, tokenizer)
        self.opponent, self.run_seed, self.stage = opponent, run_seed, stage

    def run_games(self, specs: list[EpisodeSpec], on_turns: Callable[[int], None] | None = None) -> list[LiveEpisode]:
        """Play these games to their end; return the episodes of the seats the policy played, in order.
        A game that lost its env (or timed out, within env.timeout_retries) is played again from its start
        (`play_in_passes`)."""
        games = play_in_passes(
            [self._new_game(spec) for spec in specs],
            lambda todo: self._play_games(todo, on_turns),
            lambda game: game.seats,
            self.limits.timeout_retries,
        )
        return [ep for game in games for seat, ep in enumerate(game.seats) if game.trained[seat]]

    def _new_game(self, spec: EpisodeSpec) -> Game:
        seats = seat_specs(spec, self.run_seed, self.stage, self.opponent.self_play)
        trained = (True, True) if self.opponent.self_play else (policy_seat(spec) == 0, policy_seat(spec) == 1)
        return Game(spec, [LiveEpisode(s) for s in seats], trained)

    def _play_games(self, games: list[Game], on_turns: Callable[[int], None] | None) -> None:
        """One pass: every game from its reset to its end. Each round, the games whose seat to move is
        the policy's share one sampling call, and those whose seat to move is the opponent model's another."""
        envs = EnvRounds(self.envs, [game.spec.env_seed for game in games])
        # One sampler per side, each started with the seeds of the seats it plays (the Sampler contract:
        # a row's tokens depend on its seed and prompts only).
        opponent_sampler = self.opponent.sampler if not self.opponent.self_play else None
        sides: list[tuple[Sampler, bool, dict[int, int]]] = []
        for sampler, trained in ((self.sampler, True), (opponent_sampler, False)):
            seats = [ep for game in games for s, ep in enumerate(game.seats) if game.trained[s] == trained]
            if sampler is not None and seats:
                sampler.start([ep.spec.sample_seed for ep in seats])
                sides.append((sampler, trained, {id(ep): row for row, ep in enumerate(seats)}))

        def answer(i: int, reply: EnvReply) -> bool:
            if reply.op == "reset":
                self._open_game(games[i], reply)
            else:
                self._answer(games[i], reply)
            return games[i].over

        for ready in envs.rounds(answer):
            for sampler, trained, rows in sides:
                batch = [i for i in ready if games[i].trained[games[i].to_move] == trained]
                if not batch:
                    continue
                batch.sort(key=lambda i: rows[id(games[i].seats[games[i].to_move])])
                actions = self._move(envs, [games[i] for i in batch], batch, sampler, rows)
                if on_turns and trained:
                    on_turns(sum(len(a.ids) for a in actions))

    def _move(
        self, envs: EnvRounds, games: list[Game], indices: list[int], sampler: Sampler, rows: dict[int, int]
    ) -> list[Action]:
        """One side's turn in these games (at envs `indices`): their seats to move sample together, in
        the side's `rows` (by episode id); each reply goes to its env, and a game whose seat to move has
        no room left for one ends."""
        movers = [game.seats[game.to_move] for game in games]
        actions = self.turns.act(movers, [rows[id(ep)] for ep in movers], sampler)
        for game, index, ep, action in zip(games, indices, movers, actions):
            if ep.done:  # ended while building its prompt (context budget)
                self._end_early(game)
                envs.release(index)
                continue
            game.pending[game.to_move] = action
            envs.step(index, action.text)
        return actions

    def _open_game(self, game: Game, reply: EnvReply) -> None:
        """The reset's answer: the first seat to move gets its observation; both seats learn the task."""
        first = game.seats[0]
        self.turns.begin(first, reply)  # parses the reply, or fails the episode with why
        if first.done:
            for ep in game.seats[1:]:
                ep.finish(first.end_reason or EndReason.ERROR, first.error)
                ep.transient, ep.env_lost = first.transient, first.env_lost
            game.over = True
            return
        (_, info), tools = reply.value
        game.to_move = int(info["to_move"])
        opening, task = first.messages, first.task
        for seat, ep in enumerate(game.seats):
            ep.messages, ep.tools = [], tools or None
            name = self.opponent.name
            ep.task = {**task, "seat": seat, "first": seat == game.to_move, "opponent": name}
        game.seats[game.to_move].messages = opening

    def _answer(self, game: Game, reply: EnvReply) -> None:
        """A step's answer: it closes the turn of the seat it is for (or of both, at the end)."""
        if reply.failure is not None:
            for seat in (0, 1):
                self._close_turn(game, seat, reply)
            game.over = True
            return
        obs, reward, terminated, truncated, info = reply.value
        info = info or {}
        if terminated or truncated:
            endings, returns, seats = info.get("endings", {}), info.get("returns", {}), info.get("seats", {})
            for seat in (0, 1):
                key = str(seat)
                value = (
                    endings.get(key, ""),
                    returns.get(key, 0.0),
                    terminated,
                    truncated,
                    {**seats.get(key, {}), "player": seat},
                )
                acted = seat == info.get("player")  # the step's env time is the acting seat's turn's
                self._close_turn(game, seat, replace(reply, value=value, env_time_s=reply.env_time_s * acted))
            game.over = True
            return
        game.to_move = int(info["to_move"])
        ep = game.seats[game.to_move]
        if game.to_move in game.pending:
            self._close_turn(
                game, game.to_move, replace(reply, value=(obs, reward, False, False, {"player": game.to_move}))
            )
        else:  # this seat's first turn
            ep.messages = self.turns.observe(ep, as_messages(obs))
        if ep.done:  # env.max_turns, a reply cut by the token cap, or an env failure
            self._end_early(game)

    def _close_turn(self, game: Game, seat: int, reply: EnvReply) -> None:
        """Record seat's pending turn with this answer (TurnPlayer.record ends the episode when it says so)."""
        ep = game.seats[seat]
        if ep.done:
            return
        action = game.pending.pop(seat, None)
        if action is not None:
            self.turns.record(ep, action, reply)
        if ep.done:
            return
        if reply.failure is not None:
            ep.env_failed("env step", reply.failure)
        elif action is None:  # the game ended before this seat moved: what it was shown, and its score
            obs, reward, _, _, info = reply.value
            ep.messages.extend(self.turns.observe(ep, as_messages(obs)) if obs else [])
            ep.env_return += float(reward)
            ep.success = bool(info.get("success", False))
            ep.finish(EndReason.TERMINATED)

    def _end_early(self, game: Game) -> None:
        """A seat ended before the game did: the game ends, the other seat's reply in flight cut off."""
        for seat in (0, 1):
            ending = EnvReply(-1, "step", value=("", 0.0, False, True, {"player": seat}))
            self._close_turn(game, seat, ending)
        game.over = True


# --- which opponent ------------------------------------------------------------------------------


def recipe_opponent(
    ctx: RunContext, sampler: Sampler | None, *, stage: str, iteration: int | None = None
) -> Opponent | None:
    """env.opponent for a rollout stage that `sampler` plays (GRPO's, `rlcli rollout`, SFT's demos), an
    opponent model sampling as rollouts do. The expert (sampler None) plays a model opponent's games
    against random, inside the env, instead."""
    kind = ctx.recipe.env.model_opponent()
    if sampler is None:
        return Opponent("random") if kind is not None else None
    sampling = sampling_config(ctx.recipe.rollout)
    return resolve_opponent(ctx, kind, sampler, sampling, stage=stage, iteration=iteration)


def resolve_opponent(
    ctx: RunContext,
    kind: str | int | None,
    policy_sampler: Sampler | None,
    sampling: SamplingConfig,
    *,
    stage: str,
    iteration: int | None = None,
) -> Opponent | None:
    """env.opponent (or an eval opponent) as an Opponent for `stage`; None for none (single-player
    games, or opponents listed inside the env). A model opponent other than self is loaded here."""
    if kind is None:
        return None
    if kind in INSIDE_ENV:
        return Opponent(str(kind))
    if kind == "self":
        return Opponent("self", policy_sampler)
    if isinstance(kind, str) and kind.startswith("pool"):
        drawn = draw_from_pool(ctx, kind, stage, iteration)
        if drawn is None:
            return Opponent("self", policy_sampler)
        return Opponent(f"ckpt-{drawn.id}", _checkpoint_sampler(ctx, drawn, sampling))
    ckpt = resolve_checkpoint(ctx.store, PolicyRef.from_cli(str(kind)))
    name = "base" if ckpt is None else f"ckpt-{ckpt.id}"
    return Opponent(name, _checkpoint_sampler(ctx, ckpt, sampling))


def check_opponents(ctx: RunContext) -> None:
    """Before a command does any work: every checkpoint id named as an opponent (env.opponent,
    eval.opponents) is one of this run's."""
    recipe = ctx.recipe
    for option, kind in [
        ("env.opponent", recipe.env.opponent),
        *(("eval.opponents", o) for o in recipe.eval.opponents or []),
    ]:
        if isinstance(kind, int) and not any(c.id == kind for c in checkpoints(ctx.store)):
            owner = checkpoint_run(ctx.rundb, kind)
            where = f"belongs to run {owner!r}" if owner else "does not exist"
            raise UsageError(
                f"{option}: checkpoint {kind} {where}; an opponent is base, sft or a checkpoint of run {ctx.run!r} "
                f"(`rlcli runs show {ctx.run}` lists them)."
            )


def draw_from_pool(ctx: RunContext, kind: str, stage: str, iteration: int | None) -> Checkpoint | None:
    """pool: one of the run's GRPO checkpoints saved before `iteration` (all, outside GRPO), uniformly;
    pool:K among the last K. None, with a run event, while there is none."""
    pool = [c for c in train_checkpoints(ctx.store) if iteration is None or c.iteration < iteration]
    if kind != "pool":
        pool = pool[-int(kind.split(":")[1]) :]
    if not pool:
        add_event(
            ctx.store,
            stage,
            iteration if iteration is not None else -1,
            POOL_EVENT,
            f"env.opponent {kind}: no earlier checkpoint to draw yet (grpo.checkpoint_every saves them); {stage} plays self",
            {"opponent": kind},
        )
        return None
    rng = random.Random(derive_seed(ctx.recipe.run.seed, stage, "pool", [c.id for c in pool]))
    return rng.choice(pool)


_loaded: dict[str, Sampler] = {}  # the last opponent model loaded, by its weights and sampling


def _checkpoint_sampler(ctx: RunContext, ckpt: Checkpoint | None, sampling: SamplingConfig) -> Sampler:
    """An HF sampler on the base model (ckpt None) or a checkpoint's weights; the last one is kept, so a
    pool that draws the same checkpoint again, or an eval against it, does not load it again."""
    from rlcli.generation.hf_sampler import HfSampler
    from rlcli.models.loading import load_policy

    recipe = ctx.recipe
    key = f"{ckpt.path if ckpt else 'base'} {recipe.model} {recipe.quantization} {sampling}"
    if key not in _loaded:
        _loaded.clear()
        model, tokenizer = load_policy(
            recipe.model, recipe.lora, recipe.quantization, adapter=ckpt.path if ckpt else None, trainable=False
        )
        _loaded[key] = HfSampler(model, tokenizer, sampling)
    return _loaded[key]
