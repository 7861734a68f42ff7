"""gui_click: click the named button on a synthetic screenshot (image observations, for vision-language models).

Each seed draws a screen with PIL: a few labelled buttons at random places. The instruction says
which one to click ("Click Save."); the agent answers `click(x, y)` in pixels of the screenshot.
Reward (GUI-R1 / UI-R1 style): 0.1 for a well-formed click, plus 0.9 inside the target's box, or
partial credit falling with the distance from its centre (up to 0.45) when outside. With
attempts > 1 a miss (or a malformed reply) shows the screen again, misses marked, and the agent
tries again: a multi-turn episode with a new screenshot each turn.
The expert clicks the target's centre.

fixed_layout=True keeps one screen for every seed (the same buttons in the same places) and varies
only which button the instruction names: a variant that a tiny model can learn, reading the
instruction alone (tests/test_vlm_grpo.py).
"""

from __future__ import annotations

import random
import re

LABELS = ["Save", "Open", "Cancel", "Export", "Help", "Close", "Print", "Undo"]
CLICK = re.compile(r"click\(\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*\)", re.I)
FORMAT_REWARD = 0.1
SYSTEM = (
    "You see a screenshot of an application. Do what the user asks by clicking: reply with exactly "
    "click(x, y), where x and y are pixel coordinates in the screenshot (x from the left, y from the top)."
)


class GuiClick:
    def __init__(
        self, width: int = 224, height: int = 224, buttons: int = 3, attempts: int = 1, fixed_layout: bool = False
    ):
        if not 1 <= buttons <= len(LABELS):
            raise ValueError(f"buttons must be from 1 to {len(LABELS)}")
        if width < 56 or height < 56:
            raise ValueError("the screen must be at least 56x56 pixels")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.width, self.height, self.buttons, self.attempts = width, height, buttons, attempts
        self.fixed_layout = fixed_layout

    def reset(self, seed: int):
        rng = random.Random(seed)
        # One layout for every seed (drawn from seed 0), or a new one per seed.
        screen = random.Random(0) if self.fixed_layout else rng
        self.labels = screen.sample(LABELS, self.buttons)
        self.boxes = self._layout(screen)
        self.target = rng.randrange(self.buttons)
        self.tries = 0
        self.misses: list[tuple[int, int]] = []
        label = self.labels[self.target]
        user = [{"type": "text", "text": f"Click {label}."}, {"type": "image", "image": self.render()}]
        task = {"target": label, "box": list(self.boxes[self.target]), "labels": self.labels}
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], {"task": task}

    def _layout(self, rng: random.Random) -> list[tuple[int, int, int, int]]:
        """Non-overlapping button boxes (x0, y0, x1, y1), each at least a fifth of the screen wide."""
        w, h = max(self.width // 4, 28), max(self.height // 8, 14)
        boxes: list[tuple[int, int, int, int]] = []
        while len(boxes) < self.buttons:
            x0, y0 = rng.randrange(2, self.width - w - 2), rng.randrange(2, self.height - h - 2)
            box = (x0, y0, x0 + w, y0 + h)
            if all(box[2] + 2 < b[0] or b[2] + 2 < box[0] or box[3] + 2 < b[1] or b[3] + 2 < box[1] for b in boxes):
                boxes.append(box)
        return boxes

    def render(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.width, self.height), (236, 236, 240))
        draw = ImageDraw.Draw(image)
        draw.rectangle((0, 0, self.width - 1, 9), fill=(60, 90, 160))  # a title bar
        for label, box in zip(self.labels, self.boxes):
            draw.rectangle(box, fill=(250, 250, 250), outline=(40, 40, 40))
            draw.text((box[0] + 3, box[1] + 2), label, fill=(0, 0, 0))
        for x, y in self.misses:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), outline=(220, 0, 0), width=2)
        return image

    def step(self, action: str):
        self.tries += 1
        match = CLICK.search(action)
        out_of_tries = self.tries >= self.attempts
        if match is None:
            if out_of_tries:
                return "Reply with exactly click(x, y).", 0.0, True, False, {"format": False, "success": False}
            return self._again("Reply with exactly click(x, y)."), 0.0, False, False, {"format": False}
        x, y = float(match.group(1)), float(match.group(2))
        x0, y0, x1, y1 = self.boxes[self.target]
        inside = x0 <= x <= x1 and y0 <= y <= y1
        info = {"format": True, "click": [x, y], "success": inside}
        if inside:
            return "Clicked.", FORMAT_REWARD + (1 - FORMAT_REWARD), True, False, info
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        distance = ((x - cx) ** 2 + (y - cy) ** 2) ** 0.5
        diagonal = (self.width**2 + self.height**2) ** 0.5
        reward = FORMAT_REWARD + (1 - FORMAT_REWARD) * 0.5 * max(0.0, 1 - distance / diagonal)
        if out_of_tries:
            return "Missed.", reward, True, False, info
        self.misses.append((round(x), round(y)))
        return self._again("Missed: the red circle marks your click."), reward, False, False, info

    def _again(self, text: str) -> list[dict]:
        """The next attempt's observation: what went wrong, the task again, and a fresh screenshot."""
        content = [
            {"type": "text", "text": f"{text} Click {self.labels[self.target]}."},
            {"type": "image", "image": self.render()},
        ]
        return [{"role": "user", "content": content}]

    def expert_action(self) -> str:
        x0, y0, x1, y1 = self.boxes[self.target]
        return f"click({(x0 + x1) // 2}, {(y0 + y1) // 2})"


def make_env(
    width: int = 224, height: int = 224, buttons: int = 3, attempts: int = 1, fixed_layout: bool = False
) -> GuiClick:
    return GuiClick(width, height, buttons, attempts, fixed_layout)
