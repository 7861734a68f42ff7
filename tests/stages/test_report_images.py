"""`rlcli runs episodes` on episodes with image observations: markers in the terminal view and the
--html page with the stored screenshots inline and the model's clicks marked on them."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
from html.parser import HTMLParser

import pytest

from helpers import cli
from rlcli.recipe import Recipe
from rlcli.store.db import RunDB
from rlcli.store.episodes import store_episodes
from rlcli.store.records import EndReason, Episode, Turn


def screenshot(seed: int):
    """A real gui_click screen, its PNG and sha256, and the expert's click."""
    from rlcli.envs.loading import load_env
    from rlcli.models.vision import png_bytes

    env = load_env("gui_click", {"width": 112, "height": 96, "buttons": 2})()
    messages, info = env.reset(seed)
    data = png_bytes(messages[1]["content"][1]["image"])
    return data, hashlib.sha256(data).hexdigest(), env.expert_action()


def episode(run: str, sample: int, messages: list[dict], pngs: dict[str, bytes], images: list[str]) -> Episode:
    turn = Turn(0, [1, 2, 3], [4], [-0.5], reward=1.0, text="", images=images)
    return Episode(
        id=None,
        run=run,
        stage="rollout/0",
        iteration=0,
        split="train",
        task_index=0,
        sample_index=sample,
        seed=0,
        policy="base",
        status="ok",
        end_reason=EndReason.TERMINATED,
        env_return=1.0,
        success=True,
        num_turns=len(images),
        num_tokens=1,
        task={},
        messages=messages,
        template_consistent=True,
        error=None,
        created_at="2025-01-01T00:00:00+00:00",
        turns=[turn],
        images=pngs,
    )


@pytest.fixture
def runs_dir(rlcli_home, tmp_path, monkeypatch):
    """Run `vis`: episode 1 a two-attempt gui_click episode of a vision-language model (a miss on the
    first screenshot, the expert's click on the second, and one click off the screen); episode 2 a
    text model's, whose image was never stored."""
    monkeypatch.chdir(tmp_path)
    first, sha1, _ = screenshot(1)
    second, sha2, expert = screenshot(2)
    rundb = RunDB.open(rlcli_home)
    rundb.start_run("vis", Recipe(), None)
    messages = [
        {"role": "system", "content": "Click what you are asked to."},
        {"role": "user", "content": [{"type": "text", "text": "Click Save."}, {"type": "image", "sha256": sha1}]},
        {"role": "assistant", "content": "click(10, 20)"},
        {"role": "user", "content": [{"type": "text", "text": "Missed."}, {"type": "image", "sha256": sha2}]},
        {"role": "assistant", "content": f"I see it: {expert}"},
        {"role": "user", "content": "Once more, off the screen."},
        {"role": "assistant", "content": "click(500, 5)"},
    ]
    text_only = [
        {"role": "user", "content": [{"type": "text", "text": "Click Open."}, {"type": "image"}]},
        {"role": "assistant", "content": "click(3, 4)"},
    ]
    store_episodes(
        rundb,
        [
            episode("vis", 0, messages, {sha1: first, sha2: second}, [sha1, sha2]),
            episode("vis", 1, text_only, {}, []),
        ],
    )
    rundb.close()
    return {"sha1": sha1, "sha2": sha2, "first": first, "second": second, "expert": expert}


class Page(HTMLParser):
    """The screenshots of a page, each with the click markers drawn on it."""

    def __init__(self):
        super().__init__()
        self.shots: list[dict] = []
        self.depth = 0  # divs open inside the current screenshot

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "shot":
            self.shots.append({"img": None, "clicks": []})
            self.depth = 1
        elif tag == "div" and self.depth:
            self.depth += 1
            if attrs.get("class") == "click":
                left, top = re.findall(r"([\d.]+)%", attrs["style"])
                self.shots[-1]["clicks"].append((float(left), float(top)))
        elif tag == "img" and self.depth:
            self.shots[-1]["img"] = attrs

    def handle_endtag(self, tag):
        if tag == "div" and self.depth:
            self.depth -= 1


def test_terminal_view_and_json_show_image_turns(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "episodes", "vis")
    assert code == 0
    assert f"Click Save. [image {runs_dir['sha1'][:6]}… 112x96]" in out
    assert f"[image {runs_dir['sha2'][:6]}… 112x96]" in out
    assert "Click Open. [image, not stored]" in out
    assert "end terminated" in out  # the stored value, not the enum's name
    code, out, _ = cli(capsys, "runs", "episodes", "vis", "--json")
    first = next(e for e in json.loads(out) if e["sample_index"] == 0)["messages"][1]["content"][1]
    assert first == {"type": "image", "sha256": runs_dir["sha1"], "width": 112, "height": 96}


