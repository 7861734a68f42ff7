"""miniwob:<task> - a MiniWoB++ web task (click-button, enter-text, login-user...) in a real headless Chromium.

The task pages are the ones the `miniwob` package ships (offline, file:// URLs); playwright drives the
machine's Chromium (envs/browser.py: one browser per process, a browser context per episode).
reset(seed) loads the task's page, seeds its random generator with the seed (`Math.seedrandom`) and
starts the episode, so the same seed gives the same page. A mix of tasks, `miniwob:click-button,enter-text`,
plays task `seed mod n` of the list for each seed (the held-out seeds cover every task too). The page's own display (the reward, the
timer, the click canvas) is hidden and jQuery animations are off.

Observations (`observation`, an adapter option in env.kwargs):
- `axtree`: the page's accessibility tree as text, as BrowserGym writes it: one element a line,
  indented by depth, `[N] role 'name', properties`, where N is the element's id (a `bid` attribute
  rlcli puts on every element; ids stay put while the page lives). Elements without a role or name
  are folded into their children; the task's own query is left out (the task line says it).
- `screenshot`: the page as an image part (160x210 pixels times `scale`) for a vision-language
  policy; `both`: the tree and the image. Every observation starts with the task: "Task: <utterance>".

Actions, read from the reply (the last call in it counts), BrowserGym's:
click("N"), dblclick("N"), hover("N"), focus("N"), clear("N"), fill("N", "text"), press("N", "Enter"),
select_option("N", "option"), drag_and_drop("N", "M"), scroll(dx, dy), mouse_click(x, y),
mouse_dblclick(x, y), mouse_move(x, y), mouse_drag_and_drop(x1, y1, x2, y2) (screenshot pixels),
keyboard_type("text"), keyboard_press("Enter"), noop(). A reply without one, or an action the page
refuses (no such id, a hidden element, fill on a button), is reported at the top of the next
observation, changes nothing, and costs `invalid_action_reward` (default -1: replying junk must
never beat a wrong answer, which MiniWoB scores -1).

Rewards: MiniWoB's own, given when the page ends the episode: `reward: raw` (default) is its raw
reward in [-1, 1] (1 done right, -1 wrong, partial on a few tasks); `discounted` is MiniWoB's
time-discounted reward (the raw reward times 1 - elapsed/episode time, wall-clock, so it is not
reproducible; the episode time is `episode_time_s`, default MiniWoB's 10 s). `success` is MiniWoB's:
a raw reward above 0. `episode_time_s` also lets the page end a slow episode itself (raw -1); without
it the page never runs out of time. `max_actions` ends an episode after that many actions as the
page's timer would (raw -1), so that dithering until env.max_turns does not beat a wrong answer.

Experts (expert_action) for the tasks in EXPERTS read the page (the tree and the fields' values) and
act; with `observation: screenshot` they click by coordinates and type with keyboard_type.

Refused before any stage, in one sentence: an unknown task (with a did-you-mean), a missing browser
(naming the install command), `axtree` for a task drawn in pixels (PIXEL_TASKS), bad options.
A page that hangs past `page_timeout_s` or crashes fails its episode with the error.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import io
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli.envs.browser import BrowserGone, Chromium, find_chromium, shared_chromium
from rlcli.errors import UsageError

OBSERVATIONS = ("axtree", "screenshot", "both")
REWARDS = ("raw", "discounted")
WIDTH, HEIGHT = 160, 210  # MiniWoB's task area (#wrap)
NO_TIME_LIMIT_MS = 2_000_000_000  # below setTimeout's 2**31 - 1 ms cap (a larger delay fires at once)
ACTION_TIMEOUT_MS = 1000  # how long an action waits for its element to be visible and enabled
# Tasks whose state is drawn in pixels (colours, shapes, positions on a canvas or SVG): an
# accessibility tree cannot show them.
PIXEL_TASKS = frozenset(
    {
        "bisect-angle",
        "chase-circle",
        "circle-center",
        "click-color",
        "click-shades",
        "click-shape",
        "count-shape",
        "count-sides",
        "drag-circle",
        "drag-shapes",
        "drag-shapes-2",
        "drag-single-shape",
        "draw-circle",
        "draw-line",
        "find-midpoint",
        "grid-coordinate",
        "hover-shape",
        "identify-shape",
        "moving-items",
        "right-angle",
        "use-colorwheel",
        "use-colorwheel-2",
        "visual-addition",
    }
)
# The page's own display, hidden; their subtrees and the query are left out of the tree.
HIDDEN_IDS = ("reward-display", "click-canvas", "sync-task-cover")
SKIPPED_IDS = frozenset({*HIDDEN_IDS, "query"})
START_JS = """(args) => {
  const style = document.createElement('style');
  style.textContent = args.hidden.map((id) => '#' + id).join(', ') + ' { display: none !important; }';
  document.head.appendChild(style);
  if (window.jQuery) { window.jQuery.fx.off = true; }
  Math.seedrandom(args.seed);
  core.EPISODE_MAX_TIME = args.maxTime;
  core.startEpisodeReal();
}"""
MARK_JS = """() => {
  let next = window.__rlcliNextBid || 1;
  for (const el of document.querySelectorAll('*')) {
    if (!el.hasAttribute('bid')) { el.setAttribute('bid', String(next++)); }
  }
  window.__rlcliNextBid = next;
}"""
# Where to click an element so that it gets the click: its centre, or else the first point of a grid
# over it that no other element covers (buttons of click-test-2 overlap); null: the centre.
VISIBLE_POINT_JS = """(el) => {
  const r = el.getBoundingClientRect();
  const mine = (x, y) => { const hit = document.elementFromPoint(x, y); return !!hit && (hit === el || el.contains(hit)); };
  if (r.width === 0 || r.height === 0 || mine(r.left + r.width / 2, r.top + r.height / 2)) { return null; }
  for (const fy of [0.5, 0.25, 0.75, 0.1, 0.9]) {
    for (const fx of [0.5, 0.25, 0.75, 0.1, 0.9]) {
      if (mine(r.left + r.width * fx, r.top + r.height * fy)) { return {x: r.width * fx, y: r.height * fy}; }
    }
  }
  return null;
}"""
FIELDS_JS = """() => Array.from(document.querySelectorAll('input, textarea, select')).map((el) => ({
  bid: el.getAttribute('bid'), value: el.value, checked: !!el.checked, focused: document.activeElement === el,
}))"""
STATE_JS = "() => [WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL, WOB_REWARD_GLOBAL, WOB_REWARD_REASON]"
FOLDED_ROLES = {"generic", "none", "paragraph", "LineBreak", "InlineTextBox", "LayoutTable", "LayoutTableRow"}

AXTREE_SYSTEM = (
    "You are a web agent in a browser. Each turn you get the task and the web page as an accessibility "
    "tree, where [N] is the id of the element on that line. Reply with one action: "
    'click("N"), fill("N", "text"), press("N", "Enter"), select_option("N", "option") or scroll(dx, dy).'
)
SCREENSHOT_SYSTEM = (
    "You are a web agent in a browser. Each turn you get the task and a screenshot of the web page, "
    "{width}x{height} pixels. Reply with one action: mouse_click(x, y) clicks at pixel x, y of the "
    'screenshot (x from the left, y from the top), keyboard_type("text") types into the focused field, '
    'keyboard_press("Enter") presses a key, scroll(dx, dy) scrolls.'
)
BOTH_SYSTEM = (
    "You are a web agent in a browser. Each turn you get the task, the web page as an accessibility tree, "
    "where [N] is the id of the element on that line, and a screenshot of the page, {width}x{height} pixels. "
    'Reply with one action: click("N"), fill("N", "text"), press("N", "Enter"), select_option("N", "option"), '
    'scroll(dx, dy), or mouse_click(x, y) at pixel x, y of the screenshot, keyboard_type("text"), '
    'keyboard_press("Enter").'
)

# name -> the kinds of its arguments: an element id, text, or a number (pixels)
ACTIONS: dict[str, tuple[str, ...]] = {
    "click": ("bid",),
    "dblclick": ("bid",),
    "hover": ("bid",),
    "focus": ("bid",),
    "clear": ("bid",),
    "fill": ("bid", "text"),
    "press": ("bid", "text"),
    "select_option": ("bid", "options"),
    "drag_and_drop": ("bid", "bid"),
    "scroll": ("number", "number"),
    "mouse_click": ("number", "number"),
    "mouse_dblclick": ("number", "number"),
    "mouse_move": ("number", "number"),
    "mouse_drag_and_drop": ("number", "number", "number", "number"),
    "keyboard_type": ("text",),
    "keyboard_press": ("text",),
    "noop": (),
}
_CALL = re.compile(r"\b(" + "|".join(sorted(ACTIONS, key=len, reverse=True)) + r")\s*\(")
_BID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class PageCrashed(Exception):
    """The episode's page crashed; the episode fails."""


