"""`rlcli sft` on the tiny model: data sources, the assistant-only loss mask, learning, resume after kill -9."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from helpers import REPO, kill_at_event, kill_sft_at_a_checkpoint_and_resume, make_ctx, run_in_process, write_recipe
from rlcli.engine.sft import build_trainer, episode_conversations, load_conversations, run_sft
from rlcli.engine.sft_data import Conversation, conversation_from_row, read_conversations
from rlcli.engine.sft_tokens import encode_conversations, split_examples, tokenize_conversation
from rlcli.errors import UsageError
from rlcli.store.checkpoints import checkpoints, resolve_checkpoint

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 7 * 8?"},
    {"role": "assistant", "content": "56"},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-random policy and tokenizer, built once for the module's tokenisation tests."""
    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.models.loading import load_policy
    from rlcli.recipe import ModelSection, QuantizationSection

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCLI_HOME", str(tmp_path_factory.mktemp("home")))
        model, tokenizer = load_policy(
            ModelSection(name="tiny-random", dtype="float32"), None, QuantizationSection(), trainable=False
        )
    return model, tokenizer, _eos_ids(model, tokenizer)


def _trained_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


# --- the loss mask ------------------------------------------------------------------------------


def test_only_assistant_tokens_carry_loss(tiny):
    _, tokenizer, end_ids = tiny
    ids, mask = tokenize_conversation(tokenizer, Conversation(CHAT, "chat"), end_ids)
    # Exactly the replies and their end-of-turn tokens; the template's newline after <|im_end|>,
    # role headers, system, user text and the trailing user turn are context.
    assert _trained_text(tokenizer, ids, mask) == "5<|im_end|>56<|im_end|>"
    # The pieces, tokenised one after another, spell the conversation through its last reply.
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT[:5], tokenize=False)
    for start, end in ((0, mask.index(1)), (len(mask) - 1, len(mask))):
        assert not any(mask[start:end])


def test_prompt_completion_trains_only_the_completion(tiny):
    _, tokenizer, end_ids = tiny
    conversation = conversation_from_row({"prompt": CHAT[:4], "completion": [CHAT[4]]}, "row 1")
    ids, mask = tokenize_conversation(tokenizer, conversation, end_ids)
    # The prompt's own assistant reply ("5") is a few-shot example: context, not target.
    assert _trained_text(tokenizer, ids, mask) == "56<|im_end|>"


def test_trl_turns_the_mask_into_labels(tmp_path, tiny):
    model, tokenizer, end_ids = tiny
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", lora=None), tmp_path / "runs")
    rows, _ = encode_conversations(tokenizer, [Conversation(CHAT, "chat")] * 2, 512, end_ids)
    trainer = build_trainer(ctx, model, tokenizer, rows, [], callbacks=[])
    [labels] = trainer.train_dataset[:1]["labels"]
    assert [t for t in labels if t != -100] == [
        t for t, m in zip(rows[0]["input_ids"], rows[0]["assistant_masks"]) if m
    ]


def test_truncation_at_max_length(tiny):
    _, tokenizer, end_ids = tiny
    ids, mask = tokenize_conversation(tokenizer, Conversation(CHAT, "chat"), end_ids)
    first_reply = mask.index(1)
    rows, truncated = encode_conversations(tokenizer, [Conversation(CHAT, "chat")], first_reply + 1, end_ids)
    assert truncated == 1 and rows[0]["input_ids"] == ids[: first_reply + 1] and sum(rows[0]["assistant_masks"]) == 1
    with pytest.raises(UsageError, match="raise model.max_length"):
        encode_conversations(tokenizer, [Conversation(CHAT, "chat")], first_reply, end_ids)


def test_eval_split_is_seeded_and_never_empty_or_total():
    rows = [{"i": i} for i in range(10)]
    train, held = split_examples(rows, 0.2, seed=3)
    assert len(held) == 2 and sorted(r["i"] for r in train + held) == list(range(10))
    assert split_examples(rows, 0.2, seed=3) == (train, held)
    assert len(split_examples(rows, 0.01, seed=3)[1]) == 1
    assert split_examples(rows[:1], 0.5, seed=3) == (rows[:1], [])


# --- data files --------------------------------------------------------------------------------------


MESSAGES_ROWS = [{"messages": CHAT}, {"messages": CHAT[1:3]}]


def _write(path, fmt, rows):
    import datasets

    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif fmt == "json":
        path = path.with_suffix(".json")
        path.write_text(json.dumps(rows))
    elif fmt == "json-lines-from-datasets":
        path = path.with_suffix(".json")
        datasets.Dataset.from_list(rows).to_json(str(path))
    elif fmt == "parquet":
        path = path.with_suffix(".parquet")
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "datasets-folder":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    elif fmt == "datasets-dict-folder":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(
    "fmt", ["jsonl", "json", "json-lines-from-datasets", "parquet", "datasets-folder", "datasets-dict-folder"]
)
def test_reads_chat_messages_from_every_format(tmp_path, fmt):
    path = _write(tmp_path / "data", fmt, MESSAGES_ROWS)
    conversations = read_conversations(path)
    assert [c.messages for c in conversations] == [CHAT, CHAT[1:3]]
    assert conversations[1].origin == f"{path}: row 2"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_reads_prompt_completion_pairs(tmp_path, fmt):
    rows = [
        {"prompt": "What is 2 + 3?", "completion": "5"},
        {"prompt": "What is 4 + 4?", "completion": "8"},
    ]
    path = _write(tmp_path / "plain", fmt, rows)
    [first, _] = read_conversations(path)
    assert first.messages == [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert first.first_trained == 1
    chat_rows = [{"prompt": CHAT[:2], "completion": [CHAT[2]], "tools": json.dumps([{"type": "function"}])}] * 2
    [chat, _] = read_conversations(_write(tmp_path / "chat", fmt, chat_rows))
    assert chat.messages == CHAT[:3] and chat.first_trained == 2 and chat.tools == [{"type": "function"}]


@pytest.mark.parametrize(
    "content, row, expected",
    [
        ('{"messages": []}\n', 1, "expected `messages` to be a non-empty list of messages; got an empty list"),
        ('{"text": "hi"}\n', 1, "expected `messages`, or `prompt` and `completion`; found text"),
        ('\n{"messages": [{"role": "user", "content": "hi"}]}\n', 2, "expected an assistant message in the messages"),
        (
            '{"messages": [{"role": "human", "content": "hi"}]}\n',
            1,
            "messages message 1: expected role system, user, assistant or tool; got 'human'",
        ),
        (
            '{"messages": [{"role": "user", "content": 3}]}\n',
            1,
            "expected `content` to be a string or a list of parts; got a number",
        ),
        (
            '{"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}\n',
            1,
            "expected `prompt` and `completion` to be both strings or both lists of messages; got a string and a list",
        ),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', 1, "open with a system or user message"),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
            '"completion": [{"role": "user", "content": "c"}]}\n',
            1,
            "expected an assistant message in the completion",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n[1, 2]\n',
            2,
            "expected an object with `messages`, or `prompt` and `completion`; got a list",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{"messages": \n',
            2,
            "expected one JSON object per line",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": "{x"}\n',
            1,
            "`tools` is a string but not JSON",
        ),
    ],
)
def test_malformed_rows_name_the_file_and_row(tmp_path, content, row, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError) as info:
        read_conversations(path)
    assert f"{path}: row {row}: " in str(info.value)
    assert expected in str(info.value)


def test_malformed_parquet_row_names_its_position(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}]
    path = _write(tmp_path / "bad", "parquet", rows)
    with pytest.raises(UsageError, match=rf"{path}: row 2: expected `messages`, or `prompt` and `completion`"):
        read_conversations(path)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json"])
def test_a_binary_data_file_is_a_usage_error(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary")
    with pytest.raises(UsageError, match=rf"{path}: not UTF-8 text; expected JSON"):
        read_conversations(path)


def test_unreadable_sources_and_empty_data(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UsageError, match="unknown suffix; expected .jsonl, .json, .parquet"):
        read_conversations(tmp_path / "x.csv")
    with pytest.raises(UsageError, match="is not none, expert, episodes, or an existing data file"):
        read_conversations(tmp_path / "missing.jsonl")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UsageError, match="not a folder written by datasets' save_to_disk"):
        read_conversations(tmp_path / "folder")
    (tmp_path / "empty.jsonl").write_text("\n")
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", sft={"source": str(tmp_path / "empty.jsonl")}), tmp_path / "runs")
    with pytest.raises(UsageError, match="no conversations to train on"):
        load_conversations(ctx)


def test_recipe_mistakes_are_refused_before_any_work(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    with pytest.raises(UsageError, match="sft.source is none"):
        run_sft(ctx)
    ctx = make_ctx(
        write_recipe(
            tmp_path / "r2.yaml", run={"name": "u"}, sft={"source": "expert", "batch_size": 6, "micro_batch_size": 4}
        ),
        tmp_path / "runs",
    )
    with pytest.raises(UsageError, match=r"sft.batch_size \(6\) must be a multiple of sft.micro_batch_size \(4\)"):
        run_sft(ctx)


def test_a_missing_data_file_is_refused_before_the_model_loads(tmp_path, capsys, rlcli_home):
    """`rlcli sft sft.source=null` (a file named null) passed the schema, failed once the model had loaded,
    and left a failed run; now the command is refused first, and leaves no run."""
    from helpers import cli

    recipe = write_recipe(tmp_path / "r.yaml", sft={"source": "expert"})
    code, _, err = cli(capsys, "sft", "-r", recipe, "sft.source=null")
    assert code == 2 and "sft.source: null is not none, expert" in err and "sft.source=none" in err
    assert not (rlcli_home / "rlcli.db").exists()
    code, out, _ = cli(capsys, "recipes", "validate", recipe, "sft.source=null")  # says the same, as a stage would
    assert code == 2 and "sft.source: null is not none, expert" in out


def test_the_command_correcting_a_failed_sft_needs_no_force(tmp_path, capsys, rlcli_home):
    """A data file whose second row is no conversation fails SFT after the model loads, storing nothing.
    The command that corrects it was refused without --force: with another file, "exists with a
    different recipe"; with the same file mended, the failed stage's identity (data_sha256)."""
    from helpers import cli

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"chat": CHAT}) + "\n")
    good = _write(tmp_path / "good", "jsonl", [{"messages": CHAT}] * 2)
    sft = {"source": str(data), "batch_size": 2, "micro_batch_size": 1, "eval_fraction": 0}
    recipe = write_recipe(tmp_path / "r.yaml", sft=sft)
    for run in ("t", "u"):
        code, _, err = cli(capsys, "sft", "-r", recipe, "--run", run)
        assert code == 2 and "row 2" in err, err
    code, _, err = cli(capsys, "sft", "-r", recipe, "--run", "t", f"sft.source={good}")  # another file
    assert code == 0, err
    data.write_text(json.dumps({"messages": CHAT}) + "\n" * 2)  # the same file, mended
    code, _, err = cli(capsys, "sft", "-r", recipe, "--run", "u")
    assert code == 0, err
    # Once a run has stored work, a changed recipe needs --force again.
    code, _, err = cli(capsys, "sft", "-r", recipe, "--run", "u", "sft.lr=1e-3")
    assert code == 2 and "exists with a different recipe" in err


