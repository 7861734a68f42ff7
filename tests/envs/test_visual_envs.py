"""Environments that show pictures: the built-in maze with render=image, and Gymnasium envs whose
rgb_array frames come as image parts (`gymnasium:<EnvId>?render=image`)."""

from __future__ import annotations

import numpy as np
import pytest

from rlcli.envs.loading import load_env
from rlcli.errors import UsageError

gymnasium = pytest.importorskip("gymnasium")


def parts(message: dict) -> tuple[str, object]:
    """(text, image) of a user message holding one text part and one image part, in that order."""
    text, image = message["content"]
    assert message["role"] == "user" and text["type"] == "text" and image["type"] == "image"
    return text["text"], image["image"]


def colour_at(image, row: int, col: int, cell: int) -> tuple[int, int, int]:
    return image.getpixel((col * cell + cell // 2, row * cell + cell // 2))


# --- maze ------------------------------------------------------------------------------------


def test_maze_image_observations_show_the_state_and_the_expert_still_solves_it():
    env = load_env("maze", {"size": 6, "render": "image", "cell": 20})()
    messages, info = env.reset(3)
    assert "blue square" in messages[0]["content"]
    text, image = parts(messages[1])
    assert image.size == (120, 120) and text == "The maze:"
    start, goal = info["task"]["start"], info["task"]["goal"]
    blue, green = (65, 105, 225), (46, 139, 87)  # royalblue, seagreen
    assert colour_at(image, *start, 20) == blue and colour_at(image, *goal, 20) == green
    # The expert walks the shortest path; every step's picture has the agent where the env has it.
    steps, total, pictures = 0, 0.0, [image]
    while True:
        obs, reward, terminated, truncated, step_info = env.step(env.expert_action())
        steps, total = steps + 1, total + reward
        if terminated:
            break
        (message,) = obs
        _, picture = parts(message)
        assert colour_at(picture, *env.pos, 20) == blue
        pictures.append(picture)
    assert total == 1.0 and step_info["success"] and steps == info["task"]["shortest"]
    assert len({p.tobytes() for p in pictures}) == len(pictures)  # each move changes the picture


def test_maze_image_feedback_and_text_mode_unchanged():
    env = load_env("maze", {"size": 5, "render": "image"})()
    env.reset(0)
    (message,) = env.step("I am lost")[0]
    text, image = parts(message)
    assert text.startswith("Invalid move") and image.size == (120, 120)
    text_env = load_env("maze", {"size": 5})()
    messages, _ = text_env.reset(0)
    assert isinstance(messages[1]["content"], str) and "A" in messages[1]["content"]
    assert "A is you" in messages[0]["content"]
    obs = text_env.step("nowhere")[0]
    assert isinstance(obs, str) and obs.startswith("Invalid move. Reply with up, down, left or right.\n")
    with pytest.raises(UsageError, match="env 'maze' refused env.kwargs .*render must be text or image"):
        load_env("maze", {"render": "png"})()


def test_visual_maze_rollout_stores_its_pictures(tmp_path):
    """A vision-language model's rollout on the image maze: each distinct picture is stored, and the
    prompts hold the image tokens of every picture the model saw."""
    from helpers import make_ctx, write_recipe
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.models.loading import load_policy
    from rlcli.models.vision import processor_of
    from rlcli.store.episodes import _turn, stage_episodes
    from rlcli.store.images import image_count

    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": "tiny-random-vlm", "max_length": 2048},
        env={"name": "maze", "kwargs": {"size": 4, "render": "image", "cell": 28}, "max_turns": 2},
        rollout={"tasks": 2, "group_size": 1, "max_new_tokens": 4, "batch_size": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="r", policy="base", split="train")
    _, tokenizer = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    image_token = processor_of(tokenizer).image_token_id
    episodes = stage_episodes(ctx.store, "r")
    assert len(episodes) == 2 and all(e.status == "ok" for e in episodes)
    hashes = set()
    for episode in episodes:
        rows = ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [episode.id])
        turns = [_turn(row) for row in rows]
        assert [len(t.images) for t in turns] == list(range(1, len(turns) + 1))  # a picture a turn, all kept
        per_image = turns[0].prompt_ids.count(image_token)
        assert per_image > 0
        assert all(t.prompt_ids.count(image_token) == per_image * len(t.images) for t in turns)
        hashes |= {h for t in turns for h in t.images}
    assert image_count(ctx.rundb) == len(hashes)


# --- gymnasium ?render=image ------------------------------------------------------------------


def test_frozenlake_frames_as_images():
    pytest.importorskip("pygame", reason="the toy-text frames are drawn with pygame (rlcli[envs])")
    env = load_env("gymnasium:FrozenLake-v1?render=image", {"is_slippery": False})()
    messages, info = env.reset(0)
    assert "the figure" in messages[0]["content"] and "left (0)" in messages[0]["content"]
    assert info["task"]["env_id"] == "FrozenLake-v1"
    text, frame = parts(messages[1])
    assert text == "Observation: 0" and frame.size == (256, 256) and frame.mode == "RGB"
    frames = [np.asarray(frame)]
    (message,) = env.step("nonsense")[0]
    text, frame = parts(message)
    assert text.startswith("Invalid action.") and text.endswith("Reward: -1")
    assert np.array_equal(np.asarray(frame), frames[0])  # the env did not move
    total = 0.0
    for move in ["down", "down", "right", "down", "right", "right"]:
        obs, reward, terminated, _, step_info = env.step(move)
        total += reward
        (message,) = obs
        text, frame = parts(message)
        frames.append(np.asarray(frame))
        assert not np.array_equal(frames[-1], frames[-2])  # the figure moved
    assert terminated and total == 1.0 and step_info["success"]
    assert text == "Observation: 15\nReward: 1\nThe episode is over."


class _Pixels(gymnasium.Env):
    """An env whose observation is itself an image: with ?render=image only the frame shows it."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}
    observation_space = gymnasium.spaces.Box(0, 255, (8, 8, 3), dtype="uint8")
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.level = 0
        return self.render(), {}

    def step(self, action):
        self.level += 100 * int(action)
        return self.render(), float(action), self.level >= 200, False, {}

    def render(self):
        return np.full((8, 8, 3), self.level, dtype=np.uint8)


def test_an_image_observation_space_is_shown_by_its_frame_alone():
    if "rlcli-test/Frames-v0" not in gymnasium.registry:
        gymnasium.register("rlcli-test/Frames-v0", entry_point=_Pixels)
    with pytest.raises(UsageError, match="or add \\?render=image"):
        load_env("gymnasium:rlcli-test/Frames-v0", {})()
    env = load_env("gymnasium:rlcli-test/Frames-v0?render=image", {})()
    messages, _ = env.reset(0)
    assert "The picture shows it." in messages[0]["content"]
    text, frame = parts(messages[1])
    assert text == "" and frame.getpixel((0, 0)) == (0, 0, 0)
    (message,) = env.step("1")[0]
    text, frame = parts(message)
    assert text == "Reward: 1" and frame.getpixel((3, 3)) == (100, 100, 100)


@pytest.mark.parametrize(
    "uri, kwargs, message",
    [
        ("FrozenLake-v1?render=pixels", {}, "render must be text or image, got 'pixels'"),
        ("FrozenLake-v1?size=3", {}, "unknown option 'size'"),
        ("FrozenLake-v1?render=image", {"render_mode": "ansi"}, "drop env.kwargs.render_mode ('ansi')"),
        ("Blackjack-v1?render=text", {}, None),  # the default, said out loud: text observations
    ],
)
def test_render_option_errors(uri, kwargs, message):
    if message is None:
        env = load_env(f"gymnasium:{uri}", kwargs)()
        assert isinstance(env.reset(0)[0][1]["content"], str)
        return
    with pytest.raises(UsageError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_env(f"gymnasium:{uri}", kwargs)()
