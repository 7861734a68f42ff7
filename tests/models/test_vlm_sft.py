"""`rlcli sft` on a vision-language model (tiny-random-vlm) from gui_click's expert demos: the
screenshots are stored with the demos, tokenised as the rollout tokenises them, shown to the model
as pixels, and training raises the demos' likelihood; a kill -9 resumes from the checkpoint."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from helpers import kill_sft_at_a_checkpoint_and_resume, make_ctx, write_recipe
from rlcli.engine.sft import ImageBatches, load_conversations, run_sft
from rlcli.engine.sft_tokens import encode_image_conversations, tokenize_image_conversation, with_images
from rlcli.store.episodes import stage_episodes

GUI_CLICK = {"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2}, "max_turns": 1}
IMAGE_TOKENS_PER_IMAGE = 16  # tiny-random-vlm: 112x112 pixels, 8x8 patches merged 2x2


def vlm_recipe(tmp_path, **sections):
    base = {"model": {"name": "tiny-random-vlm", "max_length": 1024}, "env": GUI_CLICK, "lora": None}
    return write_recipe(tmp_path / "r.yaml", **{**base, **sections})


def load(ctx, adapter=None):
    from rlcli.models.loading import load_policy
    from rlcli.models.vision import processor_of

    r = ctx.recipe
    model, tokenizer = load_policy(r.model, r.lora, r.quantization, adapter=adapter, trainable=False)
    return model, tokenizer, processor_of(tokenizer)


def mean_demo_logprob(model, processor, rows, pictures) -> float:
    """The mean logprob of the demos' trained tokens (the expert's clicks), the screenshots shown as pixels."""
    batch = ImageBatches(processor, pictures, model)(rows)
    assert batch["pixel_values"].shape[1] == sum(len(r["image_hashes"]) for r in rows)
    batch = {k: v.to(model.device) for k, v in batch.items()}  # the Trainer moves the ids; here we do
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    live = labels != -100
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return float(logprobs[live].mean())


def test_sft_on_gui_click_expert_demos_raises_their_likelihood(tmp_path):
    from rlcli.generation.hf_sampler import _eos_ids

    recipe = vlm_recipe(
        tmp_path,
        sft={"source": "expert", "demos": 16, "lr": 3e-3, "epochs": 4, "batch_size": 4, "micro_batch_size": 4}
        | {"save_steps": 100, "eval_fraction": 0.25},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_sft(ctx)
    assert summary.examples == 16 and summary.eval_examples == 4 and summary.steps == 12
    assert summary.eval_loss is not None

    # The demos keep their screenshots, stored once each by hash.
    demos = stage_episodes(ctx.store, "sft/demos")
    hashes = {e.messages[1]["content"][1]["sha256"] for e in demos}
    assert len(hashes) == 16
    (stored,) = ctx.rundb.db.execute("select count(*) from images").fetchone()
    assert stored == 16

    base, tokenizer, processor = load(ctx)
    conversations, pictures = with_images(ctx.rundb, load_conversations(ctx))
    rows, truncated = encode_image_conversations(
        processor, conversations, ctx.recipe.model.max_length, _eos_ids(base, tokenizer), None
    )
    assert truncated == 0 and len(rows) == 16
    for row in rows:
        assert row["input_ids"].count(processor.image_token_id) == IMAGE_TOKENS_PER_IMAGE
        trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["assistant_masks"]) if m])
        assert trained.startswith("click(") and trained.endswith("<|im_end|>")
    tuned, _, _ = load(ctx, summary.path)
    before = mean_demo_logprob(base, processor, rows, pictures)
    after = mean_demo_logprob(tuned, processor, rows, pictures)
    print(f"mean demo logprob before {before:.3f} after {after:.3f}")
    assert after > before + 1.0, (before, after)


def test_sft_tokens_match_the_rollouts_prompt_ids(tmp_path):
    """The context SFT trains under is token for token the prompt the policy sampled from, image
    tokens included; with env.keep_images 1 a two-screenshot episode becomes two rows, as its turns
    train one by one in GRPO."""
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.engine.sft_data import Conversation
    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.store.episodes import _turn

    env = {**GUI_CLICK, "kwargs": {**GUI_CLICK["kwargs"], "attempts": 2}, "max_turns": 2}
    for keep in ("all", 1):
        recipe = vlm_recipe(
            tmp_path,
            run={"name": f"keep-{keep}", "seed": 0},
            env={**env, "keep_images": keep},
            rollout={"tasks": 1, "group_size": 2, "max_new_tokens": 6, "batch_size": 2},
        )
        ctx = make_ctx(recipe, tmp_path / "runs")
        run_rollout_stage(ctx, stage="r", policy="base", split="train")
        model, tokenizer, processor = load(ctx)
        for episode in stage_episodes(ctx.store, "r"):
            query = "select * from turns where episode_id = ? order by turn_index"
            turns = [_turn(row) for row in ctx.rundb.db.query(query, [episode.id])]
            assert len(turns) == 2  # the random policy misses: a second screenshot
            [conversation], _ = with_images(ctx.rundb, [Conversation(episode.messages, f"episode {episode.id}")])
            rows = tokenize_image_conversation(
                processor, conversation, _eos_ids(model, tokenizer), None if keep == "all" else 1
            )
            if keep == "all":
                [row] = rows
                starts = [i for i, m in enumerate(row["assistant_masks"]) if m and not row["assistant_masks"][i - 1]]
                assert row["input_ids"][: starts[0]] == turns[0].prompt_ids
                assert row["image_hashes"] == turns[1].images
                # The second turn's context after the first reply is the prompt's new suffix.
                end = len(turns[0].prompt_ids) + len(turns[0].completion_ids)
                assert (
                    row["input_ids"][starts[1] - (len(turns[1].prompt_ids) - end) : starts[1]]
                    == (turns[1].prompt_ids[end:])
                )
            else:
                assert len(rows) == 2
                for row, turn in zip(rows, turns):
                    first = row["assistant_masks"].index(1)
                    assert row["input_ids"][:first] == turn.prompt_ids
                    assert row["image_hashes"] == turn.images


def test_a_cut_never_splits_an_image(tmp_path):
    from rlcli.engine.sft_data import conversation_from_row
    from rlcli.envs.loading import load_env
    from rlcli.generation.hf_sampler import _eos_ids

    ctx = make_ctx(vlm_recipe(tmp_path), tmp_path / "runs")
    model, tokenizer, processor = load(ctx)
    env = load_env("gui_click", {"width": 112, "height": 112, "buttons": 2, "attempts": 2})()
    messages, _ = env.reset(0)
    _, _, _, _, _ = env.step("click(0, 0)")
    again = env._again("Missed.")
    answer = {"role": "assistant", "content": env.expert_action()}
    chat = [*messages, {"role": "assistant", "content": "click(0, 0)"}, *again, answer]
    [conversation], pictures = with_images(ctx.rundb, [conversation_from_row({"messages": chat}, "row 1")])
    end_ids = _eos_ids(model, tokenizer)
    [whole] = tokenize_image_conversation(processor, conversation, end_ids, None)
    second_image_start = whole["image_spans"][1][0]
    # A limit inside the second screenshot's piece: the row ends before that piece, with one image.
    rows, truncated = encode_image_conversations(processor, [conversation], second_image_start + 5, end_ids, None)
    assert truncated == 1
    [row] = rows
    assert len(row["input_ids"]) == second_image_start and len(row["image_hashes"]) == 1
    assert row["input_ids"].count(processor.image_token_id) == IMAGE_TOKENS_PER_IMAGE
    # The cut row still runs through the model: its image tokens match its one image.
    batch = ImageBatches(processor, pictures, model)(rows)
    with torch.no_grad():
        # The collator leaves the ids on the CPU for the Trainer to move; the pixels are on the model's device.
        inputs = {k: v.to(model.device) for k, v in batch.items() if k != "labels"}
        assert torch.isfinite(model(**inputs).logits).all()


def test_image_parts_in_a_data_file(tmp_path):
    from rlcli.engine.sft_data import read_conversations
    from rlcli.envs.loading import load_env

    env = load_env("gui_click", {"width": 112, "height": 112, "buttons": 2})()
    rows = []
    for seed in range(2):
        messages, _ = env.reset(seed)
        path = tmp_path / f"screen{seed}.png"
        messages[1]["content"][1]["image"].save(path)
        messages[1]["content"][1] = {"type": "image", "image": str(path)}
        rows.append({"messages": [*messages, {"role": "assistant", "content": env.expert_action()}]})
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = make_ctx(vlm_recipe(tmp_path, sft={"source": str(data), "eval_fraction": 0}), tmp_path / "runs")
    conversations, pictures = with_images(ctx.rundb, read_conversations(data))
    assert len(pictures) == 2
    summary = run_sft(ctx)
    assert summary.examples == 2 and summary.steps >= 1


def test_trl_images_column_fills_the_image_parts(tmp_path):
    from PIL import Image

    from rlcli.engine.sft_data import conversation_from_row

    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    ctx = make_ctx(vlm_recipe(tmp_path), tmp_path / "runs")
    user = [{"type": "image"}, {"type": "text", "text": "Which colour?"}, {"type": "image"}]
    row = {
        "images": [red, blue],
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "red"}],
    }
    [conversation], pictures = with_images(ctx.rundb, [conversation_from_row(row, "row 1")])
    parts = conversation.messages[0]["content"]
    assert [parts[0]["image"].getpixel((0, 0)), parts[2]["image"].getpixel((0, 0))] == [(255, 0, 0), (0, 0, 255)]
    assert len(pictures) == 2


@pytest.mark.parametrize(
    "content, expected",
    [
        ([{"type": "video", "video": "a.mp4"}], "expected parts of type text or image"),
        ([{"type": "image"}], "expected an image part to hold `image`"),
        ([{"type": "text", "text": 3}], "expected a text part's `text` to be a string"),
    ],
)
def test_malformed_image_parts_name_the_row(content, expected):
    from rlcli.engine.sft_data import conversation_from_row
    from rlcli.errors import UsageError

    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "click(1, 2)"}]}
    with pytest.raises(UsageError, match="row 7: messages message 1"):
        try:
            conversation_from_row(row, "row 7")
        except UsageError as exc:
            assert expected in str(exc)
            raise


def test_kill_during_vlm_sft_resumes_from_its_checkpoint(tmp_path):
    recipe = vlm_recipe(
        tmp_path,
        sft={"source": "expert", "demos": 8, "epochs": 4, "batch_size": 2, "micro_batch_size": 2, "save_steps": 4}
        | {"eval_fraction": 0.0},
    )
    runs = tmp_path / "runs"
    resumed = kill_sft_at_a_checkpoint_and_resume(recipe, runs)
    assert resumed.returncode == 0, resumed.stderr
    assert "sft: resuming from" in resumed.stderr
    with sqlite3.connect(runs / "rlcli.db") as conn:
        result = json.loads(conn.execute("select result from stages where name = 'sft'").fetchone()[0])
        stored_demos = conn.execute("select count(*) from episodes where stage = 'sft/demos'").fetchone()[0]
        loss_steps = [s for (s,) in conn.execute("select step from metrics where key = 'sft/loss' order by step")]
    steps = result["steps"]
    assert steps == 4 * 4  # 8 demos, 2 per step, 4 epochs
    assert 0 < result["resumed_from_step"] < steps
    assert stored_demos == 8
    assert loss_steps == list(range(1, steps + 1))
    # The checkpoint carries the processor, image processor included.
    last = runs / "t" / "sft" / f"checkpoint-{steps}"
    assert (last / "processor_config.json").is_file() or (last / "preprocessor_config.json").is_file()
