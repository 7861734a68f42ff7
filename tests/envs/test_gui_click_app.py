"""gui_click with scene "app": menus, text fields and buttons, multi-step tasks with click(x, y)
and type("..."), per-step GUI-R1-style rewards that total 1.0 for a perfect episode; and the default
"buttons" scene left exactly as it was (screens, tasks and rewards pinned for a few seeds)."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from helpers import cli, make_ctx, write_recipe
from rlcli.envs.loading import load_env
from rlcli.errors import UsageError

SMALL = {"width": 112, "height": 112, "scene": "app"}


def app(**kwargs):
    return load_env("gui_click", {**SMALL, **kwargs})()


def png_sha(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def screenshot(observation) -> object:
    """The image of an observation (a list of messages whose last one holds the screenshot)."""
    return observation[-1]["content"][1]["image"]


def seed_of(kind: str, env=None, start: int = 0) -> int:
    env = env or app()
    return next(s for s in range(start, start + 200) if env.reset(s)[1]["task"]["kind"] == kind)


def play_expert(env, seed: int):
    """(total reward, turns, last info, screenshots) of the expert's episode."""
    messages, info = env.reset(seed)
    total, turns, shots = 0.0, 0, [screenshot(messages)]
    while True:
        obs, reward, terminated, truncated, step_info = env.step(env.expert_action())
        total, turns = total + reward, turns + 1
        assert not truncated and step_info["format"]
        if terminated:
            return total, turns, step_info, shots, info["task"]
        assert step_info["success"] is False  # an episode cut short here is not a success
        [message] = obs
        assert message["role"] == "user" and [p["type"] for p in message["content"]] == ["text", "image"]
        shots.append(screenshot(obs))


@pytest.mark.parametrize("size", [(112, 112), (224, 224), (200, 128)])
def test_the_expert_solves_every_kind_of_task(size):
    env = app(width=size[0], height=size[1])
    kinds = {}
    for seed in range(150):
        total, turns, info, shots, task = play_expert(env, seed)
        assert total == pytest.approx(1.0) and info["success"] is True, (seed, task)
        assert turns == len(task["steps"]) == {"click": 1, "menu": 2, "type": 3}[task["kind"]]
        assert all(s.size == size for s in shots)
        kinds[task["kind"]] = kinds.get(task["kind"], 0) + 1
    assert set(kinds) == {"click", "menu", "type"} and min(kinds.values()) > 20, kinds


def test_reset_names_the_steps_and_the_system_prompt_both_actions():
    env = app()
    messages, info = env.reset(seed_of("type"))
    system, user = messages
    assert system["role"] == "system" and "click(x, y)" in system["content"] and 'type("text")' in system["content"]
    task = info["task"]
    text = user["content"][0]["text"]
    assert text == task["instruction"]
    click_field, typing, click_button = task["steps"]
    assert text == f"Type {typing['text']} into the {click_field['target']} field, then click {click_button['target']}."
    assert (click_field["widget"], typing["action"], click_button["widget"]) == ("field", "type", "button")
    messages, info = env.reset(seed_of("menu"))
    opening, item = info["task"]["steps"]
    assert messages[1]["content"][0]["text"] == f"Open the {opening['target']} menu, then click {item['target']}."
    assert (opening["widget"], item["widget"]) == ("menu", "item")
    messages, info = env.reset(seed_of("click"))
    [button] = info["task"]["steps"]
    assert messages[1]["content"][0]["text"] == f"Click {button['target']}."


def centre(step) -> tuple[int, int]:
    x0, y0, x1, y1 = step["box"]
    return (x0 + x1) // 2, (y0 + y1) // 2


def test_the_menu_opens_on_the_next_screenshot():
    env = app()
    seed = seed_of("menu")
    total, turns, info, (closed, opened), task = play_expert(env, seed)
    opening, item = task["steps"]
    assert png_sha(closed) != png_sha(opened)
    # The item's row was body (or empty) before and is the white drop-down with its label now.
    x0, y0, x1, y1 = item["box"]
    before, after = closed.crop((x0, y0, x1, y1)), opened.crop((x0, y0, x1, y1))
    assert before.tobytes() != after.tobytes()
    colours = {c for _, c in after.getcolors(10_000)}
    assert (255, 255, 255) in colours and any(sum(c) < 200 for c in colours)  # white, with dark text
    # The drop-down's item cannot be clicked while the menu is closed: clicking it first is a miss.
    env.reset(seed)
    _, reward, terminated, _, info = env.step("click({}, {})".format(*centre(item)))
    assert terminated and info["success"] is False and reward < 0.5 / 2


