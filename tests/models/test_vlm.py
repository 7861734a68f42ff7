"""Vision-language models end to end on tiny-random-vlm (a random Idefics3) and the gui_click env:
image observations, token-exact records with image tokens, images stored once by hash, GRPO."""

from __future__ import annotations

import pytest
import torch

from helpers import make_ctx, write_recipe
from rlcli.engine.grpo import update as update_module
from rlcli.engine.grpo.batch import episode_sequences
from rlcli.engine.rollout import run_rollout_stage
from rlcli.store.episodes import stage_episodes

GUI_CLICK = {"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2, "attempts": 2}, "max_turns": 2}
IMAGE_TOKENS_PER_IMAGE = 16  # tiny-random-vlm: 112x112 pixels, 8x8 patches merged 2x2


def vlm_recipe(tmp_path, **sections):
    base = {
        "model": {"name": "tiny-random-vlm", "max_length": 1024},
        "env": GUI_CLICK,
        "rollout": {"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
    }
    return write_recipe(tmp_path / "r.yaml", **{**base, **sections})


def stored_turns(ctx, episode_id):
    from rlcli.store.episodes import _turn

    rows = ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [episode_id])
    return [_turn(row) for row in rows]


def recomputed_gap(ctx, model, sequences) -> float:
    """The largest |recorded - recomputed| logprob, recomputed as the GRPO update does (one padded
    batch, pixels rebuilt from the stored images)."""
    for s in sequences:
        s.advantage = [0.0] * len(s.ids)
    pictures = update_module.sequence_pictures(ctx, sequences)
    batch = update_module._collate(sequences, model, True, pictures)
    with torch.no_grad():
        logprobs, _ = update_module.token_logprobs(model, batch, 1.0)
    live = batch.mask > 0
    assert int(live.sum()) == sum(len(t) for s in sequences for t in [[m for m in s.mask if m]])
    return float((logprobs - batch.rollout_logprobs)[live].abs().max())


@pytest.mark.parametrize("keep_images", ["all", 1])
def test_vlm_rollout_records_image_tokens_and_exact_logprobs(tmp_path, keep_images):
    from rlcli.models.loading import load_policy
    from rlcli.models.vision import processor_of

    recipe = vlm_recipe(tmp_path, env={**GUI_CLICK, "keep_images": keep_images})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="r", policy="base", split="train")
    model, tokenizer = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    image_token = processor_of(tokenizer).image_token_id
    episodes = stage_episodes(ctx.store, "r")
    assert len(episodes) == 4 and all(e.status == "ok" for e in episodes)
    sequences = []
    for episode in episodes:
        turns = stored_turns(ctx, episode.id)
        # The random policy never clicks well, so every episode takes both attempts: two screenshots.
        assert len(turns) == 2
        for turn in turns:
            # The stored prompt holds every image the model saw, expanded as the processor expands it.
            assert turn.prompt_ids.count(image_token) == IMAGE_TOKENS_PER_IMAGE * len(turn.images)
        assert [len(t.images) for t in turns] == ([1, 2] if keep_images == "all" else [1, 1])
        # Dropping the first screenshot rewrites the past: the turns then train one by one.
        assert episode.template_consistent == (keep_images == "all")
        sequences += episode_sequences(episode.id, episode.task_index, turns)
    assert recomputed_gap(ctx, model, sequences) < 1e-4
    # Each distinct screenshot is stored once: a group's two episodes share their first one.
    hashes = {h for e in episodes for t in stored_turns(ctx, e.id) for h in t.images}
    (stored,) = ctx.rundb.db.execute("select count(*) from images").fetchone()
    references = sum(len(t.images) for e in episodes for t in stored_turns(ctx, e.id))
    assert stored == len(hashes) < references
    assert episodes[0].messages[1]["content"][1]["sha256"] in hashes


def test_images_are_stored_once_by_hash(tmp_path):
    import hashlib

    from PIL import Image

    from rlcli.models.vision import png_bytes
    from rlcli.store.db import RunDB
    from rlcli.store.images import image_count, insert_images, load_images

    rundb = RunDB.open(tmp_path / "runs")
    data = png_bytes(Image.new("RGB", (30, 20), (1, 2, 3)))
    sha = hashlib.sha256(data).hexdigest()
    for _ in range(2):
        with rundb.transaction() as db:
            insert_images(db, {sha: data})
    assert image_count(rundb) == 1
    assert load_images(rundb, [sha, sha]) == {sha: data}
    width, height = rundb.db.execute("select width, height from images").fetchone()
    assert (width, height) == (30, 20)


def test_gui_click_rewards_and_expert():
    from rlcli.envs.loading import load_env

    env = load_env("gui_click", {"width": 112, "height": 112, "buttons": 3, "attempts": 2})()
    messages, info = env.reset(5)
    assert messages[1]["content"][1]["image"].size == (112, 112)
    x0, y0, x1, y1 = info["task"]["box"]
    obs, miss, terminated, _, step_info = env.step("I think click(0, 111)")
    assert not terminated and 0.1 < miss < 0.55 and step_info["success"] is False
    assert obs[0]["content"][1]["type"] == "image"  # the screen again, for the second attempt
    _, hit, terminated, _, step_info = env.step(env.expert_action())
    # The episode pays its best try: missing first must not pay more than hitting at once.
    assert terminated and step_info["success"] and miss + hit == pytest.approx(1.0)
    env.reset(5)
    _, first_hit, terminated, _, _ = env.step(env.expert_action())
    assert terminated and first_hit == 1.0
    env.reset(5)
    _, reward, terminated, _, _ = env.step("nothing to parse")
    assert reward == 0.0 and not terminated