def test_a_run_whose_sft_is_done_resumes_from_a_folder_where_its_relative_data_path_finds_nothing(
    tmp_path, capsys, monkeypatch
):
    """The preflight check of sft.source refused `rlcli sft` (and `rlcli run`) of a run whose SFT was done, run
    from another folder, where the recipe's relative path finds nothing, though the data is not read again."""
    from helpers import cli

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    _write(here / "chat", "jsonl", [{"messages": CHAT}] * 2)
    sft = {"source": "chat.jsonl", "batch_size": 2, "micro_batch_size": 1, "eval_fraction": 0}
    recipe = write_recipe(here / "r.yaml", sft=sft)
    monkeypatch.chdir(here)
    code, _, err = cli(capsys, "sft", "-r", recipe)
    assert code == 0, err
    monkeypatch.chdir(elsewhere)
    code, _, err = cli(capsys, "sft", "-r", recipe)
    assert code == 0 and "sft" in err, err
    # A run whose SFT is not done still needs the file.
    code, _, err = cli(capsys, "sft", "-r", recipe, "--run", "other")
    assert code == 2 and "chat.jsonl" in err


# --- episodes of a run as data -------------------------------------------------------------------------


def _episode(ctx, index, messages, env_return=0.0, split="train", status="ok", run=None):
    row = {
        "run": run or ctx.run,
        "stage": "rollout",
        "task_index": index,
        "sample_index": 0,
        "split": split,
        "status": status,
        "env_return": env_return,
        "messages": json.dumps(messages),
    }
    with ctx.rundb.transaction() as db:
        return db["episodes"].insert(row).last_pk