def test_a_click_focuses_the_field_and_typed_text_shows():
    env = app()
    seed = seed_of("type")
    total, turns, info, (blank, focused, typed), task = play_expert(env, seed)
    field = task["steps"][0]["box"]
    crops = [shot.crop(tuple(field)).tobytes() for shot in (blank, focused, typed)]
    assert len(set(crops)) == 3  # the focus (outline and caret), then the text, change the field
    assert (30, 90, 220) in {c for _, c in focused.crop(tuple(field)).getcolors(10_000)}  # the focus outline
    # Outside the field nothing changed (the buttons and menus stay put).
    outside = [shot.copy() for shot in (blank, typed)]
    for shot in outside:
        shot.paste((0, 0, 0), (field[0], field[1], field[2] + 1, field[3] + 1))  # the outline included
    assert outside[0].tobytes() == outside[1].tobytes()
    # Another word draws other pixels in the field.
    env.reset(seed)
    env.step(env.expert_action())
    other = next(w for w in ("alice", "bob", "grace") if w != task["steps"][1]["text"])
    env.texts[task["steps"][0]["target"]] = other  # what the screen shows had the field held another word
    assert env.render().crop(tuple(field)).tobytes() != crops[2]


def test_wrong_and_near_actions_earn_partial_or_no_credit():
    env = app(width=224, height=224)
    seed = seed_of("menu", env)
    _, info = env.reset(seed)
    opening = info["task"]["steps"][0]
    x, y = centre(opening)
    x1 = opening["box"][2]
    env.reset(seed)
    _, near, terminated, _, near_info = env.step(f"click({x1 + 4}, {y})")
    env.reset(seed)
    _, far, _, _, _ = env.step("click(220, 220)")
    assert terminated and near_info == {"format": True, "step": 0, "click": [x1 + 4.0, y], "success": False}
    # Each of the two steps is worth 0.5: the format reward 0.1, partial credit falling with distance.
    assert 0.05 < far < near < 0.05 + 0.45 / 2

    seed = seed_of("type", env)
    _, info = env.reset(seed)
    word = info["task"]["steps"][1]["text"]
    env.step(env.expert_action())
    _, reward, terminated, _, wrong = env.step('type("zzz")')
    assert terminated and wrong["success"] is False and wrong["typed"] == "zzz"
    assert reward == pytest.approx(0.1 / 3)  # the format reward only
    env.reset(seed)
    env.step(env.expert_action())
    _, reward, _, _, _ = env.step("click({}, {})".format(*centre(info["task"]["steps"][0])))
    assert reward == pytest.approx(0.1 / 3)  # a click where the step is to type: the format only
    env.reset(seed)
    _, reward, _, _, _ = env.step(f'type("{word}")')  # typing before a field has the focus
    assert reward == pytest.approx(0.1 / 3)
    env.reset(seed)
    env.step(env.expert_action())
    _, reward, terminated, _, step = env.step(f"type('{word}')")  # single quotes are a type action too
    assert reward == pytest.approx(1 / 3) and not terminated and step["typed"] == word


@pytest.mark.parametrize("reply", ["OK", "click(12)", "type(alice)", 'type("alice', "", "press File"])
def test_a_malformed_action_earns_nothing(reply):
    env = app()
    env.reset(seed_of("menu"))
    obs, reward, terminated, _, info = env.step(reply)
    assert reward == 0.0 and terminated and info == {"format": False, "step": 0, "success": False}
    assert "click(x, y)" in obs and 'type("text")' in obs


def test_retries_mark_the_miss_and_never_pay_more_than_the_step():
    env = app(attempts=3)
    seed = seed_of("menu", env)
    messages, info = env.reset(seed)
    first = screenshot(messages)
    obs, miss, terminated, _, _ = env.step("click(100, 100)")
    assert not terminated and miss > 0
    assert (
        obs[0]["content"][0]["text"].startswith("Missed")
        and info["task"]["instruction"] in obs[0]["content"][0]["text"]
    )
    marked = screenshot(obs)
    assert (220, 0, 0) in {c for _, c in marked.getcolors(10_000)} and png_sha(marked) != png_sha(first)
    obs, malformed, terminated, _, _ = env.step("hmm")  # a malformed try pays nothing and costs a try
    assert malformed == 0.0 and not terminated
    total = miss
    while not terminated:
        obs, reward, terminated, _, step_info = env.step(env.expert_action())
        total += reward
    assert step_info["success"] is True and total == pytest.approx(1.0)
    # Out of tries on the first step: the episode ends without success.
    env.reset(seed)
    for _ in range(3):
        _, _, terminated, _, step_info = env.step("click(100, 100)")
    assert terminated and step_info["success"] is False


def test_determinism_and_fixed_layout():
    a, b = app(), app()
    for seed in (0, 5, 42):
        (ma, ia), (mb, ib) = a.reset(seed), b.reset(seed)
        assert ia == ib and png_sha(screenshot(ma)) == png_sha(screenshot(mb))
        assert a.expert_action() == b.expert_action()
    screens = {png_sha(screenshot(a.reset(seed)[0])) for seed in range(10)}
    assert len(screens) == 10  # a new layout per seed
    fixed = app(fixed_layout=True)
    screens, instructions = set(), set()
    for seed in range(20):
        messages, info = fixed.reset(seed)
        screens.add(png_sha(screenshot(messages)))
        instructions.add(info["task"]["instruction"])
    assert len(screens) == 1 and len(instructions) > 5  # one screen, the task varies