def test_lora_leaves_the_vision_tower_frozen_unless_asked(tmp_path):
    from rlcli.models.loading import load_policy
    from rlcli.recipe import load_recipe

    for target_vision in (False, True):
        recipe = load_recipe(vlm_recipe(tmp_path, lora={"r": 4, "alpha": 8, "target_vision": target_vision}), [])
        model, _ = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert any("text_model" in n for n in trained)
        assert any("vision_model" in n for n in trained) == target_vision


@pytest.mark.parametrize(
    "name, lora",
    [("tiny-random-vlm", {"r": 4}), ("tiny-random-qwen2-vl", None), ("tiny-random-qwen2.5-vl", {"r": 4})],
)
def test_a_checkpoint_holds_the_processor(tmp_path, name, lora):
    """A VLM checkpoint (a LoRA adapter or a full model) saves the whole processor, so that the
    family's processor class loads from the checkpoint alone and reads a screenshot as the run did."""
    from transformers import AutoProcessor

    from rlcli.envs.loading import load_env
    from rlcli.models import vision
    from rlcli.models.loading import load_policy, save_checkpoint
    from rlcli.recipe import load_recipe

    recipe = load_recipe(vlm_recipe(tmp_path, model={"name": name, "max_length": 1024}, lora=lora), [])
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization)
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    model_type = model.config.model_type
    # Qwen2-VL's AutoProcessor wants torchvision (its video processor); the image-only class does not.
    processor_class = (
        vision.image_only_processor_class(model_type) if model_type in vision.MROPE_FAMILIES else AutoProcessor
    )
    saved = processor_class.from_pretrained(folder)

    run = vision.processor_of(tokenizer)
    messages, _ = load_env("gui_click", GUI_CLICK["kwargs"])().reset(0)
    named = vision.name_images(messages, {})
    images = vision.message_images(named)
    assert saved.chat_template == run.chat_template
    ids = vision.tokenize(run, vision.render(run, named), images)
    assert vision.tokenize(saved, vision.render(saved, named), images) == ids
    batch = torch.tensor([ids])
    torch.testing.assert_close(
        vision.pixel_inputs(saved, [ref.image for ref in images], model, batch),
        vision.pixel_inputs(run, [ref.image for ref in images], model, batch),
    )


def test_grpo_on_gui_click_trains_the_tiny_vlm_end_to_end(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.models.loading import load_policy
    from rlcli.store.checkpoints import resolve_checkpoint

    recipe = vlm_recipe(
        tmp_path,
        lora=None,  # full fine-tune: the vision tower trains too
        # The random policy never writes a click, so the env's reward is 0 throughout; a digit in the
        # reply, which it writes now and then, gives the groups the spread GRPO learns from.
        rewards=[{"fn": "env_return"}, {"fn": "format", "kwargs": {"pattern": r"(?s).*\d.*"}}],
        grpo={"iterations": 2, "lr": 1e-3},
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 6, "batch_size": 8, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    metrics = {
        key: value
        for key, value in ctx.rundb.db.execute(
            "select key, value from metrics where run = ? and stage = 'grpo' and step = 1", [ctx.run]
        ).fetchall()
    }
    # Trainer and sampler agree on the logprobs of sequences with images.
    assert metrics["train/engine_logprob_gap"] < 1e-4
    assert metrics["train/tokens"] > 0
    base, _ = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    trained, _ = load_policy(
        ctx.recipe.model,
        None,
        ctx.recipe.quantization,
        adapter=resolve_checkpoint(ctx.store, "latest").path,
        trainable=False,
    )
    vision_changed = [
        n
        for (n, p), (_, q) in zip(base.named_parameters(), trained.named_parameters())
        if "vision_model" in n and not torch.equal(p, q)
    ]
    assert vision_changed  # the gradient reached the vision tower through the image tokens


def test_the_policy_never_writes_image_slots_even_when_they_are_likely(tmp_path, monkeypatch):
    """A sampled image token in a reply is a slot without an image: training's forward then fails
    ("Number of elements of source < number of ones in mask"), as the tiny VLM's GRPO did at its 5th
    iteration. Here the LM head favours the image token by 100 nats: the samplers must leave it out of
    the policy's distribution, and training recompute the same distribution."""
    import json
    from pathlib import Path

    import rlcli.models.loading as loading
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.models.cache import resolve_model
    from rlcli.store.blobs import unpack_ids

    real_load_policy = loading.load_policy

    def load_biased_policy(*args, **kwargs):
        model, tokenizer = real_load_policy(*args, **kwargs)
        image_token = model.config.image_token_id

        def favour_image_token(module, inputs, logits):
            return logits.index_add(
                -1,
                torch.tensor([image_token], device=logits.device),
                torch.full((*logits.shape[:-1], 1), 100.0, device=logits.device),
            )

        model.get_output_embeddings().register_forward_hook(favour_image_token)
        return model, tokenizer

    monkeypatch.setattr(loading, "load_policy", load_biased_policy)
    recipe = vlm_recipe(
        tmp_path,
        lora=None,
        rewards=[{"fn": "env_return"}, {"fn": "format", "kwargs": {"pattern": r"(?s).*\d.*"}}],  # some spread
        grpo={"iterations": 1, "lr": 1e-3},
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 6, "batch_size": 8, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    image_token = json.loads((Path(resolve_model("tiny-random-vlm")) / "config.json").read_text())["image_token_id"]
    completions = [unpack_ids(row["completion_ids"]) for row in ctx.rundb.db.query("select completion_ids from turns")]
    assert len(completions) >= 4 and not any(image_token in ids for ids in completions)
    (gap,) = [m.value for m in ctx.rundb.metrics(ctx.run, "train/engine_logprob_gap")]
    assert gap < 1e-4