def _label(ctx, episode_id, label_set, total):
    with ctx.rundb.transaction() as db:
        db["rewards"].insert({"episode_id": episode_id, "label_set": label_set, "component": "total", "value": total})


def _chat(answer):
    return [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": answer}]


def test_episodes_source_keeps_good_unique_training_episodes(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", sft={"source": "episodes", "min_reward": 1.0}), tmp_path / "runs")
    good = _episode(ctx, 0, _chat("5"))
    _label(ctx, good, "a", 1.0)
    _label(ctx, _episode(ctx, 1, _chat("5")), "a", 1.0)  # same transcript as `good`: kept once
    by_return = _episode(ctx, 2, _chat("five"), env_return=1.0)  # unlabelled: env return decides
    _episode(ctx, 3, _chat("6"), env_return=0.0)
    relabelled = _episode(ctx, 4, _chat("4"), env_return=1.0)
    _label(ctx, relabelled, "a", 1.0)
    _label(ctx, relabelled, "b", 0.0)  # the newest label set decides, not the env return
    _episode(ctx, 5, _chat("5 "), env_return=1.0, status="failed")
    _episode(ctx, 6, _chat("5  "), env_return=1.0, split="eval")  # held-out tasks never become data
    assert [c.origin for c in episode_conversations(ctx)] == [
        f"episode {good} of run t",
        f"episode {by_return} of run t",
    ]


def test_episodes_source_reads_another_run(tmp_path):
    other = make_ctx(write_recipe(tmp_path / "o.yaml", run={"name": "donor"}), tmp_path / "runs")
    donated = _episode(other, 0, _chat("5"), env_return=1.0)
    ctx = make_ctx(
        write_recipe(tmp_path / "r.yaml", sft={"source": "episodes", "from_run": "donor"}), tmp_path / "runs"
    )
    assert [c.messages for c in episode_conversations(ctx)] == [_chat("5")]
    assert episode_conversations(ctx)[0].origin == f"episode {donated} of run donor"
    ctx.recipe.sft.min_reward = 2.0
    with pytest.raises(UsageError, match="no finished training episode with total reward >= sft.min_reward"):
        episode_conversations(ctx)
    ctx.recipe.sft.from_run = "nobody"
    with pytest.raises(UsageError, match="No run named 'nobody'"):
        episode_conversations(ctx)


# --- training -------------------------------------------------------------------------------------------


def _mean_assistant_nll(model, rows) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]], device=model.device)
            trained = torch.tensor(row["assistant_masks"][1:], dtype=torch.bool, device=model.device)
            nll = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none")
            total += nll[trained].sum().item()
            count += int(trained.sum())
    return total / count


def test_sft_on_expert_demos_raises_their_likelihood(tmp_path):
    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.models.loading import load_policy

    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number"},
        sft={
            "source": "expert",
            "demos": 16,
            "lr": 1e-2,
            "epochs": 4,
            "batch_size": 4,
            "micro_batch_size": 4,
            "save_steps": 100,
            "eval_fraction": 0.25,
        },
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_sft(ctx)
    assert summary.examples == 16 and summary.eval_examples == 4 and summary.steps == 12

    r = ctx.recipe
    base, tokenizer = load_policy(r.model, r.lora, r.quantization, trainable=False)
    rows, _ = encode_conversations(tokenizer, load_conversations(ctx), r.model.max_length, _eos_ids(base, tokenizer))
    [row] = checkpoints(ctx.store)
    assert (row.stage, row.kind, row.path, row.id) == ("sft", "lora", summary.path, summary.checkpoint_id)
    assert resolve_checkpoint(ctx.store, "sft").id == row.id
    tuned, _ = load_policy(r.model, r.lora, r.quantization, adapter=row.path, trainable=False)
    before, after = _mean_assistant_nll(base, rows), _mean_assistant_nll(tuned, rows)
    assert after < before - 0.5, (before, after)

    logged = {m.key for m in ctx.rundb.metrics(ctx.run)}
    assert {"sft/loss", "sft/eval_loss", "sft/lr", "sft/grad_norm"} <= logged
    # Done is done: a second call returns the recorded summary and adds nothing.
    assert run_sft(ctx) == summary
    assert len(checkpoints(ctx.store)) == 1
    assert ctx.rundb.db.execute("select count(*) from episodes where stage = 'sft/demos'").fetchone()[0] == 16


