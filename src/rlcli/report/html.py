"""`rlcli runs episodes --html`: the chosen episodes as one self-contained HTML page.

Screenshots are inlined as base64 PNGs from the run database, so the page can be mailed or opened
offline. A reply holding `click(x, y)` (pixels of the screenshot, as gui_click asks; miniwob's
`mouse_click(x, y)` too), or answered by a message recording its `click` [x, y] (where miniwob's
`click("12")` landed), gets a marker on the last screenshot shown before it: where the model clicked
on what it saw.
"""

from __future__ import annotations

import base64
import html
import re
from typing import Any

from rlcli.report.tables import fmt
from rlcli.report.text import tool_call_note

CLICK = re.compile(r"click\(\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*\)", re.I)
MIN_SHOWN_WIDTH = 320  # small screenshots are scaled up by a whole factor, pixels kept sharp

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }
section { border: 2px solid #4a6fb5; border-radius: 6px; padding: 0.5em 1em; margin-bottom: 2em; }
section.success { border-color: #2e8b57; } section.failed { border-color: #c0392b; }
h2 { font-size: 1.05em; } .facts, .note { color: #555; font-size: 0.9em; } .error { color: #c0392b; }
table.rewards { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
table.rewards td, table.rewards th { border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: left; }
.message { display: grid; grid-template-columns: 6em 1fr; gap: 0.5em; margin: 0.6em 0; }
.role { font-weight: bold; } .role.user { color: #117a8b; } .role.assistant { color: #2e8b57; }
.role.system { color: #888; } .role.tool { color: #8e44ad; }
.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.9em; }
.shot { position: relative; display: inline-block; margin: 0.3em 0; border: 1px solid #999; }
.shot img { display: block; image-rendering: pixelated; }
.click { position: absolute; width: 14px; height: 14px; margin: -9px 0 0 -9px; border: 2px solid #e00;
  border-radius: 50%; box-shadow: 0 0 0 1px #fff; }
.click span { position: absolute; left: 16px; top: -6px; font: bold 11px sans-serif; color: #e00;
  background: #fff; padding: 0 2px; }
.absent { display: inline-block; padding: 1em; border: 1px dashed #999; color: #777; }
"""


def episodes_page(run: str, episodes: list[dict[str, Any]], pngs: dict[str, bytes]) -> str:
    """The page for episodes as views.select_episodes gives them; `pngs` holds their stored images by sha256."""
    title = f"{run}: {len(episodes)} episode{'s' if len(episodes) != 1 else ''}"
    body = "\n".join(episode_section(ep, pngs, branches_of(episodes).get(ep["id"], [])) for ep in episodes)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body><h1>{_e(title)}</h1>\n{body}\n</body></html>\n"
    )


def branches_of(episodes: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """grpo.branch: the branches among `episodes` by their parent's id, in the order of their turn."""
    out: dict[int, list[dict[str, Any]]] = {}
    for ep in episodes:
        if ep.get("parent_episode_id") is not None:
            out.setdefault(ep["parent_episode_id"], []).append(ep)
    return {parent: sorted(children, key=lambda ep: ep["branch_turn"]) for parent, children in out.items()}


def episode_section(ep: dict[str, Any], pngs: dict[str, bytes], branches: list[dict[str, Any]] | None = None) -> str:
    """One episode (views.select_episodes) as a <section>: its facts, reward components and transcript,
    with its screenshots inline and clicks marked; the page needs STYLE. `runs report` shows these too.
    grpo.branch: a branch names its parent and turn; `branches` (this episode's, on the page) are
    listed under the parent's turn each branched from, linked."""
    title = f"episode {ep['id']} · {ep['stage']} · task {ep['task_index']} sample {ep['sample_index']}"
    if ep["reward"] is not None:
        title += f" · reward {fmt(ep['reward'])}"
    facts = (
        f"status {ep['status']} · end {ep['end_reason'] or '–'} · success {'yes' if ep['success'] else 'no'} · "
        f"return {fmt(ep['env_return'])} · turns {ep['num_turns']} · tokens {ep['num_tokens']} · policy {ep['policy']}"
    )
    out = [f"<h2>{_e(title)}</h2>", f'<p class="facts">{_e(facts)}</p>']
    if ep.get("parent_episode_id") is not None:
        parent, turn = ep["parent_episode_id"], ep["branch_turn"]
        out.append(
            f'<p class="facts">branch of <a href="#episode-{parent}">episode {parent}</a> from its turn {turn} '
            f"(the turns before it replay the parent's)</p>"
        )
    if ep["error"]:
        out.append(f'<p class="error">error: {_e(ep["error"])}</p>')
    if ep["rewards"]:
        rows = "".join(
            f"<tr><td>{_e(name)}</td><td>{fmt(r['value'])}</td><td>{fmt(r['weight'])}</td>"
            f"<td>{_e(r['error'] or '')}</td></tr>"
            for name, r in ep["rewards"].items()
        )
        out.append(
            f'<table class="rewards"><caption>rewards ({_e(ep["label_set"])})</caption>'
            f"<tr><th>component</th><th>value</th><th>weight</th><th>note</th></tr>{rows}</table>"
        )
    out += _messages(ep["messages"], pngs)
    if branches:
        items = "".join(
            f'<li>turn {b["branch_turn"]}: <a href="#episode-{b["id"]}">episode {b["id"]}</a>'
            + ("" if b["reward"] is None else f" · reward {fmt(b['reward'])}")
            + "</li>"
            for b in branches
        )
        out.append(f'<p class="facts">branches</p><ul class="branches">{items}</ul>')
    kind = "failed" if ep["status"] == "failed" else "success" if ep["success"] else "episode"
    return f'<section class="{kind}" id="episode-{ep["id"]}">\n' + "\n".join(out) + "\n</section>"


def _messages(messages: list[dict[str, Any]], pngs: dict[str, bytes]) -> list[str]:
    """Each message as a row; clicks are drawn on the screenshot they answer, so the clicks are
    gathered first: reply n's click belongs to the last image shown before reply n."""
    clicks: dict[int, list[tuple[int, float, float]]] = {}  # index of an image among all -> (reply, x, y)
    notes: dict[int, str] = {}  # message index -> what became of its click
    images_seen, reply = 0, 0
    sizes: list[tuple[int, int] | None] = []
    for i, m in enumerate(messages):
        for part in _content(m):
            if part.get("type") == "image":
                images_seen += 1
                sizes.append((part["width"], part["height"]) if part.get("sha256") in pngs else None)
        if m.get("role") != "assistant":
            continue
        reply += 1
        point = _click_of(m, messages[i + 1] if i + 1 < len(messages) else None)
        if point is None:
            continue
        x, y = point
        shown = sizes[-1] if sizes else None
        if shown is None:
            notes[i] = "no screenshot shown before this click" if not sizes else "its screenshot is not stored"
        elif not (0 <= x < shown[0] and 0 <= y < shown[1]):
            notes[i] = f"click ({fmt(x)}, {fmt(y)}) is outside the {shown[0]}x{shown[1]} screenshot"
        else:
            clicks.setdefault(images_seen - 1, []).append((reply, x, y))
            notes[i] = f"click {reply} ({fmt(x)}, {fmt(y)}) is marked on the screenshot above"

    rows, image_index = [], 0
    for i, m in enumerate(messages):
        role = m.get("role", "?")
        cells = []
        for part in _content(m):
            if part.get("type") == "image":
                cells.append(_image(part, pngs, clicks.get(image_index, [])))
                image_index += 1
            elif part.get("text"):
                cells.append(f'<div class="text">{_e(part["text"])}</div>')
        if m.get("tool_calls"):
            cells.append(f'<div class="text note">tool calls: {_e(str(m["tool_calls"]))}</div>')
        if note := tool_call_note(m):
            cells.append(f'<div class="text note">{_e(note)}</div>')
        if i in notes:
            cells.append(f'<div class="note">{_e(notes[i])}</div>')
        rows.append(
            f'<div class="message"><div class="role {_e(role)}">{_e(role)}</div><div>{"".join(cells)}</div></div>'
        )
    return rows


def _click_of(reply: dict[str, Any], answer: dict[str, Any] | None) -> tuple[float, float] | None:
    """Where a reply clicked: the `click` [x, y] that the env's next message records (miniwob: says
    where click("12") landed), else a `click(x, y)` in the reply's text."""
    recorded = answer.get("click") if answer is not None else None
    if isinstance(recorded, list) and len(recorded) == 2 and all(isinstance(v, (int, float)) for v in recorded):
        return float(recorded[0]), float(recorded[1])
    found = CLICK.search(_text(reply))
    return (float(found.group(1)), float(found.group(2))) if found else None


def _image(part: dict[str, Any], pngs: dict[str, bytes], clicks: list[tuple[int, float, float]]) -> str:
    sha = part.get("sha256")
    if sha is None:
        return '<div class="absent">image not stored: the policy of this run read text only</div>'
    if sha not in pngs:
        return f'<div class="absent">image {_e(sha[:12])} is missing from the run database</div>'
    width, height = part["width"], part["height"]
    scale = max(1, MIN_SHOWN_WIDTH // width)
    data = base64.b64encode(pngs[sha]).decode("ascii")
    # Markers sit at percentages of the picture, so they stay on the clicked pixel at any scale.
    markers = "".join(
        f'<div class="click" style="left:{100 * (x + 0.5) / width:.3f}%;top:{100 * (y + 0.5) / height:.3f}%" '
        f'title="reply {reply}: click({fmt(x)}, {fmt(y)})"><span>{reply}</span></div>'
        for reply, x, y in clicks
    )
    return (
        f'<div class="shot" title="image {sha[:12]} · {width}x{height}">'
        f'<img src="data:image/png;base64,{data}" width="{width * scale}" height="{height * scale}" '
        f'alt="screenshot {sha[:12]}">{markers}</div>'
    )


def _content(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, list):
        return [p for p in content if isinstance(p, dict)]
    return [{"type": "text", "text": content}] if content else []


def _text(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in _content(message) if p.get("type") != "image")


def _e(value: Any) -> str:
    return html.escape(str(value))