class ActionError(Exception):
    """The reply holds no action the page can take; the message says why (shown to the agent)."""


# --- the task list -------------------------------------------------------------------


def html_folder() -> Path:
    """The folder of MiniWoB++'s task pages that the miniwob package ships, found without importing it."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "The miniwob: envs need the miniwob package (MiniWoB++'s task pages): pip install 'rlcli[web]'."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "html" / "miniwob"


def task_names() -> list[str]:
    return sorted(p.stem for p in html_folder().glob("*.html"))


# --- options -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    tasks: tuple[str, ...]  # one task, or a mix: seed s plays tasks[s % len(tasks)]
    folder: str  # the task pages
    observation: str = "axtree"
    reward: str = "raw"
    invalid_action_reward: float = -1.0
    max_actions: int | None = None
    episode_time_s: float | None = None
    scale: float = 1.0
    wait_ms: int = 0
    page_timeout_s: float = 20.0

    def task(self, seed: int) -> str:
        return self.tasks[seed % len(self.tasks)]

    def url(self, task: str) -> str:
        return (Path(self.folder) / f"{task}.html").as_uri()

    @property
    def tree(self) -> bool:
        return self.observation in ("axtree", "both")

    @property
    def image(self) -> bool:
        return self.observation in ("screenshot", "both")

    @property
    def size(self) -> tuple[int, int]:
        """The screenshot's size in pixels."""
        return round(WIDTH * self.scale), round(HEIGHT * self.scale)


