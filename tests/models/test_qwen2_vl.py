"""Qwen2-VL end to end on tiny-random-qwen2-vl (a random Qwen2-VL; some tests also on
tiny-random-qwen2.5-vl, a random Qwen2.5-VL) and the gui_click env: its
processor without torchvision, token-exact records with image tokens, 3-D (M-RoPE) positions in
the sampler's prefill and decode and in the GRPO update, images stored once, LoRA off the vision tower.

The screens are 112x84 pixels: a 6x8 patch grid (12 image tokens), not square, so that an image's
rows and columns get different positions."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers import make_ctx, write_recipe
from rlcli.engine.grpo import update as update_module
from rlcli.engine.grpo.batch import episode_sequences
from rlcli.engine.rollout import run_rollout_stage
from rlcli.store.episodes import stage_episodes
from test_vlm import recomputed_gap, stored_turns

GUI_CLICK = {"name": "gui_click", "kwargs": {"width": 112, "height": 84, "buttons": 2, "attempts": 2}, "max_turns": 2}
IMAGE_TOKENS_PER_IMAGE = 12  # 112x84 pixels: 8x6 patches of 14, merged 2x2
QWEN2_VL, QWEN2_5_VL = "tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl"


def qwen_recipe(tmp_path, model=QWEN2_VL, **sections):
    base = {
        "model": {"name": model, "max_length": 1024},
        "env": GUI_CLICK,
        "rollout": {"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
    }
    return write_recipe(tmp_path / "r.yaml", **{**base, **sections})


def load(ctx, **kwargs):
    from rlcli.models.loading import load_policy

    return load_policy(ctx.recipe.model, None, ctx.recipe.quantization, trainable=False, **kwargs)


@pytest.mark.parametrize(("name", "keep_images"), [(QWEN2_VL, "all"), (QWEN2_VL, 1), (QWEN2_5_VL, "all")])
def test_qwen2_vl_rollout_records_image_tokens_and_exact_logprobs(tmp_path, name, keep_images):
    from rlcli.models.vision import processor_of

    recipe = qwen_recipe(tmp_path, name, env={**GUI_CLICK, "keep_images": keep_images})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="r", policy="base", split="train")
    model, tokenizer = load(ctx)
    processor = processor_of(tokenizer)
    episodes = stage_episodes(ctx.store, "r")
    assert len(episodes) == 4 and all(e.status == "ok" for e in episodes)
    sequences = []
    for episode in episodes:
        turns = stored_turns(ctx, episode.id)
        assert len(turns) == 2  # the random policy misses: a second attempt, a second screenshot
        for turn in turns:
            # The stored prompt is what the processor makes of the rendered chat and its images.
            assert turn.prompt_ids.count(processor.image_token_id) == IMAGE_TOKENS_PER_IMAGE * len(turn.images)
        assert [len(t.images) for t in turns] == ([1, 2] if keep_images == "all" else [1, 1])
        # With all images kept, turn 2 extends turn 1: the sampler prefilled only its new tokens, a new
        # screenshot among them, on top of the cache (positions continue from turn 1's shift).
        assert episode.template_consistent == (keep_images == "all")
        sequences += episode_sequences(episode.id, episode.task_index, turns)
    # The update's forward computes the 3-D positions itself; the sampler's agree with it.
    assert recomputed_gap(ctx, model, sequences) < 1e-4
    # 1-D positions (each token's index) miss by more than that tolerance (by ~8e-4 here; the 3-D
    # ones by ~5e-7), so the check above does tell 3-D positions from 1-D ones.
    batch = update_module._collate(sequences, model, True, update_module.sequence_pictures(ctx, sequences))
    del batch.pixels["mm_token_type_ids"]
    batch.position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        flat, _ = update_module.token_logprobs(model, batch, 1.0)
    live = batch.mask > 0
    assert float((flat - batch.rollout_logprobs)[live].abs().max()) > 1e-4
    # Each distinct screenshot is stored once: a group's two episodes share their first one.
    hashes = {h for e in episodes for t in stored_turns(ctx, e.id) for h in t.images}
    (stored,) = ctx.rundb.db.execute("select count(*) from images").fetchone()
    references = sum(len(t.images) for e in episodes for t in stored_turns(ctx, e.id))
    assert stored == len(hashes) < references


@pytest.mark.parametrize("name", [QWEN2_VL, QWEN2_5_VL])
def test_sampler_positions_match_the_models_own(tmp_path, name):
    """One prefill of two left-padded prompts with images of different shapes: the logits of the
    sampler's first token equal the model's own forward (which computes the M-RoPE positions from
    the processor's mm_token_type_ids), and decoding one token more matches it too."""
    from PIL import Image

    from rlcli.generation.hf_sampler import TurnCache, make_generator, sample_batch
    from rlcli.generation.sampler import SamplingConfig
    from rlcli.models import vision

    ctx = make_ctx(qwen_recipe(tmp_path, name), tmp_path / "runs")
    model, tokenizer = load(ctx)
    processor = vision.processor_of(tokenizer)
    pngs: dict[str, bytes] = {}
    prompts, images = [], []
    for size, text in [((112, 56), "Where is Save?"), ((56, 112), "Click OK, then Cancel.")]:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image", "image": Image.new("RGB", size, (9, 200, 40))},
                ],
            }
        ]
        messages = vision.name_images(messages, pngs)
        refs = vision.message_images(messages)
        prompts.append(vision.tokenize(processor, vision.render(processor, messages), refs))
        images.append(refs)
    assert len(prompts[0]) != len(prompts[1])  # so that the batch is padded
    config = SamplingConfig(temperature=1.0, max_new_tokens=3)
    generators = [make_generator(model, seed) for seed in (1, 2)]
    samples = sample_batch(
        model, tokenizer, prompts, generators, config, turn_cache=TurnCache(), images=images, processor=processor
    )
    for prompt, refs, sample in zip(prompts, images, samples):
        full = torch.tensor([prompt + sample.ids], device=model.device)
        pixels = vision.pixel_inputs(processor, [r.image for r in refs], model, input_ids=full)
        with torch.no_grad():
            logits = model(input_ids=full, attention_mask=torch.ones_like(full), **pixels).logits[0].float()
        logits[:, vision.slot_token_ids(model.config)] = float("-inf")  # the policy never writes image slots
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(
            -1, torch.tensor(sample.ids, device=model.device)[:, None]
        )
        assert torch.allclose(torch.tensor(sample.logprobs), expected[:, 0].cpu(), atol=1e-4)