@pytest.mark.parametrize("sections, kind", [({"lora": None}, "full"), ({"quantization": "4bit"}, "lora")])
def test_full_fine_tuning_and_4bit_lora_train_and_save(tmp_path, sections, kind):
    from rlcli.models.loading import load_policy

    data = _write(tmp_path / "data", "jsonl", [{"messages": CHAT}] * 4)
    ctx = make_ctx(
        write_recipe(
            tmp_path / "r.yaml",
            sft={"source": str(data), "batch_size": 2, "micro_batch_size": 1, "eval_fraction": 0},
            **sections,
        ),
        tmp_path / "runs",
    )
    summary = run_sft(ctx)
    assert summary.steps == 2 and summary.eval_loss is None
    assert checkpoints(ctx.store)[0].kind == kind
    assert all(m.value > 0 for m in ctx.rundb.metrics(ctx.run, "sft/grad_norm"))
    r = ctx.recipe
    load_policy(r.model, r.lora, r.quantization, adapter=summary.path, trainable=False)


def test_a_new_sft_lr_takes_effect_when_a_stage_resumes(tmp_path):
    from rlcli.engine.context import RunContext
    from rlcli.recipe import load_recipe
    from rlcli.store.db import RunDB

    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "arithmetic"},
        sft={"source": "expert", "demos": 8, "epochs": 2, "batch_size": 2, "micro_batch_size": 2, "save_steps": 2}
        | {"eval_fraction": 0.0, "lr": 1e-2},
    )
    runs = tmp_path / "runs"
    ctx = make_ctx(recipe, runs)
    run_sft(ctx)
    before = {m.step: m.value for m in ctx.rundb.metrics(ctx.run, "sft/lr")}
    # As if killed after step 6: its last checkpoint is step 6's, the stage is not done.
    for folder in (runs / "t" / "sft").glob("checkpoint-8"):
        shutil.rmtree(folder)
    ctx.rundb.mark_stage(ctx.run, "sft", "failed")

    resumed = load_recipe(recipe, ["sft.lr=1e-3"])
    rundb = RunDB.open(runs)
    rundb.start_run("t", resumed, str(recipe), force=True)  # rlcli sft --force sft.lr=1e-3
    run_sft(RunContext(resumed, rundb, "t", runs))
    after = {m.step: m.value for m in rundb.metrics("t", "sft/lr")}
    assert after[6] == before[6]
    assert after[7] == pytest.approx(before[7] / 10)


