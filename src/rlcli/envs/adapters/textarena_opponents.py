"""The opponents that live inside a two-player TextArena game (textarena.py): `random` and `bot`.

Each game the adapter can play against an opponent has a function listing the legal moves of the
player to move (`random` draws one uniformly) and a scripted bot:
  TicTacToe     win if possible, else block the opponent's win, else the centre, else a random move
  ConnectFour   win if possible, else block, else a random column (centre columns first on ties)
  KuhnPoker     bet or call with a K; check with a Q, and call a bet with it; check with a J, fold to a bet
  SimpleNegotiation  accept an offer that raises its inventory's value (by its own values) and that it
                can pay, else deny; never offers
The moves are strings in the game's own format ("[4]", "[col 3]", "[bet]", "[Accept]"). Both draw from
the global `random`, which the env seeds per episode (TextArenaEnv._own_random): deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

OPPONENT_KINDS = ("random", "bot")


# --- TicTacToe --------------------------------------------------------------------------------

_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def _ttt_cells(game: Any) -> list[str]:
    return [cell for row in game.state.game_state["board"] for cell in row]


def _ttt_legal(game: Any) -> list[str]:
    return [f"[{i}]" for i, cell in enumerate(_ttt_cells(game)) if cell == ""]


def _ttt_bot(game: Any) -> str:
    cells = _ttt_cells(game)
    me = "X" if game.state.current_player_id == 1 else "O"  # the game's own marks: player 1 is X
    them = "O" if me == "X" else "X"
    for mark in (me, them):  # win, else block
        for line in _LINES:
            marks = [cells[i] for i in line]
            if marks.count(mark) == 2 and marks.count("") == 1:
                return f"[{line[marks.index('')]}]"
    if cells[4] == "":
        return "[4]"
    return random.choice(_ttt_legal(game))


# --- ConnectFour ------------------------------------------------------------------------------


def _c4_legal(game: Any) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[col {c}]" for c in range(len(board[0])) if board[0][c] == "."]


def _c4_wins(board: list[list[str]], col: int, disc: str) -> bool:
    rows, cols = len(board), len(board[0])
    row = max(r for r in range(rows) if board[r][col] == ".")
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        count = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < rows and 0 <= c < cols and board[r][c] == disc:
                count, r, c = count + 1, r + sign * dr, c + sign * dc
        if count >= 4:
            return True
    return False


def _c4_bot(game: Any) -> str:
    board = game.state.game_state["board"]
    me = "X" if game.state.current_player_id == 0 else "O"
    them = "O" if me == "X" else "X"
    legal = [c for c in range(len(board[0])) if board[0][c] == "."]
    for disc in (me, them):
        for col in legal:
            if _c4_wins(board, col, disc):
                return f"[col {col}]"
    return f"[col {random.choice(legal)}]"


# --- KuhnPoker --------------------------------------------------------------------------------


def _kuhn_legal(game: Any) -> list[str]:
    return [f"[{move}]" for move in game.state.game_state["current_legal_action_tree"]]


def _kuhn_bot(game: Any) -> str:
    state = game.state.game_state
    card = state["player_cards"][game.state.current_player_id]  # 0 = J, 1 = Q, 2 = K
    legal = set(state["current_legal_action_tree"])
    if "bet" in legal:  # no bet on the table
        return "[bet]" if card == 2 else "[check]"
    return "[call]" if card >= 1 else "[fold]"


# --- SimpleNegotiation ------------------------------------------------------------------------


def _negotiation_legal(game: Any) -> list[str]:
    """Well-formed moves: accept a pending offer it can pay, deny, or offer one unit of a resource it
    has for one unit of another."""
    state = game.state.game_state
    me = game.state.current_player_id
    mine = state["player_resources"][me]
    moves = ["[Deny]"]
    offer = state["current_offer"]
    if offer and all(mine.get(r, 0) >= q for r, q in offer["requested_resources"].items()):
        moves.append("[Accept]")
    moves += [f"[Offer: 1 {give} -> 1 {want}]" for give in mine if mine[give] > 0 for want in mine if want != give]
    return moves


def _negotiation_bot(game: Any) -> str:
    state = game.state.game_state
    me = game.state.current_player_id
    offer = state["current_offer"]
    if not offer:
        return "[Deny]"
    values, mine = state["player_values"][me], state["player_resources"][me]
    gain = sum(q * values[r] for r, q in offer["offered_resources"].items())
    cost = sum(q * values[r] for r, q in offer["requested_resources"].items())
    affordable = all(mine.get(r, 0) >= q for r, q in offer["requested_resources"].items())
    return "[Accept]" if affordable and gain > cost else "[Deny]"


# The env class's name -> (legal moves, bot) for the player to move.
GAMES: dict[str, tuple[Callable[[Any], list[str]], Callable[[Any], str]]] = {
    "TicTacToeEnv": (_ttt_legal, _ttt_bot),
    "ConnectFourEnv": (_c4_legal, _c4_bot),
    "KuhnPokerEnv": (_kuhn_legal, _kuhn_bot),
    "SimpleNegotiationEnv": (_negotiation_legal, _negotiation_bot),
}


def opponent_move(kind: str, game: Any) -> str:
    """The move of the player to move in `game` (the unwrapped TextArena env) as opponent `kind`."""
    legal, bot = GAMES[type(game).__name__]
    return bot(game) if kind == "bot" else random.choice(legal(game))