def test_html_page_inlines_screenshots_and_marks_clicks(capsys, runs_dir, tmp_path):
    from PIL import Image

    page_path = tmp_path / "out" / "episodes.html"
    code, out, err = cli(capsys, "runs", "episodes", "vis", "--html", page_path)
    assert code == 0, err
    assert out.strip() == str(page_path)
    text = page_path.read_text()
    page = Page()
    page.feed(text)
    assert len(page.shots) == 2
    for shot, png in zip(page.shots, (runs_dir["first"], runs_dir["second"])):
        data = base64.b64decode(shot["img"]["src"].removeprefix("data:image/png;base64,"))
        assert data == png  # the stored PNG itself, nothing fetched from elsewhere
        assert Image.open(io.BytesIO(data)).size == (112, 96)
        assert int(shot["img"]["width"]) == 112 * 2  # small screenshots are scaled up by a whole factor
    # The miss is marked on the first screenshot, the expert's click on the second, at their pixels.
    assert page.shots[0]["clicks"] == [pytest.approx((100 * 10.5 / 112, 100 * 20.5 / 96), abs=1e-3)]
    x, y = map(float, re.findall(r"\d+", runs_dir["expert"]))
    assert page.shots[1]["clicks"] == [pytest.approx((100 * (x + 0.5) / 112, 100 * (y + 0.5) / 96), abs=1e-3)]
    assert "click (500, 5) is outside the 112x96 screenshot" in text
    # The text model's episode: its image was never stored, so its click has nothing to go on.
    assert "image not stored" in text and "its screenshot is not stored" in text
    assert "http" not in text.replace("<!DOCTYPE html>", "")  # self-contained: nothing to fetch


def test_html_never_replaces_a_file_unasked(capsys, runs_dir, tmp_path):
    page_path = tmp_path / "mine.html"
    page_path.write_text("my notes")
    code, _, err = cli(capsys, "runs", "episodes", "vis", "--html", page_path)
    assert code == 2 and "pass --overwrite" in err
    assert page_path.read_text() == "my notes"
    code, _, err = cli(capsys, "runs", "episodes", "vis", "--html", page_path, "--overwrite")
    assert code == 0 and page_path.read_text().startswith("<!DOCTYPE html>")
    assert list(tmp_path.glob(".mine.html.*")) == []  # no temporary file left behind
    code, _, err = cli(capsys, "runs", "episodes", "vis", "--html", tmp_path)
    assert code == 2 and "it is a folder" in err
    code, _, err = cli(capsys, "runs", "episodes", "vis", "--html", tmp_path / "x.html", "--json")
    assert code == 2 and "exclude each other" in err


def test_html_never_writes_through_a_planted_symlink(capsys, runs_dir, tmp_path):
    # The temporary page was named .<name>.<pid>.partial: a symlink planted there redirected the write.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    page_path = tmp_path / "page.html"
    planted = tmp_path / f".page.html.{os.getpid()}.partial"
    planted.symlink_to(victim)
    code, _, err = cli(capsys, "runs", "episodes", "vis", "--html", page_path)
    assert code == 0, err
    assert victim.read_text() == "precious" and page_path.read_text().startswith("<!DOCTYPE html>")
    assert planted.is_symlink() and not page_path.is_symlink()
    assert sorted(p.name for p in tmp_path.glob(".page.html.*")) == [planted.name]


def test_html_of_a_vision_language_rollout(capsys, rlcli_home, tmp_path, monkeypatch):
    """End to end: tiny-random-vlm's expert rollout on gui_click stores its screenshots, and the page
    shows them with the expert's click on the centre of the target's box."""
    from helpers import make_ctx, write_recipe
    from rlcli.engine.rollout import run_rollout_stage

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "vlm", "seed": 0},
        model={"name": "tiny-random-vlm", "max_length": 1024},
        env={"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2}},
        rollout={"tasks": 2, "group_size": 1, "max_new_tokens": 6, "batch_size": 2},
    )
    ctx = make_ctx(recipe, rlcli_home)
    run_rollout_stage(ctx, stage="demo", policy="expert", split="train")
    ctx.rundb.close()
    code, out, _ = cli(capsys, "runs", "episodes", "vlm", "--json")
    episodes = json.loads(out)
    assert code == 0 and len(episodes) == 2
    code, _, err = cli(capsys, "runs", "episodes", "vlm", "--html", tmp_path / "p.html")
    assert code == 0, err
    page = Page()
    page.feed((tmp_path / "p.html").read_text())
    assert len(page.shots) == 2
    for episode, shot in zip(episodes, page.shots):
        image = episode["messages"][1]["content"][1]
        assert (image["width"], image["height"]) == (112, 112)
        x0, y0, x1, y1 = episode["task"]["box"]
        centre = (100 * ((x0 + x1) // 2 + 0.5) / 112, 100 * ((y0 + y1) // 2 + 0.5) / 112)
        assert shot["clicks"] == [pytest.approx(centre, abs=1e-3)]