def test_bad_kwargs_are_refused_with_one_sentence():
    with pytest.raises(UsageError, match="scene must be one of buttons, app, got 'desktop'"):
        load_env("gui_click", {"scene": "desktop"})()
    with pytest.raises(UsageError, match="at least 112x112"):
        load_env("gui_click", {"width": 96, "height": 112, "scene": "app"})()
    with pytest.raises(UsageError, match="buttons must be from 1 to 4 for the app scene at 112x112"):
        load_env("gui_click", {**SMALL, "buttons": 5})()


# sha256 of the PNG, the instruction, the expert's click and the rewards of click(3, 3) and of the
# expert's click, recorded from gui_click.py before the app scene was added.
BUTTONS = [
    (
        {"width": 112, "height": 112, "buttons": 2},
        0,
        "eff1d2c8685860e50469363c63938cee25d31732e8f0da58543ff0c860614858",
        "Click Undo.",
        "click(49, 74)",
        0.309649515522,
    ),
    (
        {"width": 112, "height": 112, "buttons": 2},
        7,
        "133d795e10328a4af96aeb60a9d28e7ccdc7cacbd1613a2798c63ebde9fa8764",
        "Click Close.",
        "click(66, 92)",
        0.240207841543,
    ),
    (
        {"width": 224, "height": 224, "buttons": 3, "attempts": 2},
        1,
        "7652e502290d91336731de502fbc9417dd985e07aeedaca3e065577c5038e92a",
        "Click Help.",
        "click(156, 131)",
        0.266630673109,
    ),
    (
        {"width": 112, "height": 96, "buttons": 4, "fixed_layout": True},
        123,
        "1e02fade020907aec07bde63d3e1f29c3cdc17f9f663acda5110743003ba4195",
        "Click Print.",
        "click(49, 74)",
        0.291923430694,
    ),
]


@pytest.mark.parametrize("scene", [None, "buttons"])
@pytest.mark.parametrize(("kwargs", "seed", "sha", "text", "expert", "miss"), BUTTONS)
def test_the_buttons_scene_is_unchanged(scene, kwargs, seed, sha, text, expert, miss):
    env = load_env("gui_click", kwargs if scene is None else {**kwargs, "scene": scene})()
    messages, info = env.reset(seed)
    assert png_sha(screenshot(messages)) == sha and messages[1]["content"][0]["text"] == text
    assert (
        messages[0]["content"].endswith("(x from the left, y from the top).") and "type(" not in messages[0]["content"]
    )
    assert set(info["task"]) == {"target", "box", "labels"} and env.expert_action() == expert
    _, reward, terminated, _, _ = env.step("click(3, 3)")
    assert reward == pytest.approx(miss, abs=1e-11) and terminated == (kwargs.get("attempts", 1) == 1)
    env.reset(seed)
    assert env.step(expert)[1:3] == (1.0, True)


def test_expert_rollout_and_sft_demos_on_the_app_scene(capsys, rlcli_home, tmp_path, monkeypatch):
    """End to end on tiny-random-vlm: `rlcli rollout --policy expert` plays the app scene to a return
    of 1.0 per episode, and SFT's expert demos keep every step: one trained reply and one screenshot
    per step, so a menu or typing task is a multi-turn conversation."""
    from rlcli.engine.sft import expert_conversations
    from rlcli.engine.sft_tokens import encode_image_conversations, with_images
    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.models.loading import load_policy
    from rlcli.models.vision import processor_of
    from rlcli.store.episodes import stage_episodes

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "app", "seed": 0},
        model={"name": "tiny-random-vlm", "max_length": 2048},
        lora=None,
        env={"name": "gui_click", "kwargs": SMALL, "max_turns": 3},
        rollout={"tasks": 4, "group_size": 1, "max_new_tokens": 12, "batch_size": 4},
        sft={"source": "expert", "demos": 6},
    )
    code, _, err = cli(capsys, "rollout", "-r", recipe, "--policy", "expert")
    assert code == 0, err
    code, out, err = cli(capsys, "runs", "episodes", "app", "--json")
    assert code == 0, err
    episodes = json.loads(out)
    assert len(episodes) == 4
    for episode in episodes:
        assert episode["env_return"] == pytest.approx(1.0) and episode["success"] is True
        assert episode["num_turns"] == len(episode["task"]["steps"])

    ctx = make_ctx(recipe, rlcli_home)
    conversations, pictures = with_images(ctx.rundb, expert_conversations(ctx))
    demos = {f"episode {e.id}": e for e in stage_episodes(ctx.store, "sft/demos")}
    model, tokenizer = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    processor = processor_of(tokenizer)
    rows, truncated = encode_image_conversations(processor, conversations, 2048, _eos_ids(model, tokenizer), None)
    assert truncated == 0 and len(rows) == len(conversations) == 6
    turns = []
    for conversation, row in zip(conversations, rows):
        steps = demos[conversation.origin].task["steps"]
        mask = row["assistant_masks"]
        replies = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert replies == len(steps) == len(row["image_hashes"])
        trained = tokenizer.decode([t for t, m in zip(row["input_ids"], mask) if m])
        assert trained.count("click(") + trained.count("type(") == len(steps)
        turns.append(replies)
    print("expert demo turns:", turns)
    assert max(turns) >= 2, turns