def _number(name: str, value: Any, low: float | None = None, optional: bool = False, integer: bool = False) -> None:
    if optional and value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (low is not None and value < low):
        what = "a whole number" if integer else "a number"
        bound = f" of at least {low:g}" if low is not None else ""
        extra = " or null" if optional else ""
        raise UsageError(f"env.kwargs.{name}: expected {what}{bound}{extra}, got {value!r}.")


def make_factory(
    task: str,
    observation: str = "axtree",
    reward: str = "raw",
    invalid_action_reward: float = -1.0,
    max_actions: int | None = None,
    episode_time_s: float | None = None,
    scale: float = 1.0,
    wait_ms: int = 0,
    page_timeout_s: float = 20.0,
    **unknown: Any,
) -> Callable[[], MiniWobEnv]:
    """Check the task and the options at once (bad input fails before any stage), then make envs that
    share this process's browser."""
    if unknown:
        known = (
            "observation, reward, invalid_action_reward, max_actions, episode_time_s, scale, wait_ms, page_timeout_s"
        )
        raise UsageError(
            f"env.kwargs for miniwob:{task}: unknown option {sorted(unknown)[0]!r}; the options are {known}."
        )
    names = task_names()
    tasks = tuple(t.strip() for t in task.split(","))
    for one in tasks:
        if one not in names:
            close = difflib.get_close_matches(one, names, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else f" The tasks: {', '.join(names)}."
            raise UsageError(f"MiniWoB++ has no task {one!r}.{hint}")
    if len(set(tasks)) != len(tasks):
        raise UsageError(f"miniwob:{task} names a task twice; list each task of a mix once.")
    if observation not in OBSERVATIONS:
        raise UsageError(f"env.kwargs.observation: expected one of {', '.join(OBSERVATIONS)}, got {observation!r}.")
    drawn = [one for one in tasks if one in PIXEL_TASKS]
    if observation == "axtree" and drawn:
        raise UsageError(
            f"miniwob:{drawn[0]} is drawn in pixels, which an accessibility tree cannot show: use observation "
            "screenshot (or both)."
        )
    if reward not in REWARDS:
        raise UsageError(f"env.kwargs.reward: expected raw or discounted, got {reward!r}.")
    _number("invalid_action_reward", invalid_action_reward)
    _number("max_actions", max_actions, low=1, optional=True, integer=True)
    _number("episode_time_s", episode_time_s, low=0.1, optional=True)
    _number("scale", scale, low=0.25)
    _number("wait_ms", wait_ms, low=0, integer=True)
    _number("page_timeout_s", page_timeout_s, low=1)
    if reward == "discounted" and episode_time_s is None:
        episode_time_s = 10.0  # MiniWoB's own episode time: the discount needs one
    if importlib.util.find_spec("playwright") is None:
        raise UsageError("The miniwob: envs need playwright: pip install 'rlcli[web]'.")
    find_chromium()  # one sentence naming the install command when there is none
    options = Options(
        tasks,
        str(html_folder()),
        observation,
        reward,
        float(invalid_action_reward),
        max_actions,
        None if episode_time_s is None else float(episode_time_s),
        float(scale),
        wait_ms,
        float(page_timeout_s),
    )
    return lambda: MiniWobEnv(options)


# --- the page as text ------------------------------------------------------------------


@dataclass
class Node:
    """One line of the tree."""

    bid: str | None
    role: str
    name: str
    depth: int
    properties: list[str] = field(default_factory=list)

    def line(self) -> str:
        ident = f"[{self.bid}] " if self.bid else ""
        props = "".join(f", {p}" for p in self.properties)
        return "\t" * self.depth + f"{ident}{self.role} {self.name!r}{props}"


def _clean(text: Any) -> str:
    return " ".join(str(text or "").replace("\xa0", " ").split())


def read_tree(page: Any, cdp: Any) -> list[Node]:
    """The page's accessibility tree (Chrome's, through the DevTools protocol) as Nodes, with the bid
    of each element from a DOM snapshot; StaticText takes its element's bid when that element holds
    text alone (a link made of a span, say), so that it can be clicked."""
    page.evaluate(MARK_JS)
    snapshot = cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
    strings, nodes = snapshot["strings"], snapshot["documents"][0]["nodes"]
    parents: list[int] = nodes["parentIndex"]
    attributes = [
        {strings[pairs[k]]: strings[pairs[k + 1]] for k in range(0, len(pairs), 2)} for pairs in nodes["attributes"]
    ]
    node_types: list[int] = nodes["nodeType"]
    index = {backend: i for i, backend in enumerate(nodes["backendNodeId"])}
    element_children: dict[int, int] = {}
    for i, parent in enumerate(parents):
        if parent >= 0 and node_types[i] == 1:
            element_children[parent] = element_children.get(parent, 0) + 1

    def skipped(i: int | None) -> bool:
        while i is not None and i >= 0:
            if attributes[i].get("id") in SKIPPED_IDS:
                return True
            i = parents[i]
        return False

    tree = cdp.send("Accessibility.getFullAXTree")["nodes"]
    by_id = {n["nodeId"]: n for n in tree}
    out: list[Node] = []

    def walk(ax: dict, depth: int) -> None:
        role = ax.get("role", {}).get("value", "")
        name = _clean(ax.get("name", {}).get("value", ""))
        dom = index.get(ax.get("backendDOMNodeId"))
        if role == "InlineTextBox" or skipped(dom):
            return
        children = [by_id[c] for c in ax.get("childIds", []) if c in by_id]
        texts = [c for c in children if c.get("role", {}).get("value") == "StaticText"]
        # Shown: what is neither ignored nor a bare container; a text or label only with its words.
        shown = not ax.get("ignored", False) and role not in FOLDED_ROLES
        if shown and (name or role not in ("StaticText", "LabelText")):
            if role == "StaticText":
                owner = parents[dom] if dom is not None else -1
                bid = attributes[owner].get("bid") if owner >= 0 and not element_children.get(owner) else None
            else:
                bid = attributes[dom].get("bid") if dom is not None else None
            if not name and len(children) == 1 and texts:  # <label>Username</label>: the text is its name
                name, children = _clean(texts[0].get("name", {}).get("value", "")), []
            if len(children) == 1 and texts and _clean(texts[0].get("name", {}).get("value", "")) == name:
                children = []  # button 'Submit' and its StaticText 'Submit'
            out.append(Node(bid, role, name, depth, _properties(ax, role, depth)))
            depth += 1
            if role in ("textbox", "searchbox"):
                children = []  # the text typed in: its value says it
        for child in children:
            walk(child, depth)

    if tree:
        walk(tree[0], 0)
    return out


def _properties(ax: dict, role: str, depth: int) -> list[str]:
    props = []
    for prop in ax.get("properties", []):
        name, value = prop["name"], prop.get("value", {}).get("value")
        if name == "focused" and value is True and depth > 0:
            props.append("focused")
        elif name == "checked":
            props.append(f"checked={value}")
        elif name in ("selected", "disabled", "required") and value is True:
            props.append(name)
        elif name == "expanded":
            props.append(f"expanded={str(value).lower()}")
    value = _clean(ax.get("value", {}).get("value", ""))
    if value and role not in ("StaticText",):
        props.append(f"value={value!r}")
    return props


def tree_text(nodes: list[Node]) -> str:
    return "\n".join(n.line() for n in nodes)


# --- reading actions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    name: str
    args: tuple[Any, ...]

    def __str__(self) -> str:
        return f"{self.name}({', '.join(_show(a) for a in self.args)})"


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def parse_action(reply: str) -> Action:
    """The last BrowserGym-style call in the reply; ActionError says what is wrong with it."""
    calls = list(_CALL.finditer(reply))
    if not calls:
        raise ActionError("no action found in the reply")
    last = calls[-1]
    end = _closing(reply, last.end() - 1)
    if end is None:
        raise ActionError(f"{last.group(1)}( is never closed")
    source = reply[last.start() : end + 1]
    try:
        call = ast.parse(source, mode="eval").body
    except SyntaxError:
        raise ActionError(f"cannot read {source!r}: arguments must be quoted text or numbers") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.keywords:
        raise ActionError(f"cannot read {source!r}: write {last.group(1)}(...) with plain arguments")
    try:
        args = tuple(ast.literal_eval(arg) for arg in call.args)
    except ValueError:
        raise ActionError(f"cannot read {source!r}: arguments must be quoted text or numbers") from None
    name = call.func.id
    kinds = ACTIONS[name]
    if len(args) != len(kinds):
        raise ActionError(f"{name} takes {len(kinds)} argument{'s' if len(kinds) != 1 else ''}, got {len(args)}")
    checked: list[Any] = []
    for kind, arg in zip(kinds, args):
        if kind == "bid":
            if isinstance(arg, bool) or not isinstance(arg, (str, int)) or not _BID.match(str(arg)):
                raise ActionError(f'{name}: {arg!r} is not an element id such as "12"')
            checked.append(str(arg))
        elif kind == "text":
            if not isinstance(arg, str):
                raise ActionError(f"{name}: {arg!r} is not quoted text")
            checked.append(arg)
        elif kind == "options":
            if not (isinstance(arg, str) or (isinstance(arg, list) and all(isinstance(a, str) for a in arg))):
                raise ActionError(f"{name}: {arg!r} is not an option's text or a list of them")
            checked.append(arg)
        else:
            if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                raise ActionError(f"{name}: {arg!r} is not a number")
            checked.append(float(arg))
    return Action(name, tuple(checked))


def _closing(text: str, start: int) -> int | None:
    """The index of the parenthesis that closes the one at `start`, skipping quoted text."""
    depth, quote, escaped = 0, "", False
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
            if depth == 0:
                return i
    return None


# --- the env -------------------------------------------------------------------------------


class MiniWobEnv:
    """One episode of a MiniWoB++ task in this process's browser (see the module docstring)."""

    def __init__(self, options: Options):
        self.options = options
        self.host: Chromium | None = None
        self.page: Any = None
        self.generation = -1
        self.nodes: list[Node] = []
        self.utterance = ""
        self.actions = 0
        self.done = False
        self.task = options.tasks[0]
        # Looked up with getattr: an env whose tasks have no expert must not have the method.
        if all(task in EXPERTS for task in options.tasks):
            self.expert_action = self._expert_action

    # --- the protocol ---

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.host = shared_chromium()
        content = self._run(lambda browser: self._start(browser, seed))
        width, height = self.options.size
        system = {"axtree": AXTREE_SYSTEM, "screenshot": SCREENSHOT_SYSTEM, "both": BOTH_SYSTEM}[
            self.options.observation
        ]
        messages = [
            {"role": "system", "content": system.format(width=width, height=height)},
            {"role": "user", "content": content},
        ]
        return messages, {"task": {"task": self.task, "seed": seed, "utterance": self.utterance}}

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        if self.page is None or self.done:
            raise RuntimeError("call reset() before step(), and not after the episode ended")
        return self._run(lambda browser: self._step(action))

    def _expert_action(self) -> str:
        if self.page is None or self.done:
            raise RuntimeError("call reset() before expert_action(), and not after the episode ended")
        return self._run(lambda browser: self._expert())

    # --- on the browser's thread ---

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        assert self.host is not None
        page = self.page
        try:
            return self.host.run(fn, self.options.page_timeout_s)
        except Exception as exc:
            if page is not None and page in _crashed:
                raise PageCrashed(f"the page of miniwob:{self.task} crashed (its renderer process died)") from None
            if type(exc).__name__ == "TargetClosedError":
                raise BrowserGone(f"the browser this episode's page was in has gone ({exc})") from None
            raise

    def _start(self, browser: Any, seed: int) -> Any:
        assert self.host is not None
        self._close_page()
        page = _take_page(self.host, browser, self.options.scale)
        self.generation, host, generation, scale = (
            self.host.generation,
            self.host,
            self.host.generation,
            self.options.scale,
        )
        # A page the episode never gives back (cut off by env.max_turns) goes back when the env is dropped.
        self._finalizer = weakref.finalize(
            self, host.submit, lambda _browser: _give_back(host, generation, scale, page)
        )
        page.set_default_timeout(self.options.page_timeout_s * 1000)
        self.task = self.options.task(seed)
        page.goto(self.options.url(self.task), wait_until="load")
        max_time = (
            NO_TIME_LIMIT_MS if self.options.episode_time_s is None else round(self.options.episode_time_s * 1000)
        )
        page.evaluate(START_JS, {"hidden": list(HIDDEN_IDS), "seed": seed, "maxTime": max_time})
        if not page.evaluate("() => WOB_TASK_READY"):
            page.wait_for_function("() => WOB_TASK_READY")
        self.page, self.cdp = page, page.context.new_cdp_session(page)
        self.utterance = _clean(page.evaluate("() => core.getUtterance()"))
        self.actions, self.done = 0, False
        return self._observe("")

    def _step(self, reply: str) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        self._check_browser()
        self.actions += 1
        info: dict[str, Any] = {}
        before = self._page_state()
        if before[0]:  # the page ended the episode on its own (its timer, an event) before this action
            return self._end(before, info, "the page ended the episode before the action")
        error, point = "", None
        try:
            action = parse_action(reply)
            info["action"] = str(action)
            point = self._act(action)
        except ActionError as exc:
            error = str(exc)
        reward = 0.0
        if error:
            info["invalid_action"] = error
            reward = self.options.invalid_action_reward
        elif self.options.wait_ms:
            self.page.wait_for_timeout(self.options.wait_ms)
        if point is not None:
            info["click"] = [round(point[0], 1), round(point[1], 1)]
        state = self._page_state()
        if not self._on_task_page():
            state = (True, -1.0, -1.0, "the action left the task's page")
        if state[0]:
            messages, end_reward, terminated, truncated, end_info = self._end(state, info, "")
            return self._mark(messages, point), reward + end_reward, terminated, truncated, end_info
        if self.options.max_actions is not None and self.actions >= self.options.max_actions:
            out = (True, -1.0, -1.0, f"out of actions ({self.options.max_actions})")
            messages, end_reward, terminated, truncated, end_info = self._end(out, info, "")
            return self._mark(messages, point), reward + end_reward, terminated, truncated, end_info
        before_text = f"Invalid action: {error}." if error else ""
        content = self._observe(before_text)
        return self._mark([{"role": "user", "content": content}], point), reward, False, False, info

    def _end(
        self, state: tuple, info: dict[str, Any], why: str
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict]:
        _, raw, discounted, reason = state
        raw = float(raw or 0.0)
        reward = raw if self.options.reward == "raw" else float(discounted or 0.0)
        self.done = True
        info = {**info, "success": raw > 0, "raw_reward": raw, "reward_reason": reason}
        words = f"The episode is over: reward {reward:g}" + (f" ({reason})" if reason else "") + "."
        if why:
            words = f"{why[0].upper()}{why[1:]}. {words}"
        self._close_page()
        return [{"role": "user", "content": words}], reward, True, False, info

    def _mark(self, messages: list[dict[str, Any]], point: tuple[float, float] | None) -> list[dict[str, Any]]:
        """With screenshots, the message after an action that clicked says where, in the pixels of the
        screenshot it was chosen on: the HTML episode page marks it there."""
        if point is not None and self.options.image and messages:
            messages[0]["click"] = [round(point[0], 1), round(point[1], 1)]
        return messages

    def _observe(self, before: str) -> Any:
        self.nodes = read_tree(self.page, self.cdp)
        text = "\n".join(t for t in (before, f"Task: {self.utterance}") if t)
        if self.options.tree:
            text += "\n" + tree_text(self.nodes)
        if not self.options.image:
            return text
        from PIL import Image

        png = self.page.screenshot(type="png", animations="disabled", caret="hide")
        image = Image.open(io.BytesIO(png)).convert("RGB")
        return [{"type": "text", "text": text}, {"type": "image", "image": image}]

    def _page_state(self) -> tuple[bool, float, float, str | None]:
        done, raw, discounted, reason = self.page.evaluate(STATE_JS)
        return bool(done), raw, discounted, reason

    def _on_task_page(self) -> bool:
        return str(self.page.url).split("#")[0] == self.options.url(self.task)

    def _check_browser(self) -> None:
        assert self.host is not None
        if self.host.generation != self.generation:
            raise BrowserGone("the browser this episode's page was in died or was restarted (another page hung?)")

    def _close_page(self) -> None:
        """Give the episode's page back for the next episode (on the browser's thread)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None and finalizer.alive:
            finalizer.detach()
            assert self.host is not None
            with contextlib.suppress(Exception):
                self.cdp.detach()
            _give_back(self.host, self.generation, self.options.scale, self.page)
        self.page = None

    def _act(self, action: Action) -> tuple[float, float] | None:
        """Carry out an action; where it clicked, in screenshot pixels (None for other actions)."""
        name, args, page, scale = action.name, action.args, self.page, self.options.scale
        try:
            if name == "noop":
                return None
            if name in ("scroll",):
                page.mouse.wheel(args[0], args[1])
                return None
            if name.startswith("mouse_"):
                xs = [a / scale for a in args]
                width, height = self.options.size
                for x, y in zip(args[::2], args[1::2]):
                    if not (0 <= x < width and 0 <= y < height):
                        raise ActionError(f"({x:g}, {y:g}) is outside the {width}x{height} screenshot")
                if name == "mouse_click":
                    page.mouse.click(xs[0], xs[1])
                    return args[0], args[1]
                if name == "mouse_dblclick":
                    page.mouse.dblclick(xs[0], xs[1])
                    return args[0], args[1]
                if name == "mouse_move":
                    page.mouse.move(xs[0], xs[1])
                    return None
                page.mouse.move(xs[0], xs[1])
                page.mouse.down()
                page.mouse.move(xs[2], xs[3], steps=5)
                page.mouse.up()
                return None
            if name == "keyboard_type":
                page.keyboard.type(args[0])
                return None
            if name == "keyboard_press":
                page.keyboard.press(args[0])
                return None
            element = self._element(args[0])
            point = None
            if name in ("click", "dblclick"):
                point, spot = _click_point(element, scale)
                clicker = element.click if name == "click" else element.dblclick
                clicker(timeout=ACTION_TIMEOUT_MS, **({"position": spot} if spot else {}))
            elif name == "hover":
                element.hover(timeout=ACTION_TIMEOUT_MS)
            elif name == "focus":
                element.focus(timeout=ACTION_TIMEOUT_MS)
            elif name == "clear":
                element.clear(timeout=ACTION_TIMEOUT_MS)
            elif name == "fill":
                element.fill(args[1], timeout=ACTION_TIMEOUT_MS)
            elif name == "press":
                element.press(args[1], timeout=ACTION_TIMEOUT_MS)
            elif name == "select_option":
                element.select_option(label=args[1], timeout=ACTION_TIMEOUT_MS)
            elif name == "drag_and_drop":
                element.drag_to(self._element(args[1]), timeout=ACTION_TIMEOUT_MS)
            return point
        except ActionError:
            raise
        except Exception as exc:
            if type(exc).__name__ not in ("Error", "TimeoutError"):  # playwright's: the page refused the action
                raise
            if "Target crashed" in str(exc) or "has been closed" in str(exc):
                raise  # the page or browser is gone: the episode fails
            raise ActionError(f"{action}: {_playwright_reason(exc)}") from None

    def _element(self, bid: str) -> Any:
        element = self.page.locator(f'[bid="{bid}"]')
        if element.count() == 0:
            raise ActionError(f'there is no element with id "{bid}" on the page')
        return element.first

    # --- the expert ---

    def _expert(self) -> str:
        self._check_browser()
        fields = {f["bid"]: f for f in self.page.evaluate(FIELDS_JS) if f["bid"]}
        move = EXPERTS[self.task](Page(self.utterance, self.nodes, fields))
        if self.options.tree:
            return str(move)
        # Screenshots only: click where the element is; type into a field after clicking it.
        if move.name in ("fill",):
            bid, text = move.args
            if fields.get(bid, {}).get("focused"):
                return str(Action("keyboard_type", (text,)))
            return self._click_at(bid)
        if move.name == "click":
            return self._click_at(move.args[0])
        raise RuntimeError(f"the miniwob:{self.task} expert has no screenshot form of {move}")

    def _click_at(self, bid: str) -> str:
        point, _ = _click_point(self._element(bid), self.options.scale)
        if point is None:
            raise RuntimeError(f'the expert\'s element "{bid}" is not visible')
        return str(Action("mouse_click", (float(round(point[0])), float(round(point[1])))))


def _click_point(element: Any, scale: float) -> tuple[tuple[float, float] | None, dict[str, float] | None]:
    """Where a click on the element lands, in screenshot pixels (None: it has no box), and the offset
    in the element to click at when its centre is covered (VISIBLE_POINT_JS; None: the centre)."""
    box = element.bounding_box(timeout=ACTION_TIMEOUT_MS)
    if box is None:
        return None, None
    spot = element.evaluate(VISIBLE_POINT_JS)
    x, y = (spot["x"], spot["y"]) if spot else (box["width"] / 2, box["height"] / 2)
    return ((box["x"] + x) * scale, (box["y"] + y) * scale), spot


# Pages free for the next episode, by browser and scale; only the browser's thread touches them. A
# fresh page costs a renderer process (a few hundred ms); each episode loads its task page anew, so
# nothing of an earlier episode is left in it (MiniWoB's pages keep no storage).
_idle_pages: dict[tuple[int, float], list[Any]] = {}
_crashed: weakref.WeakSet[Any] = weakref.WeakSet()  # pages whose renderer crashed: never reused
MAX_IDLE_PAGES = 8


def _take_page(host: Chromium, browser: Any, scale: float) -> Any:
    for key in [k for k in _idle_pages if k[0] != host.generation]:
        del _idle_pages[key]  # pages of a browser that is gone
    idle = _idle_pages.get((host.generation, scale), [])
    while idle:
        page = idle.pop()
        if not page.is_closed():
            return page
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, device_scale_factor=scale)
    page = context.new_page()
    page.on("crash", _crashed.add)
    return page


def _give_back(host: Chromium, generation: int, scale: float, page: Any) -> None:
    if page is None or generation != host.generation:
        return
    with contextlib.suppress(Exception):  # a page that crashed or closed is left alone
        if page.is_closed():
            return
        if page in _crashed:
            page.context.close()
            return
        idle = _idle_pages.setdefault((generation, scale), [])
        if len(idle) < MAX_IDLE_PAGES:
            idle.append(page)
        else:
            page.context.close()


_ROUTINE_STEPS = (
    "waiting",
    "retrying",
    "scrolling",
    "done scrolling",
    "attempting",
    "locator resolved",
    "element is visible",
)


def _playwright_reason(exc: Exception) -> str:
    """playwright's error in a line: its first line, and the last telling step of its call log."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0].split(": ", 1)[-1] if lines else type(exc).__name__
    steps = [re.sub(r"^(\d+ × )?- ", "", line).strip() for line in lines[1:]]
    telling = [step for step in steps if step and not step.startswith(_ROUTINE_STEPS) and step != "Call log:"]
    reason = f"{first} ({telling[-1]})" if telling else first
    return reason[:300]


# --- experts -------------------------------------------------------------------------------


@dataclass
class Page:
    """What an expert reads: the task, the tree, and the form fields' values by bid."""

    utterance: str
    nodes: list[Node]
    fields: dict[str, dict[str, Any]]

    def find(self, role: str | tuple[str, ...], name: str | None = None) -> Node:
        roles = (role,) if isinstance(role, str) else role
        for node in self.nodes:
            if node.role in roles and node.bid and (name is None or node.name == name):
                return node
        raise RuntimeError(f"the page has no {'/'.join(roles)}" + (f" named {name!r}" if name else ""))

    def all(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role and n.bid]

    def quoted(self, pattern: str) -> list[str]:
        found = re.fullmatch(pattern, self.utterance)
        if found is None:
            raise RuntimeError(f"the expert cannot read the task {self.utterance!r}")
        return list(found.groups())

    def value(self, node: Node) -> str:
        return str(self.fields.get(node.bid or "", {}).get("value", ""))

    def checked(self, node: Node) -> bool:
        return bool(self.fields.get(node.bid or "", {}).get("checked"))


def _click(node: Node) -> Action:
    return Action("click", (node.bid,))


def _fill_then(page: Page, pairs: list[tuple[Node, str]], submit: Node) -> Action:
    """Fill each field that does not hold its text yet, in order; then click submit."""
    for node, text in pairs:
        if page.value(node) != text:
            return Action("fill", (node.bid, text))
    return _click(submit)


def _after_label(page: Page, label: str) -> Node:
    """The first textbox after the line whose name is `label` (a form's <label>Username</label>)."""
    seen = False
    for node in page.nodes:
        if node.name == label and node.role != "textbox":
            seen = True
        elif seen and node.role == "textbox" and node.bid:
            return node
    raise RuntimeError(f"the page has no text field after {label!r}")


def _click_test(page: Page) -> Action:
    return _click(page.find("button"))


def _click_test_2(page: Page) -> Action:
    [name] = page.quoted(r"Click button (\w+)\.")
    return _click(page.find("button", name))


def _click_button(page: Page) -> Action:
    [name] = page.quoted(r'Click on the "(.*)" button\.')
    return _click(page.find("button", name))


def _click_link(page: Page) -> Action:
    [name] = page.quoted(r'Click on the link "(.*)"\.')
    return _click(page.find(("link", "StaticText"), name))


def _click_dialog(page: Page) -> Action:
    return _click(page.find("button", "Close"))


def _click_tab(page: Page) -> Action:
    [number] = page.quoted(r"Click on Tab #(\d+)\.")
    return _click(page.find(("link", "tab"), f"Tab #{number}"))


def _enter_text(page: Page) -> Action:
    [text] = page.quoted(r'Enter "(.*)" into the text field and press Submit\.')
    return _fill_then(page, [(page.find("textbox"), text)], page.find("button", "Submit"))


def _enter_password(page: Page) -> Action:
    [text] = page.quoted(r'Enter the password "(.*)" into both text fields and press submit\.')
    first, second = page.all("textbox")[:2]
    return _fill_then(page, [(first, text), (second, text)], page.find("button", "Submit"))


def _login_user(page: Page) -> Action:
    user, password = page.quoted(
        r'Enter the username "(.*)" and the password "(.*)" into the text fields and press login\.'
    )
    pairs = [(_after_label(page, "Username"), user), (_after_label(page, "Password"), password)]
    return _fill_then(page, pairs, page.find("button", "Login"))


def _focus_text(page: Page) -> Action:
    return _click(page.find("textbox"))


def _focus_text_2(page: Page) -> Action:
    [ordinal] = page.quoted(r"Focus into the (\d+)(?:st|nd|rd|th) input textbox\.")
    boxes = page.all("textbox")
    return _click(boxes[int(ordinal) - 1])


def _click_checkboxes(page: Page) -> Action:
    [wanted] = page.quoted(r"Select (.*) and click Submit\.")
    names = set() if wanted == "nothing" else {n.strip() for n in wanted.split(",")}
    for box in page.all("checkbox"):
        if page.checked(box) != (box.name in names):
            return _click(box)
    return _click(page.find("button", "Submit"))


def _click_option(page: Page) -> Action:
    [wanted] = page.quoted(r"Select (.*) and click Submit\.")
    option = page.find("radio", wanted)
    return _click(option) if not page.checked(option) else _click(page.find("button", "Submit"))


EXPERTS: dict[str, Callable[[Page], Action]] = {
    "click-test": _click_test,
    "click-test-2": _click_test_2,
    "click-button": _click_button,
    "click-link": _click_link,
    "click-dialog": _click_dialog,
    "click-tab": _click_tab,
    "enter-text": _enter_text,
    "enter-password": _enter_password,
    "login-user": _login_user,
    "focus-text": _focus_text,
    "focus-text-2": _focus_text_2,
    "click-checkboxes": _click_checkboxes,
    "click-option": _click_option,
}
