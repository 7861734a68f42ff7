"""Vision-language models on the vLLM engine (`rollout.engine: vllm`): image tokens folded back into
placeholders for vLLM, whose own expansion must give back the recorded ids; logprobs the trainer
recomputes; weight syncs that reach the vision tower.

vLLM's CPU attention refuses head size 16, so the engine tests build tiny-random-vlm (an Idefics3)
with head_dim 64. Qwen2-VL's family needs torchvision inside vLLM, which the CPU machines here lack
(see MACHINE-NOTES): its folding is tested without vLLM.
"""

from __future__ import annotations

import pytest

from helpers import DEVICE, make_ctx, write_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.errors import RlcliError, UsageError
from rlcli.generation.engines import generation_engine
from rlcli.models import vision
from rlcli.models.tiny import build_tiny_random_vlm
from rlcli.recipe import load_recipe
from rlcli.store.episodes import stage_episodes
from rlcli.store.images import load_images
from test_vllm_engine import KV_CACHE_BYTES, needs_vllm
from test_vlm import recomputed_gap, stored_turns

GUI_CLICK = {"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2, "attempts": 2}, "max_turns": 2}


@pytest.fixture(scope="session")
def tiny_vlm64(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "tiny-random-vlm-hd64"
    if not (path / "config.json").is_file():
        build_tiny_random_vlm(path, head_dim=64)
    return path


def vlm_vllm_recipe(tmp_path, model, **sections):
    base = dict(
        model={"name": str(model), "max_length": 1024, "dtype": "float32", "device": DEVICE},
        env=GUI_CLICK,
        rollout={
            "tasks": 3,
            "group_size": 2,
            "max_new_tokens": 8,
            "batch_size": 6,
            "engine": "vllm",
            "vllm_memory": KV_CACHE_BYTES,
            "temperature": 1.0,
        },
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return write_recipe(tmp_path / "r.yaml", **base)


def screens(count: int, attempts: int = 2) -> list[dict]:
    """gui_click conversations with `count` screenshots each (a miss shows the screen again)."""
    from rlcli.envs.loading import load_env

    env = load_env("gui_click", {"width": 112, "height": 84, "buttons": 2, "attempts": attempts})()
    messages, _ = env.reset(7)
    for _ in range(count - 1):
        messages += [{"role": "assistant", "content": "click(0, 0)"}, *env.step("click(0, 0)")[0]]
    return messages


@pytest.mark.parametrize("name", ["tiny-random-vlm", "tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl"])
def test_folding_the_image_tokens_gives_the_prompt_with_one_placeholder_per_image(name):
    """What vLLM is given: the rendered chat tokenised as text, one placeholder token per image."""
    from rlcli.models.cache import resolve_model

    path = resolve_model(name)
    processor = vision.load_processor(path, name, None)
    messages = vision.name_images(screens(3, attempts=3), {})
    text = vision.render(processor, messages)
    images = vision.message_images(messages)
    assert len(images) == 3
    expanded = vision.tokenize(processor, text, images)
    cache: dict[str, list[int]] = {}
    folded = vision.fold_image_tokens(processor, expanded, images, cache)
    assert folded == processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(folded) < len(expanded) and len(cache) == len({ref.sha256 for ref in images})
    with pytest.raises(ValueError, match="not in the prompt"):
        vision.fold_image_tokens(processor, expanded[: len(expanded) // 2], images, cache)


def test_vllm_for_a_qwen2_vl_without_torchvision_is_refused_in_one_sentence(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name))
    recipe = write_recipe(tmp_path / "r.yaml", model={"name": "tiny-random-qwen2-vl"}, env=GUI_CLICK)
    with pytest.raises(UsageError, match="needs torchvision, which is not installed"):
        generation_engine(load_recipe(recipe, ["rollout.engine=vllm"]))
    assert generation_engine(load_recipe(recipe, ["rollout.engine=auto"])) == "hf"


def test_adapter_sync_with_a_trained_vision_tower_is_refused(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": "tiny-random-vlm"},
        env=GUI_CLICK,
        lora={"r": 4, "alpha": 8, "target_vision": True},
        rollout={"engine": "vllm", "vllm_sync": "adapter"},
    )
    with pytest.raises(UsageError, match="target_vision trains the vision tower"):
        load_recipe(recipe, [])


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("keep_images", ["all", 1])
def test_vllm_rollout_of_a_vlm_records_image_tokens_and_logprobs_the_trainer_recomputes(
    tmp_path, tiny_vlm64, keep_images
):
    from rlcli.engine.grpo.batch import episode_sequences
    from rlcli.models.loading import load_policy

    recipe = vlm_vllm_recipe(tmp_path, tiny_vlm64, env={**GUI_CLICK, "keep_images": keep_images})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="r", policy="base", split="train")
    model, tokenizer = load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False)
    image_token = vision.processor_of(tokenizer).image_token_id
    episodes = stage_episodes(ctx.store, "r")
    assert len(episodes) == 6 and all(e.status == "ok" for e in episodes)
    sequences, images_seen = [], []
    for episode in episodes:
        turns = stored_turns(ctx, episode.id)
        for turn in turns:
            assert turn.prompt_ids.count(image_token) == 16 * len(turn.images)  # 112x112: 16 tokens each
        images_seen += [len(t.images) for t in turns]
        sequences += episode_sequences(episode.id, episode.task_index, turns)
    assert max(images_seen) == (2 if keep_images == "all" else 1)  # second attempts happened
    assert recomputed_gap(ctx, model, sequences) < 1e-4

    # A prompt whose image tokens vLLM expands into other ids than the recorded ones is an error,
    # not logprobs of a sequence nobody stored: here the image tokens are left unfolded.
    from rlcli.generation.engines import make_sampler
    from rlcli.generation.sampler import sampling_config

    sampler = make_sampler(ctx.recipe, model, tokenizer, sampling_config(ctx.recipe.rollout), base=True)
    turn = stored_turns(ctx, episodes[0].id)[0]
    (image,) = [vision.image_from_png(data) for data in load_images(ctx.rundb, turn.images).values()]
    with pytest.raises(RlcliError, match="expanded a prompt's images into"):
        sampler.engine.generate([turn.prompt_ids], [0], sampler.config, images=[[image]], expanded=[turn.prompt_ids])


@pytest.mark.slow
@needs_vllm
def test_grpo_on_a_vlm_with_vllm_syncs_the_vision_tower(tmp_path, tiny_vlm64):
    """A full fine-tune trains the vision tower. fixed_layout shows every episode the same screen, so
    vLLM would serve that screen's image features from its encoder cache, computed by the first
    iteration's tower, unless a sync drops them. Without that reset (VllmEngine.load_weights), vLLM
    0.32 on the CPU failed at the second iteration with "Encoder cache miss"."""
    from rlcli.engine.grpo.loop import run_grpo

    recipe = vlm_vllm_recipe(
        tmp_path,
        tiny_vlm64,
        env={**GUI_CLICK, "kwargs": {**GUI_CLICK["kwargs"], "fixed_layout": True}},
        lora=None,
        rewards=[{"fn": "env_return"}, {"fn": "format", "kwargs": {"pattern": r"(?s).*\d.*"}}],
        grpo={"iterations": 3, "lr": 1e-3},
        rollout={"tasks": 2, "group_size": 4},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    rows = ctx.rundb.db.execute(
        "select step, value from metrics where run = ? and key = 'train/engine_logprob_gap' order by step", [ctx.run]
    ).fetchall()
    gaps = [value for _, value in rows]
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps
