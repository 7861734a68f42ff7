"""miniwob:<task> in a real headless Chromium: every expert solves its task, seeded pages, the three
observation modes, BrowserGym's actions and invalid ones, MiniWoB's rewards, a screenshot reaching
the tiny VLM and the HTML page marking its clicks, a hanging or crashing page, browsers living and
dying with env workers and with a kill -9'd rlcli (counted), the resume equal to an uninterrupted
rollout, and bad input refused in one sentence before any stage."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import pytest

from browser import chromium_executable
from helpers import REPO, cli, kill_at_event, run_in_process, write_recipe

pytest.importorskip("playwright")
if chromium_executable() is None:
    pytest.skip("no Chromium binary: `make browser` installs Debian's chromium", allow_module_level=True)
if __import__("importlib.util").util.find_spec("miniwob") is None:
    pytest.skip("the miniwob package is not installed: pip install 'rlcli[web]'", allow_module_level=True)

from rlcli.envs.adapters.miniwob import EXPERTS, ActionError, PageCrashed, parse_action  # noqa: E402
from rlcli.envs.browser import BrowserGone, Chromium, PageTimeout  # noqa: E402
from rlcli.envs.loading import load_env  # noqa: E402
from rlcli.envs.workers import EnvWorkerPool  # noqa: E402


def play_expert(name: str, seed: int, max_steps: int = 10, **kwargs):
    env = load_env(f"miniwob:{name}", kwargs)()
    observation, info = env.reset(seed)
    steps, total = [], 0.0
    for _ in range(max_steps):
        action = env.expert_action()
        observation, reward, terminated, truncated, info = env.step(action)
        steps.append(action)
        total += reward
        if terminated or truncated:
            break
    return steps, total, info, observation


def text_of(observation) -> str:
    content = observation[-1]["content"] if isinstance(observation, list) else observation
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content


# --- experts, seeds, observations ------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(EXPERTS))
def test_each_expert_solves_its_task_in_a_real_browser(task):
    steps, total, info, _ = play_expert(task, seed=3)
    assert info["success"] and total == 1.0 and info["raw_reward"] == 1.0, (steps, info)
    assert all(re.fullmatch(r'(click|fill)\("\d+"(, ".*")?\)', s) for s in steps), steps
    # With screenshots alone the expert clicks by coordinates and types into the focused field.
    steps, total, info, _ = play_expert(task, seed=4, observation="screenshot")
    assert info["success"] and total == 1.0, (steps, info)
    assert all(re.fullmatch(r'mouse_click\(\d+, \d+\)|keyboard_type\(".*"\)', s) for s in steps), steps


def test_envs_try_solves_click_button_with_the_expert(capsys):
    code, out, err = cli(capsys, "envs", "try", "miniwob:click-button", "--policy", "expert", "--seed", "2")
    assert code == 0, err
    assert "Task: Click on the" in out and "solved in 1 turns, return 1" in out


def test_the_same_seed_gives_the_same_page_and_the_three_observation_modes():
    factory = load_env("miniwob:login-user", {"observation": "both", "scale": 1.5})
    first, again, other = factory(), factory(), factory()
    (system, user), info = first.reset(7)
    (_, user_again), _ = again.reset(7)
    (_, user_other), info_other = other.reset(8)
    assert info["task"]["task"] == "login-user" and info["task"]["seed"] == 7
    utterance = info["task"]["utterance"]
    assert utterance.startswith("Enter the username") and utterance != info_other["task"]["utterance"]
    text, image = user["content"]
    assert text["text"] == user_again["content"][0]["text"] != user_other["content"][0]["text"]
    assert image["image"].tobytes() == user_again["content"][1]["image"].tobytes()
    assert image["image"].size == (240, 315)  # 160x210 times the scale
    assert text["text"].startswith(f"Task: {utterance}\nRootWebArea 'Login User Task'")
    assert re.search(r"\[\d+\] textbox ''\n.*\[\d+\] button 'Login'", text["text"], re.S)
    assert "accessibility tree" in system["content"] and "240x315 pixels" in system["content"]

    (_, user), _ = load_env("miniwob:login-user", {})().reset(7)  # axtree: text alone
    assert user["content"] == text["text"]
    (system, user), _ = load_env("miniwob:login-user", {"observation": "screenshot"})().reset(7)
    assert [p["type"] for p in user["content"]] == ["text", "image"]
    assert user["content"][0]["text"] == f"Task: {utterance}" and "mouse_click(x, y)" in system["content"]
    assert user["content"][1]["image"].size == (160, 210)


def test_the_tree_shows_ids_values_and_checks_and_the_task_in_every_observation():
    env = load_env("miniwob:click-checkboxes", {})()
    observation, _ = env.reset(3)
    tree = observation[1]["content"]
    boxes = re.findall(r"\[(\d+)\] checkbox '(\w+)', checked=false", tree)
    assert len(boxes) >= 2
    observation, reward, terminated, _, info = env.step(f'I will tick it: click("{boxes[0][0]}")')
    assert reward == 0.0 and not terminated and info["action"] == f'click("{boxes[0][0]}")'
    assert f"[{boxes[0][0]}] checkbox '{boxes[0][1]}', focused, checked=true" in text_of(observation)
    assert text_of(observation).startswith("Task: Select ")
    env = load_env("miniwob:enter-text", {})()
    observation, _ = env.reset(0)
    [box] = re.findall(r"\[(\d+)\] textbox", observation[1]["content"])
    observation, *_ = env.step(f'fill("{box}", "hello")')
    assert f"[{box}] textbox '', focused, value='hello'" in text_of(observation)


def test_a_mix_plays_task_seed_mod_n_and_its_expert_solves_each():
    factory = load_env("miniwob:click-button,enter-text,login-user", {})
    for seed, task in [(0, "click-button"), (4, "enter-text"), (5, "login-user"), (1_000_000, "enter-text")]:
        env = factory()
        _, info = env.reset(seed)
        assert info["task"]["task"] == task
        total = 0.0
        for _ in range(4):
            _, reward, terminated, _, step_info = env.step(env.expert_action())
            total += reward
            if terminated:
                break
        assert step_info["success"] and total == 1.0, (task, step_info)
    assert not hasattr(load_env("miniwob:click-button,click-menu", {})(), "expert_action")


# --- actions -------------------------------------------------------------------------------


def test_actions_are_read_as_browsergym_calls():
    assert str(parse_action('click("12")')) == 'click("12")'
    assert str(parse_action("Let me see. click('3') then fill('4', 'it\\'s me')")) == 'fill("4", "it\'s me")'
    assert str(parse_action("click(12)")) == 'click("12")'
    assert str(parse_action("mouse_click(40.5, 60)")) == "mouse_click(40.5, 60)"
    assert str(parse_action('select_option("7", ["a", "b"])')) == 'select_option("7", ["a", "b"])'
    assert str(parse_action('press("5", "Enter")')) == 'press("5", "Enter")'
    assert str(parse_action("noop()")) == "noop()"
    for bad, why in [
        ("I would click the button", "no action found"),
        ('click("12"', "never closed"),
        ("click(x)", "quoted text or numbers"),
        ('fill("3")', "takes 2 arguments"),
        ('click("1 2")', "not an element id"),
        ('mouse_click("a", 3)', "not a number"),
        ('click(__import__("os"))', "quoted text or numbers"),
        ('click(id="3")', "plain arguments"),
    ]:
        with pytest.raises(ActionError, match=why):
            parse_action(bad)


def test_an_invalid_action_is_reported_next_and_costs_what_the_recipe_says():
    env = load_env("miniwob:click-button", {"invalid_action_reward": -0.25})()
    env.reset(0)
    for reply, said in [
        ("the button", "no action found in the reply"),
        ('click("999")', 'there is no element with id "999" on the page'),
        ("mouse_click(500, 10)", "(500, 10) is outside the 160x210 screenshot"),
        ('fill("1", "x")', "fill"),  # element 1 is <html>: not a field
    ]:
        observation, reward, terminated, _, info = env.step(reply)
        assert reward == -0.25 and not terminated, (reply, info)
        assert text_of(observation).startswith(f"Invalid action: {said}"), text_of(observation)
        assert "Task: Click on the" in text_of(observation) and said in info["invalid_action"]


def test_rewards_raw_discounted_and_out_of_actions():
    env = load_env("miniwob:click-button", {})()
    observation, _ = env.reset(0)
    wanted = re.search(r'"(.*)"', observation[1]["content"]).group(1)
    wrong = next(b for b, n in re.findall(r"\[(\d+)\] button '(\w+)'", observation[1]["content"]) if n != wanted)
    observation, reward, terminated, _, info = env.step(f'click("{wrong}")')
    assert (reward, terminated, info["success"], info["raw_reward"]) == (-1.0, True, False, -1.0)
    assert text_of(observation) == "The episode is over: reward -1."

    steps, total, info, _ = play_expert("enter-text", 1, reward="discounted", episode_time_s=30)
    assert info["success"] and info["raw_reward"] == 1.0 and 0.5 < total < 1.0  # a few seconds of 30 gone

    env = load_env("miniwob:enter-text", {"max_actions": 2})()
    env.reset(0)
    assert env.step("noop()")[2] is False
    observation, reward, terminated, _, info = env.step("noop()")
    assert terminated and reward == -1.0 and not info["success"]
    assert text_of(observation) == "The episode is over: reward -1 (out of actions (2))."


# --- pages that hang or crash, browsers that die ------------------------------------------------


def test_a_hanging_page_fails_its_episode_and_the_next_one_gets_a_fresh_browser():
    # Chromium starts under the default page limit (its start on a loaded machine can outlast 2 s); the
    # env with the 2 s limit then takes a page of the process's running browser (shared_chromium).
    load_env("miniwob:click-test", {})().reset(0)
    env = load_env("miniwob:click-test", {"page_timeout_s": 2})()
    env.reset(0)
    generation = env.host.generation
    env._run(lambda _: env.page.evaluate("() => { setTimeout(() => { while (true) {} }, 0); }"))
    started = time.monotonic()
    with pytest.raises(PageTimeout, match="did not answer within 2s"):
        env.step(env.expert_action())
    assert time.monotonic() - started < 20
    # The next env shares the process's browser host (shared_chromium): a new Chromium starts under the
    # default page limit, since starting one on a loaded machine once outlasted the 2 s above.
    fresh = load_env("miniwob:click-test", {})()
    fresh.reset(0)
    assert fresh.host.generation == generation + 1
    assert play_expert("click-test", 0)[2]["success"]


def test_in_a_rollout_a_hanging_page_fails_its_episode_with_the_error_and_the_stage_goes_on(tmp_path):
    # Every step waits 5 s after its action, past the browser's 1 s limit: as a page stuck in a script.
    env = {"name": "miniwob:click-test", "kwargs": {"wait_ms": 5000, "page_timeout_s": 1}, "workers": 0}
    recipe = miniwob_recipe(tmp_path, env=env, rollout={"tasks": 2, "group_size": 1, "batch_size": 1})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    with closing(sqlite3.connect(tmp_path / "runs" / "rlcli.db")) as conn:
        rows = conn.execute("select status, error from episodes order by task_index").fetchall()
    assert len(rows) == 2
    for status, error in rows:
        assert status == "failed" and "PageTimeout: the browser did not answer within 1s" in error, error


def test_a_crashed_page_fails_its_episode_and_a_dead_browser_is_started_again():
    factory = load_env("miniwob:click-test", {})
    env = factory()
    env.reset(0)
    with contextlib.suppress(Exception):  # the navigation is aborted: the renderer is gone
        env._run(lambda _: env.page.goto("chrome://crash", timeout=5000))
    with pytest.raises(PageCrashed, match="the page of miniwob:click-test crashed"):
        env.step(env.expert_action())
    del env
    assert play_expert("click-test", 1)[2]["success"]
    env = factory()
    env.reset(2)
    env.host.kill()  # the browser dies under a live episode
    with pytest.raises(BrowserGone, match="died or was restarted"):
        env.step("noop()")
    assert play_expert("click-test", 2)[2]["success"]


def test_a_slow_browser_start_does_not_count_against_the_page_limit(tmp_path):
    """On a loaded machine Chromium can take longer to start than a page's limit. The limit counts from
    when the call runs with a browser up; counted from the call's start, each call killed the browser it
    was waiting for (the MiniWoB tests' failures under load: 'reset exceeded the 30s step time limit')."""
    slow = tmp_path / "slow-chromium"
    slow.write_text(f'#!/bin/sh\nsleep 2\nexec "{chromium_executable()}" "$@"\n')
    slow.chmod(0o755)
    host = Chromium(str(slow))
    try:
        assert host.run(lambda browser: browser.version, timeout_s=1)
        with pytest.raises(PageTimeout, match="did not answer within 1s"):  # the page's own limit still holds
            host.run(lambda browser: time.sleep(3), timeout_s=1)
    finally:
        host.close()


def browsers(mark: str) -> list[int]:
    """This test's live Chromium processes (zombies are dead): the browser and every process it starts
    (zygotes, renderers, GPU, utilities: their command lines name the profile folder, which rlcli
    makes under TMPDIR, set to `mark`), and its crash handlers (their environment holds TMPDIR)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            cmdline = (proc / "cmdline").read_bytes()
            ours = b"chrom" in cmdline and mark.encode() in cmdline
            if not ours and "chrom" in (proc / "comm").read_text():
                ours = mark.encode() in (proc / "environ").read_bytes()
        except OSError:
            continue
        if ours and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.fixture
def mark(monkeypatch):
    """A TMPDIR of the test's own, inherited by the processes it starts: rlcli makes the browsers'
    profiles there, so that `browsers` finds them. Short: Chromium puts a socket in it."""
    folder = tempfile.mkdtemp(prefix="rlcli-t-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def no_browsers(mark: str, within_s: float = 20) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := browsers(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_browsers_live_in_env_workers_and_die_with_them(mark):
    with EnvWorkerPool("miniwob:click-test", {"wait_ms": 120_000, "page_timeout_s": 200}, 1, timeout_s=10) as pool:
        key = pool.reset(0)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
        first = browsers(mark)
        assert len(first) >= 4, "no browser (its processes: the browser, zygotes, a renderer...) in the worker"
        pool.step(key, "noop()")  # then waits 120 s (wait_ms): past the 10 s limit
        [reply] = pool.replies()
        assert "step time limit" in str(reply.failure), reply.failure
        assert no_browsers(mark) == [], "a browser outlived its timed-out worker"
        # The replacement worker starts a browser of its own.
        key = pool.reset(1)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
        assert browsers(mark)
        os.kill(pool.workers[0].process.pid, signal.SIGKILL)  # the worker crashes
        pool.step(key, "noop()")
        [reply] = pool.replies()
        assert "killed by SIGKILL" in str(reply.failure), reply.failure
        assert no_browsers(mark) == [], "a browser outlived its crashed worker"
        key = pool.reset(2)
        assert pool.replies()[0].failure is None
        assert browsers(mark)
    assert no_browsers(mark) == [], "a browser outlived the closed pool"


HOLDER = """
import time
from rlcli.envs.loading import load_env

env = load_env("miniwob:click-test", {})()
env.reset(0)
print("ready", flush=True)
time.sleep(3600)
"""


def test_a_browser_in_the_main_process_dies_with_a_kill_9(mark):
    """env.workers 0: the browser is the main process's, and the kernel kills it with that process."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert browsers(mark), "no browser in the process"
    finally:
        holder.kill()  # kill -9: nothing of rlcli's runs after it
        holder.wait()
    assert no_browsers(mark) == [], "a browser outlived the kill -9 of the process holding it"


def test_a_long_tmpdir_does_not_stop_chromium(tmp_path):
    """Chromium puts a socket under TMPDIR and aborts when its path is too long for one (pytest's
    folders are): rlcli gives it /tmp then."""
    long = tmp_path / ("x" * 60)
    long.mkdir()
    script = "from rlcli.envs.loading import load_env; env = load_env('miniwob:click-test', {})(); env.reset(0)"
    script += "; print(env.step(env.expert_action())[1])"
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(long)}, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr[-2000:]


def test_ray_actors_carry_the_browsers_too(mark):
    ray = pytest.importorskip("ray")
    from rlcli.envs.ray_workers import RayEnvHost

    if ray.is_initialized():
        pytest.skip("Ray is already running in this process, without this test's mark in its environment")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RayEnvHost("miniwob:click-test", {"wait_ms": 120_000}, 1, timeout_s=30) as host:
            key = host.reset(0)
            assert host.replies()[0].failure is None
            assert browsers(mark), "no browser in the actor"
            host.timeout_s = 3
            host.step(key, "noop()")
            assert "step time limit (its env worker was killed)" in str(host.replies()[0].failure)
            assert no_browsers(mark) == [], "a browser outlived its killed actor"
            host.timeout_s = 30
            host.reset(1)
            assert host.replies()[0].failure is None
            assert browsers(mark)
        assert no_browsers(mark) == [], "a browser outlived its closed host"
    finally:
        ray.shutdown()


# --- rollouts: kill -9 and resume, the tiny VLM, the HTML page ------------------------------------


def miniwob_recipe(folder: Path, **sections) -> Path:
    base = {
        "model": {"name": "tiny-random", "max_length": 1024, "dtype": "float32"},
        "env": {"name": "miniwob:click-checkboxes", "max_turns": 2, "workers": 1},
        "rollout": {"tasks": 4, "group_size": 1, "max_new_tokens": 8, "batch_size": 2},
    }
    return write_recipe(folder / "r.yaml", **{**base, **sections})