@pytest.mark.parametrize("name", [QWEN2_VL, QWEN2_5_VL])
def test_lora_leaves_the_vision_tower_frozen_unless_asked(tmp_path, name):
    from rlcli.models.loading import load_policy
    from rlcli.recipe import load_recipe

    for target_vision in (False, True):
        recipe = load_recipe(qwen_recipe(tmp_path, name, lora={"r": 4, "alpha": 8, "target_vision": target_vision}), [])
        model, _ = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert any("language_model" in n for n in trained)
        assert any(".visual." in n for n in trained) == target_vision


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="with torchvision installed, transformers picks its torchvision image processor",
)
def test_a_checkpoint_folder_loads_its_processor_without_torchvision(tmp_path):
    """A real Qwen2-VL / Qwen2.5-VL checkpoint keeps its image processor in preprocessor_config.json and
    its template in chat_template.json; rlcli builds the processor from those and the tokenizer,
    without the video processor (which needs torchvision)."""
    import shutil

    from rlcli.models.cache import pull_model
    from rlcli.models.vision import load_processor

    folder = tmp_path / "Qwen2-VL-like"
    shutil.copytree(pull_model("tiny-random-qwen2-vl"), folder)
    stored = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").unlink()
    config = stored["image_processor"]
    size = config.pop("size")
    legacy = {**config, "min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
    (folder / "preprocessor_config.json").write_text(json.dumps({**legacy, "processor_class": "Qwen2VLProcessor"}))
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    processor = load_processor(folder, "Qwen2-VL-like", None)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert processor.chat_template == template and processor.tokenizer.padding_side == "left"
    assert not hasattr(processor, "video_processor")


# Qwen2.5-VL too: full fine-tuning backpropagates through its windowed vision attention.
@pytest.mark.parametrize("name", [QWEN2_VL, QWEN2_5_VL])
def test_grpo_on_gui_click_trains_the_tiny_qwen2_vl(tmp_path, name):
    from rlcli.engine.grpo.loop import run_grpo

    recipe = qwen_recipe(
        tmp_path,
        name,
        lora=None,  # full fine-tune: the vision tower trains too
        # As in test_vlm.py: a digit in the reply gives the groups a spread of rewards.
        rewards=[{"fn": "env_return"}, {"fn": "format", "kwargs": {"pattern": r"(?s).*\d.*"}}],
        grpo={"iterations": 2, "lr": 1e-3, "epochs": 2},
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 6, "batch_size": 8, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    rows = ctx.rundb.db.execute(
        "select step, key, value from metrics where run = ? and stage = 'grpo'", [ctx.run]
    ).fetchall()
    metrics = {(step, key): value for step, key, value in rows}
    for step in (0, 1):  # iteration 1 samples with the updated weights
        # Trainer and sampler agree on the logprobs of sequences with images, after an update too.
        assert metrics[(step, "train/engine_logprob_gap")] < 1e-4
        assert metrics[(step, "train/tokens")] > 0


@pytest.mark.parametrize("name", [QWEN2_VL, QWEN2_5_VL])
def test_sft_on_gui_click_expert_demos_raises_their_likelihood(tmp_path, name):
    """SFT's collator gives the forward `mm_token_type_ids` (pixel_inputs with input_ids), from which
    Qwen2-VL computes its 3-D positions; training raises the likelihood of the expert's clicks."""
    from rlcli.engine.sft import ImageBatches, load_conversations, run_sft
    from rlcli.engine.sft_tokens import encode_image_conversations, with_images
    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.models.vision import processor_of

    env = {**GUI_CLICK, "kwargs": {**GUI_CLICK["kwargs"], "attempts": 1}, "max_turns": 1}
    sft = {"source": "expert", "demos": 8, "lr": 3e-3, "epochs": 3, "batch_size": 4, "micro_batch_size": 4}
    recipe = qwen_recipe(tmp_path, name, env=env, lora=None, sft={**sft, "save_steps": 100, "eval_fraction": 0.0})
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_sft(ctx)
    base, tokenizer = load(ctx)
    tuned, _ = load(ctx, adapter=summary.path)
    processor = processor_of(tokenizer)
    conversations, pictures = with_images(ctx.rundb, load_conversations(ctx))
    rows, _ = encode_image_conversations(
        processor, conversations, ctx.recipe.model.max_length, _eos_ids(base, tokenizer), None
    )
    assert all(row["input_ids"].count(processor.image_token_id) == IMAGE_TOKENS_PER_IMAGE for row in rows)

    def mean_demo_logprob(model) -> float:
        batch = ImageBatches(processor, pictures, model)(rows)
        assert "mm_token_type_ids" in batch
        batch = {k: v.to(model.device) for k, v in batch.items()}  # the Trainer moves the ids; here we do
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        live = labels != -100
        logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return float(logprobs[live].mean())

    before, after = mean_demo_logprob(base), mean_demo_logprob(tuned)
    assert after > before + 1.0, (before, after)
