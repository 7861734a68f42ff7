"""maze: walk an agent A to the goal G on a small grid with walls # (multi-turn, text map or image).

Each turn the agent answers with a move: up, down, left or right (the last such word counts).
Reward 1.0 on reaching the goal. Mazes are generated from the seed and always solvable (checked by
breadth-first search); the expert follows a shortest path. With `render="image"` each observation
shows the grid as a picture instead of the text map (for vision-language models): the agent a blue
square, the goal a green one, walls black, free cells white.
"""

from __future__ import annotations

import random
import re
from collections import deque

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


RENDERS = ("text", "image")
COLOURS = "You are the blue square, the goal is the green square, black squares are walls, white ones are free."


class Maze:
    def __init__(self, size: int = 5, wall_density: float = 0.25, render: str = "text", cell: int = 24):
        if size < 3:
            raise ValueError("size must be at least 3")
        if render not in RENDERS:
            raise ValueError(f"render must be text or image, got {render!r}")
        if cell < 4:
            raise ValueError("cell must be at least 4 pixels")
        self.size, self.density, self.mode, self.cell = size, wall_density, render, cell

    def reset(self, seed: int):
        rng = random.Random(seed)
        while True:
            self.walls = {(r, c) for r in range(self.size) for c in range(self.size) if rng.random() < self.density}
            free = [(r, c) for r in range(self.size) for c in range(self.size) if (r, c) not in self.walls]
            if len(free) < 2:
                continue
            self.pos, self.goal = rng.sample(free, 2)
            if self._path(self.pos) is not None:
                break
        legend = COLOURS if self.mode == "image" else "A is you, G is the goal, # are walls, . are free cells."
        system = f"You are in a grid maze. {legend} Each turn reply with one move: up, down, left or right."
        return [{"role": "system", "content": system}, *as_user(self._observation(""))], {
            "task": {"start": list(self.pos), "goal": list(self.goal), "shortest": len(self._path(self.pos))}
        }

    def _observation(self, text: str) -> str | list[dict]:
        """The grid after `text`: the text map as a string, or a user message with the picture."""
        if self.mode == "text":
            return text + self.render()
        parts = [{"type": "text", "text": text.strip() or "The maze:"}, {"type": "image", "image": self.render_image()}]
        return [{"role": "user", "content": parts}]

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            rows.append(
                "".join(
                    "A" if (r, c) == self.pos else "G" if (r, c) == self.goal else "#" if (r, c) in self.walls else "."
                    for c in range(self.size)
                )
            )
        return "\n".join(rows)

    def step(self, action: str):
        words = re.findall(r"\b(up|down|left|right)\b", action.lower())
        if not words:
            return self._observation("Invalid move. Reply with up, down, left or right.\n"), 0.0, False, False, {}
        dr, dc = MOVES[words[-1]]
        nxt = (self.pos[0] + dr, self.pos[1] + dc)
        if not (0 <= nxt[0] < self.size and 0 <= nxt[1] < self.size) or nxt in self.walls:
            return self._observation("Blocked.\n"), 0.0, False, False, {}
        self.pos = nxt
        if self.pos == self.goal:
            return "You reached the goal!", 1.0, True, False, {"success": True}
        return self._observation(""), 0.0, False, False, {}

    def _path(self, start):
        """Moves of a shortest path from start to the goal, or None."""
        queue, seen = deque([(start, [])]), {start}
        while queue:
            cell, path = queue.popleft()
            if cell == self.goal:
                return path
            for name, (dr, dc) in MOVES.items():
                nxt = (cell[0] + dr, cell[1] + dc)
                if 0 <= nxt[0] < self.size and 0 <= nxt[1] < self.size and nxt not in self.walls and nxt not in seen:
                    seen.add(nxt)
                    queue.append((nxt, path + [name]))
        return None

    def expert_action(self) -> str:
        return self._path(self.pos)[0]

    def render_image(self, cell: int | None = None):
        from PIL import Image, ImageDraw

        cell = cell or self.cell
        image = Image.new("RGB", (self.size * cell, self.size * cell), "white")
        draw = ImageDraw.Draw(image)
        for r in range(self.size):
            for c in range(self.size):
                colour = (
                    "black"
                    if (r, c) in self.walls
                    else "royalblue"
                    if (r, c) == self.pos
                    else "seagreen"
                    if (r, c) == self.goal
                    else None
                )
                # Grey cell borders let a model count squares; walls stay solid black.
                box = [c * cell, r * cell, (c + 1) * cell - 1, (r + 1) * cell - 1]
                draw.rectangle(box, fill=colour or "white", outline=colour if colour == "black" else "lightgrey")
        return image


def as_user(observation: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else observation


def make_env(size: int = 5, wall_density: float = 0.25, render: str = "text", cell: int = 24) -> Maze:
    """render: text (a map of characters) or image (a picture of `cell` pixels a square)."""
    return Maze(size, wall_density, render, cell)
