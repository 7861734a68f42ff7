"""textarena:<GameId> - a TextArena game as an rlcli env: single-player (e.g. GuessTheNumber-v0,
Mastermind-v0), or two-player against env.opponent (TicTacToe-v0, ConnectFour-v0; below).

Observations: the game's messages to the player since the last turn (its rules prompt first, then
hints, boards and invalid-move notices), joined into one user message; the player's own moves are
not echoed back, since the chat already holds them. Actions: the reply goes to the game through
TextArena's default wrappers, so a reply without square brackets is wrapped in them ("5" -> "[5]").
Rewards: TextArena scores a game once, when it ends: 1 for a win, often a partial-progress fraction
otherwise. That score is the reward of the last step (0 before it), and success means a score of 1.
Most games also give that fraction to a game they end for an invalid move (a second one in a row),
so a policy could stop playing, or never learn the move format, and keep partial credit: a game
that ends on an invalid move scores at most `invalid_move_score` (an adapter option in env.kwargs,
default 0; null keeps the game's own score).
The game's own rules end it (a turn limit, or a second invalid move in a row); rlcli's
env.max_turns can end it sooner. env.kwargs override the game's constructor arguments
(e.g. {max_number: 50, max_turns: 8} for GuessTheNumber-v0).

Expert (for SFT demos and `envs try --policy expert`): only Blackjack-v0 has one, basic strategy
read off the game state: hit to 11, stand from 17, and from 12 to 16 stand against a dealer's 2-6
(the dealer must draw and may bust), else hit. It wins about 4 hands in 10, near the game's best.

Two-player games (TicTacToe-v0, ConnectFour-v0, KuhnPoker-v0, SimpleNegotiation-v0) play against an
opponent inside the env: env.opponent (rlcli hands it to the adapter as `opponent`) is `random` (a uniformly random
legal move) or `bot` (the game's scripted player, textarena_opponents.py), or a list of them, one per
task in turn. The policy's seat (player 0 or 1) is the seed's parity, the opponent
opponent[(seed // 2) % len]; the opponent's moves are played inside `step` until it is the policy's
turn again and reach the policy as part of the observation (its own moves are never sampled, so
never trained on). The policy's return is its seat's zero-sum score (1 win, 0 draw, -1 loss), success
a win; info carries `player` (the seat that acted: the policy's) and `opponent_moves` every turn, and
`seat`, `first` (the policy moved first) and `outcome` (win, draw, loss) at the end; info["task"] holds
seat, first and opponent. A two-player game without `opponent` is refused when the recipe is checked.
The game's bot is also its expert (SFT demos, `envs try --policy expert`).

`opponent: caller` (set by rlcli when env.opponent is a model: self, pool, base, sft or a checkpoint)
plays no seat inside the env: reset and step serve whichever player is to move, the caller playing
both seats (engine/games.py). Every reply's info has `to_move` (the seat whose turn it is, its
observation the reply's) and a step's `player` (the seat that acted); the last step's info has
`returns` (each seat's zero-sum score, keyed "0" and "1"), `endings` (each seat's last observation) and
`seats` (each seat's end-of-game info: success, score, reason, invalid_move, outcome).

Limits: games of more than two players are refused, and so are two-player games other than those
four (no legal moves or bot written for them yet). Games that need
NLTK corpora (Wordle, Hangman, WordLadder, WordSearch, Crosswords...) work only if that data was
installed beforehand - rlcli never lets a game download at run time; games that call a remote LLM
(TwentyQuestions, GuessWho) need an OpenRouter key and the network, and are not for offline use.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from rlcli.envs.adapters.textarena_opponents import GAMES, OPPONENT_KINDS, opponent_move
from rlcli.errors import UsageError

FULL_SCORE = 1.0 - 1e-6  # a win scores 1; allow a float rounding hair below it
CALLER = "caller"  # opponent: every seat played by the caller (engine/games.py), none inside the env
MAX_OPPONENT_MOVES = 20  # a bound on the opponent's moves between two of the policy's (invalid ones retried)
_players_checked: dict[str, int] = {}  # game id -> its number of players, once found


@contextmanager
def _no_downloads() -> Iterator[None]:
    """Word games call nltk.download() when imported or built. rlcli never fetches data at run time
    (and offline the attempt fails noisily): installed corpora are still found, and a missing one
    raises LookupError, which make_env reports in one sentence."""
    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = download


class TextArenaEnv:
    def __init__(
        self,
        game_id: str,
        game_kwargs: dict[str, Any],
        invalid_move_score: float | None = 0.0,
        players: int = 1,
        opponents: tuple[str, ...] = (),
    ):
        self.game_id, self.invalid_move_score = game_id, invalid_move_score
        self.players, self.opponents = players, opponents
        self.game = _build(game_id, game_kwargs)
        self.inner = self.game
        # Observations come from the unwrapped game (new messages only); actions go through the
        # wrappers so that TextArena's own action formatting applies.
        while isinstance(self.inner, ta.Wrapper):
            self.inner = self.inner.env
        self._random_state: Any = None
        self.seat, self.opponent = 0, ""  # the policy's player id and its opponent, set by reset
        if game_id in EXPERTS:  # looked up with getattr: games without one must not have the method
            self.expert_action = lambda: EXPERTS[game_id](self.inner)

    @contextmanager
    def _own_random(self, seed: int | None = None) -> Iterator[None]:
        """TextArena games draw from the global `random`; give each env its own stream so that
        episodes played side by side (a rollout batch) stay deterministic given their seeds."""
        outside = random.getstate()
        if seed is not None:
            random.seed(seed)
        else:
            random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outside)

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        task: dict[str, Any] = {"game": self.game_id, "seed": seed}
        if self.players == 1:
            with _no_downloads(), self._own_random(seed):
                self.game.reset(num_players=1, seed=seed)
            if not isinstance(self.inner.state, ta.SinglePlayerState):
                raise UsageError(_two_player_refusal(self.game_id))
            return self._new_messages(), {"task": task}
        if self.opponents == (CALLER,):
            with _no_downloads(), self._own_random(seed):
                self.game.reset(num_players=2, seed=seed)
            to_move = self.inner.state.current_player_id
            return self._new_messages(to_move), {"task": task, "to_move": to_move}
        self.seat, self.opponent = seed % 2, self.opponents[(seed // 2) % len(self.opponents)]
        with _no_downloads(), self._own_random(seed):
            self.game.reset(num_players=2, seed=seed)
            first = self.inner.state.current_player_id == self.seat
            self._opponent_turns()
        task.update(seat=self.seat, first=first, opponent=self.opponent)
        return self._new_messages(), {"task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.opponents == (CALLER,):
            return self._seat_step(action)
        with self._own_random():
            done, _ = self.game.step(action)
            moves = [] if done or self.players == 1 else self._opponent_turns()
        done = done or (self.players == 2 and bool(self.inner.state.done))
        text = self._new_messages()
        turn: dict[str, Any] = {} if self.players == 1 else {"player": self.seat, "opponent_moves": moves}
        if not done:
            return text, 0.0, False, False, turn
        rewards, game_info = self.game.close()
        score, ending, info = self._ending(self.seat, text, rewards, game_info)
        info.update(turn)
        if self.players == 2:
            info.update(seat=self.seat, opponent=self.opponent)
        return ending, score, True, False, info

    def _ending(
        self, seat: int, text: str, rewards: dict | None, game_info: dict | None
    ) -> tuple[float, str, dict[str, Any]]:
        """Seat `seat`'s score, last observation and end-of-game info once the game has closed."""
        score = float((rewards or {}).get(seat, 0.0))
        player_info = (game_info or {}).get(seat, {})
        reason = player_info.get("reason", "")
        invalid = bool(player_info.get("invalid_move"))
        if invalid and self.invalid_move_score is not None:
            score = min(score, self.invalid_move_score)
        ending = "\n".join(part for part in (text, f"Game over. {reason}".strip(), f"Score: {score:g}") if part)
        info: dict[str, Any] = {
            "success": score >= FULL_SCORE,
            "score": score,
            "reason": reason,
            "invalid_move": invalid,
        }
        if self.players == 2:
            info["outcome"] = "win" if score > 0 else "draw" if score == 0 else "loss"
        return score, ending, info

    def _seat_step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """opponent caller: the move of the player to move; the reply is for the next player to move."""
        acted = self.inner.state.current_player_id
        with self._own_random():
            done, _ = self.game.step(action)
        done = done or bool(self.inner.state.done)
        if not done:
            to_move = self.inner.state.current_player_id
            return self._new_messages(to_move), 0.0, False, False, {"player": acted, "to_move": to_move}
        texts = [self._new_messages(seat) for seat in (0, 1)]
        rewards, game_info = self.game.close()
        endings = [self._ending(seat, texts[seat], rewards, game_info) for seat in (0, 1)]
        info: dict[str, Any] = {
            "player": acted,
            "returns": {str(seat): endings[seat][0] for seat in (0, 1)},
            "endings": {str(seat): endings[seat][1] for seat in (0, 1)},
            "seats": {str(seat): endings[seat][2] for seat in (0, 1)},
        }
        return endings[acted][1], endings[acted][0], True, False, info

    def _opponent_turns(self) -> list[str]:
        """The opponent's moves until it is the policy's turn or the game ends (inside _own_random)."""
        state, moves = self.inner.state, list[str]()
        while not state.done and state.current_player_id != self.seat and len(moves) < MAX_OPPONENT_MOVES:
            move = opponent_move(self.opponent, self.inner)
            moves.append(move)
            self.game.step(move)
        state.observations[1 - self.seat] = []  # what the opponent was shown: not the policy's
        return moves

    def _bot_action(self) -> str:
        """The game's bot in the policy's seat: the expert of a two-player game."""
        with self._own_random():
            return opponent_move("bot", self.inner)

    def _new_messages(self, seat: int | None = None) -> str:
        """The messages to `seat` (default: the policy's) since it last looked."""
        seat = self.seat if seat is None else seat
        if self.players == 1:
            _, messages = self.inner.get_observation()
        else:
            messages, self.inner.state.observations[seat] = self.inner.state.observations[seat], []
        # A few games file messages with swapped arguments (an int as the text): those are not text.
        # The policy's own moves are in the chat already; an opponent's are shown as its move.
        lines = []
        for sender, text, kind in messages:
            if not isinstance(text, str):
                continue
            if kind != ta.ObservationType.PLAYER_ACTION:
                lines.append(text.strip())
            elif self.players == 2 and sender != seat:
                lines.append(f"Player {sender} (your opponent) moved: {text.strip()}")
        return "\n".join(lines)


