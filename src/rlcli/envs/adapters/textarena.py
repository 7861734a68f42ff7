"""textarena:<GameId> - a single-player TextArena game (e.g. GuessTheNumber-v0, Mastermind-v0) as an rlcli env.

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

Limits: single-player games only (the other seats would need opponents). Games that need
NLTK corpora (Wordle, Hangman, WordLadder, WordSearch, Crosswords...) work only if that data was
installed beforehand - rlcli never lets a game download at run time; games that call a remote LLM
(TwentyQuestions, GuessWho) need an OpenRouter key and the network, and are not for offline use.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from rlcli.errors import UsageError

FULL_SCORE = 1.0 - 1e-6  # a win scores 1; allow a float rounding hair below it
_single_player_checked: set[str] = set()


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
    def __init__(self, game_id: str, game_kwargs: dict[str, Any], invalid_move_score: float | None = 0.0):
        self.game_id, self.invalid_move_score = game_id, invalid_move_score
        self.game = _build(game_id, game_kwargs)
        self.inner = self.game
        # Observations come from the unwrapped game (new messages only); actions go through the
        # wrappers so that TextArena's own action formatting applies.
        while isinstance(self.inner, ta.Wrapper):
            self.inner = self.inner.env
        self._random_state: Any = None
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
        with _no_downloads(), self._own_random(seed):
            self.game.reset(num_players=1, seed=seed)
        if not isinstance(self.inner.state, ta.SinglePlayerState):
            raise UsageError(
                f"textarena:{self.game_id} is a multi-player game; only single-player games are supported."
            )
        return self._new_messages(), {"task": {"game": self.game_id, "seed": seed}}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with self._own_random():
            done, _ = self.game.step(action)
        text = self._new_messages()
        if not done:
            return text, 0.0, False, False, {}
        rewards, game_info = self.game.close()
        score = float((rewards or {}).get(0, 0.0))
        player_info = (game_info or {}).get(0, {})
        reason = player_info.get("reason", "")
        invalid = bool(player_info.get("invalid_move"))
        if invalid and self.invalid_move_score is not None:
            score = min(score, self.invalid_move_score)
        text = "\n".join(part for part in (text, f"Game over. {reason}".strip(), f"Score: {score:g}") if part)
        info = {"success": score >= FULL_SCORE, "score": score, "reason": reason, "invalid_move": invalid}
        return text, score, True, False, info

    def _new_messages(self) -> str:
        _, messages = self.inner.get_observation()
        # A few games file messages with swapped arguments (an int as the text): those are not text.
        return "\n".join(
            text.strip()
            for _, text, kind in messages
            if isinstance(text, str) and kind != ta.ObservationType.PLAYER_ACTION
        )


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
            f"textarena:{game_id} is a multi-player game ({exc}); only single-player games are supported."
        )
    # Broken or online-only games (some need an OpenRouter key): say which and why.
    return UsageError(f"textarena:{game_id} cannot be played here: {type(exc).__name__}: {exc}")


def make_env(name: str, invalid_move_score: float | None = 0.0, **kwargs: Any) -> TextArenaEnv:
    if name not in ENV_REGISTRY:
        close = difflib.get_close_matches(name, ENV_REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else " See textarena.envs.registration.ENV_REGISTRY."
        raise UsageError(f"TextArena has no game {name!r}.{hint}")
    if invalid_move_score is not None and (
        isinstance(invalid_move_score, bool) or not isinstance(invalid_move_score, (int, float))
    ):
        raise UsageError(f"env.kwargs.invalid_move_score: expected a number or null, got {invalid_move_score!r}.")
    env = TextArenaEnv(name, kwargs, invalid_move_score)
    # Multi-player games reject one player only when reset; check once per game here, so a recipe
    # fails at once with a clear sentence instead of failing every episode.
    if name not in _single_player_checked:
        try:
            env.reset(0)
        except UsageError:
            raise
        except Exception as exc:
            raise _cannot_play(name, exc) from None
        _single_player_checked.add(name)
    return env
