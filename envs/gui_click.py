"""gui_click: click the named button on a synthetic screenshot (image observations, for vision-language models).

Each seed draws a screen with PIL: a few labelled buttons at random places. The instruction says
which one to click ("Click Save."); the agent answers `click(x, y)` in pixels of the screenshot.
Reward (GUI-R1 / UI-R1 style): 0.1 for a well-formed click, plus 0.9 inside the target's box, or
partial credit falling with the distance from its centre (up to 0.45) when outside. With
attempts > 1 a miss (or a malformed reply) shows the screen again, misses marked, and the agent
tries again: a multi-turn episode with a new screenshot each turn. The episode pays its best try
(each turn pays what it adds to the best so far), so missing first never pays more than hitting.
The expert clicks the target's centre.

fixed_layout=True keeps one screen for every seed (the same buttons in the same places) and varies
only which button the instruction names: a variant that a tiny model can learn, reading the
instruction alone (tests/models/test_vlm_grpo.py).

scene="app" draws an application window instead: a menu bar (File, Edit, View), one or two labelled
text fields and a few buttons. A task has one to three steps, one action a turn:
  "Click Save."                                       click the button;
  "Open the File menu, then click Export."            click File (its drop-down opens on the next
                                                      screenshot), then the item;
  "Type alice into the Name field, then click OK."    click the field (it takes the focus and shows
                                                      a caret), type("alice") (the text shows), click OK.
Actions are click(x, y) and type("text") (single or double quotes). Each step is worth 1/steps of the
episode, scored as a buttons click: the format reward, then full credit inside the right box (or for
exactly the right text typed), partial credit by distance for a near click, none for the wrong kind
of action or text. A wrong action ends the episode, or, with attempts > 1, the step is tried again
(misses marked); a step pays only its best try, so an episode never totals more than 1.0.
`success` is True only once every step is done. The expert does the current step.
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
        self.tries, self.paid = 0, 0.0
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
            return "Clicked.", self._pay(1.0), True, False, info
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        distance = ((x - cx) ** 2 + (y - cy) ** 2) ** 0.5
        diagonal = (self.width**2 + self.height**2) ** 0.5
        reward = self._pay(FORMAT_REWARD + (1 - FORMAT_REWARD) * 0.5 * max(0.0, 1 - distance / diagonal))
        if out_of_tries:
            return "Missed.", reward, True, False, info
        self.misses.append((round(x), round(y)))
        return self._again("Missed: the red circle marks your click."), reward, False, False, info

    def _pay(self, score: float) -> float:
        """This try's reward: what its score adds to the best try so far, so an episode totals its best."""
        reward = max(0.0, score - self.paid)
        self.paid = max(self.paid, score)
        return reward

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


SCENES = ("buttons", "app")
APP_BUTTONS = ["OK", "Cancel", "Apply", "Save", "Reset", "Help"]
FIELDS = ["Name", "User", "City", "Host"]
MENUS = {
    "File": ["New", "Open", "Export", "Print", "Quit"],
    "Edit": ["Undo", "Redo", "Copy", "Paste", "Find"],
    "View": ["Zoom", "Grid", "Ruler", "Theme"],
}
ITEMS_PER_MENU = 3
WORDS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
# The first action in the reply counts: click(x, y), or type("...") / type('...').
ACTION = re.compile(
    r"click\(\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*\)|type\(\s*(?:\"([^\"]*)\"|'([^']*)')\s*\)", re.I
)
APP_SYSTEM = (
    "You see a screenshot of an application. Do what the user asks, one action per reply. Reply with exactly "
    "click(x, y) to click at pixel coordinates x, y of the screenshot (x from the left, y from the top), or "
    'type("text") to type text into the field that has the focus (click a field first to focus it).'
)
FORMAT_HINT = 'Reply with exactly click(x, y) or type("text").'
MENU_TOP, MENU_BOTTOM, ITEM_HEIGHT, BODY_TOP = 11, 23, 13, 28