def _blackjack_expert(game: Any) -> str:
    state = game.state.game_state
    score = game._hand_score(state["player_hand"])
    dealer = game._hand_score(state["dealer_hand"][:1])  # the card the player sees
    hit = score <= 11 or (score <= 16 and not 2 <= dealer <= 6)
    return "[Hit]" if hit else "[Stand]"


EXPERTS = {"Blackjack-v0": _blackjack_expert}


def _build(game_id: str, game_kwargs: dict[str, Any]) -> Any:
    try:
        with _no_downloads():
            return ta.make(game_id, **game_kwargs)
    except TypeError as exc:
        raise UsageError(f"env.kwargs do not fit textarena:{game_id}: {exc}") from None
    except Exception as exc:
        raise _cannot_play(game_id, exc) from None


def _two_player_refusal(game_id: str) -> str:
    return (
        f"textarena:{game_id} is a two-player game: set env.opponent to random, bot (or a list of them), self, "
        "pool, base, sft or a checkpoint id."
    )


def _cannot_play(game_id: str, exc: Exception) -> UsageError:
    """One sentence on why a game cannot run here: missing NLTK data, more players, or its own error."""
    if isinstance(exc, LookupError):
        found = re.search(r"Resource\W+(\w+)", str(exc))
        resource = found.group(1) if found else "a corpus"
        return UsageError(
            f"textarena:{game_id} needs the NLTK data {resource!r}, which is not installed, and rlcli does not "
            f"download data at run time. Install it once beforehand (python -m nltk.downloader {resource}) "
            "or pick a game that needs no data, e.g. GuessTheNumber-v0."
        )
    if isinstance(exc, (AssertionError, ValueError)) and "player" in str(exc).lower():
        return UsageError(
            f"textarena:{game_id} is a game of more than two players ({exc}); only single-player games and "
            "two-player games against an opponent are supported."
        )
    # Broken or online-only games (some need an OpenRouter key): say which and why.
    return UsageError(f"textarena:{game_id} cannot be played here: {type(exc).__name__}: {exc}")