def test_kill_during_sft_resumes_from_its_checkpoint(tmp_path):
    demos = 24
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "arithmetic"},
        sft={
            "source": "expert",
            "demos": demos,
            "epochs": 6,
            "batch_size": 2,
            "micro_batch_size": 2,
            "save_steps": 3,
            "eval_fraction": 0.25,
        },
    )
    runs = tmp_path / "runs"
    resumed = kill_sft_at_a_checkpoint_and_resume(recipe, runs)
    assert resumed.returncode == 0, resumed.stderr
    assert "sft: resuming from" in resumed.stderr
    with sqlite3.connect(runs / "rlcli.db") as conn:
        result = json.loads(conn.execute("select result from stages where name = 'sft'").fetchone()[0])
        stored_demos = conn.execute("select count(*) from episodes where stage = 'sft/demos'").fetchone()[0]
        loss_steps = [s for (s,) in conn.execute("select step from metrics where key = 'sft/loss' order by step")]
        sft_checkpoints = conn.execute("select count(*) from checkpoints where stage = 'sft'").fetchone()[0]
    steps = result["steps"]
    assert steps == 6 * 9  # 18 training demos, 2 per step, 6 epochs
    assert 0 < result["resumed_from_step"] < steps
    assert stored_demos == demos and sft_checkpoints == 1
    # Steps before the kill are kept, steps redone after it overwrite their rows: one row per step.
    assert loss_steps == list(range(1, steps + 1))
    state = json.loads((runs / "t" / "sft" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    assert state["global_step"] == steps
    assert [h["step"] for h in state["log_history"] if "loss" in h] == list(range(1, steps + 1))


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_min_entropy_stops_sft_at_the_first_evaluation_below_it_and_a_kill_there_resumes_to_it(tmp_path):
    """sft.min_entropy ends SFT at the first held-out evaluation whose entropy is below it, with that
    step's weights. A kill after that step's checkpoint and before the stage ends must not train on: a
    resumed Trainer takes a step before any callback can stop it, so the checkpoint is loaded instead."""
    sft = {"source": "expert", "demos": 16, "epochs": 2, "batch_size": 2, "micro_batch_size": 2, "save_steps": 2}
    sft |= {"eval_fraction": 0.25, "lr": 1e-2}
    # Every weight trained: a LoRA adapter barely moves the tiny model's near-uniform distribution.
    sections = {"env": {"name": "arithmetic"}, "lora": None}
    free = make_ctx(write_recipe(tmp_path / "free.yaml", sft=sft, **sections), tmp_path / "free")
    untouched = run_sft(free)
    entropy = {m.step: m.value for m in free.rundb.metrics(free.run, "sft/eval_entropy")}
    assert sorted(entropy) == [0, 2, 4, 6, 8, 10, 12]  # before the first step, then at each checkpoint
    assert untouched.eval_entropy_before == entropy[0] and untouched.eval_entropy == entropy[12]
    assert not untouched.stopped_at_min_entropy and untouched.steps == 12
    assert entropy[4] < entropy[2], "SFT lowers the held-out entropy"
    floor = (entropy[2] + entropy[4]) / 2  # the evaluation at step 4 is the first below it

    recipe = write_recipe(tmp_path / "r.yaml", sft=sft | {"min_entropy": floor}, **sections)
    uninterrupted = run_sft(make_ctx(recipe, tmp_path / "uninterrupted"))
    assert (uninterrupted.steps, uninterrupted.stopped_at_min_entropy) == (4, True)
    runs = tmp_path / "runs"
    event = {"glob": "checkpoint-4/trainer_state.json", "root": str(runs / "t" / "sft")}
    kill_at_event(["sft", "-r", str(recipe)], runs, event, cwd=REPO)
    resumed = run_in_process(["sft", "-r", str(recipe)], runs, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert "sft: resuming from" in resumed.stderr
    ctx = make_ctx(recipe, runs)
    summary = run_sft(ctx)  # done: the recorded summary
    assert (summary.steps, summary.stopped_at_min_entropy, summary.resumed_from_step) == (4, True, 4)
    assert summary.eval_entropy == entropy[4] and summary.eval_entropy_before == entropy[0]
    assert sorted(m.step for m in ctx.rundb.metrics(ctx.run, "sft/loss")) == [1, 2, 3, 4]
    stopped, reference = _weights(Path(summary.path)), _weights(Path(uninterrupted.path))
    assert stopped.keys() == reference.keys()
    assert all(torch.equal(stopped[name], reference[name]) for name in stopped)


@pytest.mark.slow
@pytest.mark.learning
def test_smollm2_held_out_success_rises_after_sft_on_expert_demos(tmp_path, smollm2_cache):
    """The quickstart's game on the real model: base SmolLM2 cannot play guess_number; after SFT
    on 48 expert demos (twice the quickstart's light warm-start) it wins held-out games greedily."""
    from rlcli.engine.evaluate import run_eval

    recipe = REPO / "recipes" / "quickstart.yaml"
    ctx = make_ctx(
        recipe,
        tmp_path / "runs",
        ["sft.demos=48", "grpo.iterations=0", "eval.tasks=16", "eval.temperature=0", "rollout.engine=hf"],
    )
    run_sft(ctx)
    base, sft = run_eval(ctx, ["base", "sft"])
    assert sft.success_rate >= base.success_rate + 0.25, (base.success_rate, sft.success_rate)