def stored(runs: Path) -> list[tuple]:
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        return conn.execute(
            "select task_index, sample_index, status, end_reason, env_return, messages, "
            "(select group_concat(hex(completion_ids)) from turns t where t.episode_id = e.id) "
            "from episodes e order by 1, 2"
        ).fetchall()


def test_kill_9_of_a_miniwob_rollout_leaves_no_browser_and_resumes_to_the_uninterrupted_one(tmp_path, mark):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    for folder in (clean, killed):
        folder.mkdir()
        miniwob_recipe(folder)
    args = ["rollout", "--policy", "base", "-r"]
    result = run_in_process([*args, str(clean / "r.yaml")], clean / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    event = {"sql": "select count(*) from episodes", "at_least": 2}
    kill_at_event([*args, str(killed / "r.yaml")], killed / "runs", event, cwd=REPO)
    assert list(Path(mark).glob("rlcli-chromium-*")), "the killed rlcli started no browser"
    assert no_browsers(mark) == [], "a browser outlived rlcli's kill -9"
    assert len(stored(killed / "runs")) == 2
    result = run_in_process([*args, str(killed / "r.yaml")], killed / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    episodes = stored(clean / "runs")
    assert stored(killed / "runs") == episodes and len(episodes) == 4
    assert all(status == "ok" for _, _, status, *_ in episodes)
    assert "Task: Select " in json.loads(episodes[0][5])[1]["content"]


def test_a_screenshot_reaches_the_tiny_vlm(tmp_path):
    from helpers import make_ctx
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.models.loading import load_policy
    from rlcli.models.vision import processor_of
    from rlcli.store.episodes import stage_episodes

    recipe = miniwob_recipe(
        tmp_path,
        model={"name": "tiny-random-vlm", "max_length": 2048},
        env={"name": "miniwob:click-test", "kwargs": {"observation": "screenshot"}, "max_turns": 2},
        rollout={"tasks": 1, "group_size": 2, "max_new_tokens": 6, "batch_size": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="r", policy="base", split="train")
    _, tokenizer = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    image_token = processor_of(tokenizer).image_token_id
    episodes = stage_episodes(ctx.store, "r")
    assert len(episodes) == 2 and all(e.status == "ok" for e in episodes)
    rows = ctx.rundb.db.execute(
        "select prompt_ids, images from turns where episode_id = ? order by turn_index", [episodes[0].id]
    ).fetchall()
    from rlcli.store.blobs import unpack_ids

    prompt, images = unpack_ids(rows[0][0]), json.loads(rows[0][1])
    assert len(images) == 1 and prompt.count(image_token) > 0
    (width, height) = ctx.rundb.db.execute("select width, height from images where sha256 = ?", images).fetchone()
    assert (width, height) == (160, 210)


@pytest.mark.parametrize("observation", ["both", "screenshot"])
def test_the_html_episode_page_marks_each_click_on_its_screenshot(tmp_path, capsys, observation):
    recipe = miniwob_recipe(
        tmp_path,
        env={"name": "miniwob:click-checkboxes", "kwargs": {"observation": observation}, "max_turns": 8},
        rollout={"tasks": 1, "group_size": 1, "batch_size": 1},
    )
    runs = tmp_path / "runs"
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], runs, cwd=REPO)
    assert result.returncode == 0, result.stderr
    [(_, _, status, _, env_return, messages, _)] = stored(runs)
    assert status == "ok" and env_return == 1.0
    replies = [m["content"] for m in json.loads(messages) if m["role"] == "assistant"]
    page = tmp_path / "episodes.html"
    shown = run_in_process(["runs", "episodes", "t", "--html", str(page)], runs, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    html = page.read_text()
    # Every reply clicks (ticks the boxes, then Submit), each marked on the screenshot it answered.
    assert len(replies) >= 2 and html.count('<div class="click"') == len(replies)
    assert html.count("<img ") == len(replies)
    assert f"click {len(replies)} (" in html and "is marked on the screenshot above" in html


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("miniwob:click-buton", {}, "MiniWoB++ has no task 'click-buton'. Did you mean click-button"),
        ("miniwob:click-color", {}, "miniwob:click-color is drawn in pixels"),
        ("miniwob:click-button,click-colr", {}, "no task 'click-colr'. Did you mean click-color"),
        ("miniwob:click-button,click-button", {}, "names a task twice"),
        ("miniwob:click-button", {"observation": "dom"}, "expected one of axtree, screenshot, both, got 'dom'"),
        ("miniwob:click-button", {"reward": "time"}, "expected raw or discounted"),
        ("miniwob:click-button", {"colour": 1}, "unknown option 'colour'"),
        ("miniwob:click-button", {"scale": 0}, "env.kwargs.scale: expected a number of at least 0.25"),
        ("miniwob:click-button", {"__no_browser": True}, "No Chromium browser found"),
    ],
)
def test_bad_input_exits_2_in_one_sentence_before_any_stage(tmp_path, monkeypatch, name, kwargs, expected):
    if kwargs.pop("__no_browser", False):
        empty = tmp_path / "bin"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))
        monkeypatch.delenv("RLCLI_CHROMIUM", raising=False)
    recipe = miniwob_recipe(tmp_path, env={"name": name, "kwargs": kwargs, "workers": 0})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert expected in message and "Traceback" not in message, message
    if "No Chromium" in expected:
        assert "make browser" in message
    runs = tmp_path / "runs" / "rlcli.db"
    if runs.exists():
        with closing(sqlite3.connect(runs)) as conn:
            assert conn.execute("select count(*) from stages").fetchone()[0] == 0