def _players(env: TextArenaEnv) -> int:
    """1 or 2: how many players the game takes (a one-player reset refused, a two-player one not)."""
    for players in (1, 2):
        try:
            with _no_downloads(), env._own_random(0):
                env.game.reset(num_players=players, seed=0)
            return players
        except (AssertionError, ValueError) as exc:
            if "player" not in str(exc).lower():
                raise
    raise AssertionError("takes neither one player nor two")


def _opponents(game_id: str, opponent: str | list[str] | None, players: int) -> tuple[str, ...]:
    if players == 1:
        if opponent is not None:
            raise UsageError(f"env.opponent: textarena:{game_id} is a single-player game; drop the opponent.")
        return ()
    if opponent is None:
        raise UsageError(_two_player_refusal(game_id))
    if opponent == CALLER:
        return (CALLER,)
    kinds = [opponent] if isinstance(opponent, str) else opponent
    if not isinstance(kinds, list) or not kinds or any(k not in OPPONENT_KINDS for k in kinds):
        raise UsageError(f"env.opponent: expected {' or '.join(OPPONENT_KINDS)} or a list of them, got {opponent!r}.")
    return tuple(kinds)


def make_env(
    name: str, invalid_move_score: float | None = 0.0, opponent: str | list[str] | None = None, **kwargs: Any
) -> TextArenaEnv:
    if name not in ENV_REGISTRY:
        close = difflib.get_close_matches(name, ENV_REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else " See textarena.envs.registration.ENV_REGISTRY."
        raise UsageError(f"TextArena has no game {name!r}.{hint}")
    if invalid_move_score is not None and (
        isinstance(invalid_move_score, bool) or not isinstance(invalid_move_score, (int, float))
    ):
        raise UsageError(f"env.kwargs.invalid_move_score: expected a number or null, got {invalid_move_score!r}.")
    env = TextArenaEnv(name, kwargs, invalid_move_score)
    # How many players a game takes shows only when it is reset: find out once per game here, so a
    # recipe fails at once with a clear sentence instead of failing every episode.
    if name not in _players_checked:
        try:
            _players_checked[name] = _players(env)
        except UsageError:
            raise
        except Exception as exc:
            raise _cannot_play(name, exc) from None
    players = _players_checked[name]
    env.players, env.opponents = players, _opponents(name, opponent, players)
    if players == 2:
        if type(env.inner).__name__ not in GAMES:
            raise UsageError(
                f"textarena:{name} is a two-player game without an opponent in rlcli yet; two-player games: "
                "TicTacToe-v0, ConnectFour-v0, KuhnPoker-v0, SimpleNegotiation-v0 (and their variants)."
            )
        if name not in EXPERTS:
            env.expert_action = env._bot_action
    return env


def make_factory(name: str, **kwargs: Any) -> Callable[[], TextArenaEnv]:
    """Checks the game and its options once (the recipe check, before any stage, calls this), then
    makes an env per call."""
    make_env(name, **kwargs)
    return lambda: make_env(name, **kwargs)