class GuiApp:
    """scene="app": menus, text fields and buttons; multi-step tasks, one action a turn."""

    def __init__(self, width: int, height: int, buttons: int, attempts: int, fixed_layout: bool):
        if width < 112 or height < 112:
            raise ValueError("the app scene needs a screen of at least 112x112 pixels")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.width, self.height, self.attempts, self.fixed_layout = width, height, attempts, fixed_layout
        self.row_height = max(height // 8, 14)
        # Wide enough for the longest label ("Cancel") in the default font.
        self.button_width = max(width // 4, 40)
        # Rows of widgets below the menu bar: up to two hold a field each, the rest hold buttons.
        rows = (height - 2 - BODY_TOP) // (self.row_height + 4)
        self.per_row = (width - 4 + 2) // (self.button_width + 2)
        most = min(len(APP_BUTTONS), (rows - 2) * self.per_row)
        if not 1 <= buttons <= most:
            raise ValueError(f"buttons must be from 1 to {most} for the app scene at {width}x{height}")
        self.rows, self.buttons = rows, buttons

    def reset(self, seed: int):
        rng = random.Random(seed)
        # One layout for every seed (drawn from seed 0), or a new one per seed; the task always varies.
        self._layout(random.Random(0) if self.fixed_layout else rng)
        kind = rng.choice(["click", "menu", "type"])
        if kind == "click":
            button = self.button_labels[rng.randrange(self.buttons)]
            self.instruction = f"Click {button}."
            self.steps = [self._click("button", button)]
        elif kind == "menu":
            menu = rng.choice(list(self.menu_boxes))
            item = rng.choice(self.items[menu])
            self.instruction = f"Open the {menu} menu, then click {item}."
            self.steps = [self._click("menu", menu), self._click("item", item, menu)]
        else:
            field = self.field_labels[rng.randrange(len(self.field_labels))]
            word = rng.choice(WORDS)
            button = self.button_labels[rng.randrange(self.buttons)]
            self.instruction = f"Type {word} into the {field} field, then click {button}."
            self.steps = [self._click("field", field), {"action": "type", "text": word}, self._click("button", button)]
        self.open_menu: str | None = None
        self.focus: str | None = None
        self.texts = {label: "" for label in self.field_labels}
        self.index, self.tries, self.paid = 0, 0, 0.0
        self.misses: list[tuple[int, int]] = []
        user = [{"type": "text", "text": self.instruction}, {"type": "image", "image": self.render()}]
        task = {"instruction": self.instruction, "kind": kind, "steps": [dict(s) for s in self.steps]}
        return [{"role": "system", "content": APP_SYSTEM}, {"role": "user", "content": user}], {"task": task}

    def _click(self, widget: str, label: str, menu: str | None = None) -> dict:
        boxes = {"button": self.button_boxes, "menu": self.menu_boxes, "field": self.field_boxes}
        box = self.item_boxes[menu][label] if widget == "item" else boxes[widget][label]
        return {"action": "click", "widget": widget, "target": label, "box": list(box)}

    def _layout(self, rng: random.Random) -> None:
        """Menu titles left to right with their drop-downs; fields and buttons in shuffled rows."""
        from PIL import Image, ImageDraw

        measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        self.menu_boxes, self.items, self.item_boxes = {}, {}, {}
        x = 4
        for menu, choices in MENUS.items():
            right = x + round(measure.textlength(menu)) + 8
            self.menu_boxes[menu] = (x, MENU_TOP, right, MENU_BOTTOM)
            self.items[menu] = rng.sample(choices, ITEMS_PER_MENU)
            drop = max(round(measure.textlength(item)) for item in choices) + 12
            x0 = min(x, self.width - drop - 2)
            self.item_boxes[menu] = {
                item: (x0, MENU_BOTTOM + 1 + i * ITEM_HEIGHT, x0 + drop, MENU_BOTTOM + (i + 1) * ITEM_HEIGHT)
                for i, item in enumerate(self.items[menu])
            }
            x = right + 2
        h, pitch = self.row_height, self.row_height + 4
        rows = rng.sample(range(self.rows), self.rows)
        self.field_labels = rng.sample(FIELDS, rng.choice((1, 2)))
        self.field_boxes, self.label_at = {}, {}
        box_width = max(self.width // 3, 40)
        for label, row in zip(self.field_labels, rows):
            label_width = round(measure.textlength(label)) + 4
            x = rng.randrange(2, self.width - label_width - box_width - 1)
            y = BODY_TOP + row * pitch
            self.label_at[label] = (x, y + h // 2 - 6)
            self.field_boxes[label] = (x + label_width, y, x + label_width + box_width, y + h)
        # Buttons: each free row takes up to per_row of them, spread with random gaps.
        free = rows[len(self.field_labels) :]
        counts = dict.fromkeys(free, 0)
        for _ in range(self.buttons):
            row = rng.choice([r for r in free if counts[r] < self.per_row])
            counts[row] += 1
        self.button_labels = rng.sample(APP_BUTTONS, self.buttons)
        self.button_boxes = {}
        labels = iter(self.button_labels)
        for row in free:
            k = counts[row]
            spare = self.width - 4 - k * self.button_width - (k - 1) * 2
            offsets = sorted(rng.randrange(spare + 1) for _ in range(k))
            for i, offset in enumerate(offsets):
                x0 = 2 + offset + i * (self.button_width + 2)
                y0 = BODY_TOP + row * pitch
                self.button_boxes[next(labels)] = (x0, y0, x0 + self.button_width, y0 + h)

    def render(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.width, self.height), (236, 236, 240))
        draw = ImageDraw.Draw(image)
        draw.rectangle((0, 0, self.width - 1, 9), fill=(60, 90, 160))  # a title bar
        draw.rectangle((0, 10, self.width - 1, MENU_BOTTOM + 1), fill=(214, 214, 220))  # the menu bar
        for label, box in self.field_boxes.items():
            draw.text(self.label_at[label], label, fill=(0, 0, 0))
            focused = label == self.focus
            outline, width = ((30, 90, 220), 2) if focused else ((120, 120, 120), 1)
            draw.rectangle(box, fill=(255, 255, 255), outline=outline, width=width)
            draw.text((box[0] + 4, (box[1] + box[3]) // 2 - 6), self.texts[label], fill=(0, 0, 0))
            if focused:  # the caret after the text
                x = box[0] + 4 + round(draw.textlength(self.texts[label])) + 1
                draw.line((x, box[1] + 3, x, box[3] - 3), fill=(0, 0, 0), width=1)
        for label, box in self.button_boxes.items():
            draw.rectangle(box, fill=(250, 250, 250), outline=(40, 40, 40))
            draw.text((box[0] + 4, (box[1] + box[3]) // 2 - 6), label, fill=(0, 0, 0))
        for menu, box in self.menu_boxes.items():
            if menu == self.open_menu:
                draw.rectangle(box, fill=(190, 205, 240))
            draw.text((box[0] + 4, box[1]), menu, fill=(0, 0, 0))
        if self.open_menu is not None:  # the drop-down covers whatever lies below it
            boxes = list(self.item_boxes[self.open_menu].items())
            first, last = boxes[0][1], boxes[-1][1]
            draw.rectangle((first[0], first[1] - 1, last[2], last[3] + 1), fill=(255, 255, 255), outline=(40, 40, 40))
            for item, box in boxes:
                draw.text((box[0] + 6, box[1] + 1), item, fill=(0, 0, 0))
        for x, y in self.misses:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), outline=(220, 0, 0), width=2)
        return image

    def step(self, action: str):
        step, n = self.steps[self.index], len(self.steps)
        self.tries += 1
        match = ACTION.search(action)
        info: dict = {"format": match is not None, "step": self.index}
        click = None
        if match is None:
            score, feedback = 0.0, FORMAT_HINT
        elif match.group(1) is not None:
            click = (float(match.group(1)), float(match.group(2)))
            info["click"] = list(click)
            score, feedback = self._score_click(step, click)
        else:
            typed = match.group(3) if match.group(3) is not None else match.group(4)
            info["typed"] = typed
            if step["action"] != "type":
                score, feedback = FORMAT_REWARD, "Not now: the next step is a click."
            elif typed == step["text"]:
                score, feedback = 1.0, ""
            else:
                score, feedback = FORMAT_REWARD, "That is not the text to type."
        # A step pays its best try once: retries never total more than the step's share.
        reward = max(0.0, score - self.paid) / n
        self.paid = max(self.paid, score)
        if score == 1.0:
            done = self._apply(step)
            self.index, self.tries, self.paid, self.misses = self.index + 1, 0, 0.0, []
            if self.index == n:
                return "Done.", reward, True, False, {**info, "success": True}
            content = [{"type": "text", "text": done}, {"type": "image", "image": self.render()}]
            return [{"role": "user", "content": content}], reward, False, False, {**info, "success": False}
        if self.tries >= self.attempts:
            return feedback or "Missed.", reward, True, False, {**info, "success": False}
        if click is not None:  # marked on the screenshot of the next try
            self.misses.append((round(click[0]), round(click[1])))
        content = [
            {"type": "text", "text": f"{feedback} {self.instruction}"},
            {"type": "image", "image": self.render()},
        ]
        return [{"role": "user", "content": content}], reward, False, False, {**info, "success": False}

    def _score_click(self, step: dict, click: tuple[float, float]) -> tuple[float, str]:
        """A click's score for the step (1.0 inside the box) and what to say when it is not right."""
        if step["action"] != "click":
            return FORMAT_REWARD, "Not now: the next step is to type."
        x, y = click
        x0, y0, x1, y1 = step["box"]
        if x0 <= x <= x1 and y0 <= y <= y1:
            return 1.0, ""
        distance = ((x - (x0 + x1) / 2) ** 2 + (y - (y0 + y1) / 2) ** 2) ** 0.5
        diagonal = (self.width**2 + self.height**2) ** 0.5
        score = FORMAT_REWARD + (1 - FORMAT_REWARD) * 0.5 * max(0.0, 1 - distance / diagonal)
        return score, "Missed: the red circle marks your click."

    def _apply(self, step: dict) -> str:
        """Carry out a right action; what the next turn says about it."""
        if step["action"] == "type":
            self.texts[self.focus] = step["text"]
            return f"Typed {step['text']}."
        widget, target = step["widget"], step["target"]
        if widget == "menu":
            self.open_menu = target
            return f"The {target} menu is open."
        if widget == "field":
            self.focus = target
            return f"The {target} field has the focus."
        self.open_menu = None
        return f"Clicked {target}."

    def expert_action(self) -> str:
        step = self.steps[self.index]
        if step["action"] == "type":
            return f'type("{step["text"]}")'
        x0, y0, x1, y1 = step["box"]
        return f"click({(x0 + x1) // 2}, {(y0 + y1) // 2})"


def make_env(
    width: int = 224,
    height: int = 224,
    buttons: int = 3,
    attempts: int = 1,
    fixed_layout: bool = False,
    scene: str = "buttons",
) -> GuiClick | GuiApp:
    """scene "buttons" (the default): one click on a named button; "app": menus, fields and buttons, multi-step."""
    if scene == "buttons":
        return GuiClick(width, height, buttons, attempts, fixed_layout)
    if scene == "app":
        return GuiApp(width, height, buttons, attempts, fixed_layout)
    raise ValueError(f"scene must be one of {', '.join(SCENES)}, got {scene!r}")
