"""Elo ratings of a run's checkpoints and opponents, fitted to its stored held-out games.

A Bradley-Terry model: player i beats player j with probability p_i / (p_i + p_j); a draw counts
half a win for each. The strengths are the maximum-likelihood fit by Hunter's (2004) minorisation-
maximisation updates, each player also given one virtual draw against a reference of strength 1,
so that a player who won (or lost) every game gets a finite rating. On the Elo scale a rating is
400 log10(p) + 1000: a 400-point gap is 10-to-1 odds. `random` (a uniformly random legal move), when
it played, is pinned at 1000, so ratings of different runs of a game compare; else the mean is 1000.
Only players linked by games are comparable: the fit says nothing across unconnected groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from rlcli.store.records import PlayedGame

ANCHOR = "random"
ITERATIONS = 2000
TOLERANCE = 1e-10


@dataclass(frozen=True)
class Rating:
    player: str
    elo: float
    games: int
    wins: int
    draws: int
    losses: int


def elo_ratings(games: list[PlayedGame]) -> list[Rating]:
    """Each player's rating and record, best first; [] without games."""
    if not games:
        return []
    strength = bradley_terry(games)
    record: dict[str, list[int]] = {p: [0, 0, 0] for p in strength}  # wins, draws, losses
    for g in games:
        outcome = 0 if g.score == 1 else 1 if g.score == 0.5 else 2
        record[g.player][outcome] += 1
        record[g.opponent][2 - outcome] += 1
    elo = {p: 400 * math.log10(s) for p, s in strength.items()}
    shift = 1000 - (elo[ANCHOR] if ANCHOR in elo else sum(elo.values()) / len(elo))
    ratings = [Rating(p, elo[p] + shift, sum(record[p]), *record[p]) for p in strength]
    return sorted(ratings, key=lambda r: -r.elo)


def bradley_terry(games: list[PlayedGame]) -> dict[str, float]:
    """Each player's strength, the reference's being 1 (see the module docstring)."""
    players = sorted({g.player for g in games} | {g.opponent for g in games})
    won: dict[str, float] = defaultdict(float)  # wins, draws counted as halves
    meetings: dict[str, dict[str, int]] = {p: defaultdict(int) for p in players}
    for g in games:
        won[g.player] += g.score
        won[g.opponent] += 1 - g.score
        meetings[g.player][g.opponent] += 1
        meetings[g.opponent][g.player] += 1
    strength = dict.fromkeys(players, 1.0)
    for _ in range(ITERATIONS):
        new = {}
        for i in players:
            # The virtual draw against the reference (strength 1): half a win, one meeting.
            meet = 1 / (strength[i] + 1) + sum(n / (strength[i] + strength[j]) for j, n in meetings[i].items())
            new[i] = (won[i] + 0.5) / meet
        change = max(abs(math.log(new[p] / strength[p])) for p in players)
        strength = new
        if change < TOLERANCE:
            break
    return strength
