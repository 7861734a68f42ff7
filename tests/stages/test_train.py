"""`train grpo` end to end on the tiny model: learning, options, exact resume after kill -9."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from helpers import cli, kill_when, make_ctx, run_in_process, write_recipe
from rlcli.engine.grpo import learner, sources, update
from rlcli.engine.grpo.loop import run_grpo
from rlcli.engine.grpo.loss import policy_loss
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.store.checkpoints import checkpoints
from rlcli.store.db import RunDB
from rlcli.store.records import EndReason, Episode, Turn

DIGITS = "def digits(completions, **kwargs):\n    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"


def _metric(ctx, key):
    return [r.value for r in ctx.rundb.metrics(ctx.run, key)]


def _learnable_recipe(tmp_path, **extra):
    """Reward = share of digits in the answer: dense enough for a random tiny model to climb."""
    (tmp_path / "digit_reward.py").write_text(DIGITS)
    sections = dict(
        env={"name": "arithmetic"},
        lora=None,
        rewards=[{"fn": f"{tmp_path / 'digit_reward.py'}:digits", "name": "digits"}],
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16, "temperature": 1.0},
        grpo={"iterations": 12, "lr": 3e-2, "advantage": "grpo", "beta": 0.0},
    )
    for k, v in extra.items():
        sections[k] = {**sections[k], **v} if isinstance(v, dict) and isinstance(sections.get(k), dict) else v
    return write_recipe(tmp_path / "r.yaml", **sections)


def test_reward_rises_over_iterations(tmp_path):
    ctx = make_ctx(_learnable_recipe(tmp_path), tmp_path / "runs")
    run_grpo(ctx)
    rewards = _metric(ctx, "rollout/reward_mean")
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/kl",
        "train/zero_var_groups",
        "perf/tokens_per_s",
        "perf/time_rollout_s",
        "perf/time_label_s",
        "perf/time_train_s",
        "rollout/reward_std",
        "rollout/success_rate",
    ):
        assert _metric(ctx, key), key
    stages = {s.name: s.status for s in ctx.rundb.stages(ctx.run)}
    assert all(stages[f"{kind}/{i}"] == "done" for kind in ("rollout", "label", "train") for i in range(12))
    assert len(checkpoints(ctx.store)) == 12


@pytest.mark.parametrize(
    "options",
    [
        {"advantage": "dr_grpo", "aggregation": "seq_mean_token_sum_norm"},
        {"advantage": "rloo", "importance": "sequence", "clip_low": 3e-4, "clip_high": 4e-4},
        {"advantage": "batch", "aggregation": "seq_mean", "tis_cap": 2.0, "entropy_top_frac": 0.2},
        {
            "epochs": 2,
            "minibatch_size": 4,
            "micro_batch_size": 2,
            "beta": 0.1,
            "warmup_steps": 1,
            "schedule": "cosine",
            "drop_zero_var_groups": False,
        },
        {"gamma": 0.9, "gradient_checkpointing": True},
        {"step_groups": 0.5},
        {"entropy_target": 100.0, "entropy_coef_step": 0.01},  # above any entropy: the bonus is on from iteration 0
    ],
)
def test_objective_variants_run_and_change_the_adapter(tmp_path, options):
    recipe = _learnable_recipe(
        tmp_path,
        lora={"r": 4, "alpha": 8},
        grpo={"iterations": 1, **options},
        env={"name": "guess_number", "max_turns": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    from safetensors.torch import load_file

    ckpt = checkpoints(ctx.store)[-1]
    weights = load_file(f"{ckpt.path}/adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "LoRA B starts at zero and must have moved"
    assert _metric(ctx, "train/loss")
    assert 0.0 <= _metric(ctx, "perf/pad_frac")[0] < 1.0
    if options.get("step_groups"):  # guess_number's "Higher."/"Lower." repeat across a group's episodes
        assert 0.0 <= _metric(ctx, "train/step_groups_live")[0] <= 1.0
    if options.get("entropy_target"):
        assert _metric(ctx, "train/entropy_coef") == [pytest.approx(0.01)]
        assert _metric(ctx, "train/rollout_entropy")[0] > 0


def test_mask_truncated_leaves_out_episodes_cut_by_the_token_cap(tmp_path):
    recipe = _learnable_recipe(
        tmp_path,
        rollout={"max_new_tokens": 4},
        grpo={"iterations": 1, "mask_truncated": True, "drop_zero_var_groups": False},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    # A random model never ends an answer within 4 tokens: every episode is truncated.
    assert _metric(ctx, "train/sequences") == [0.0]
    assert _metric(ctx, "train/skipped") == [1.0]


def test_grpo_trains_a_4bit_model(tmp_path):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, quantization="4bit", grpo={"iterations": 1})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    assert _metric(ctx, "train/grad_norm")[0] > 0


def _final_state(runs_dir, run="t"):
    from safetensors.torch import load_file

    with sqlite3.connect(runs_dir / "rlcli.db") as conn:
        path = conn.execute("select path from checkpoints where run = ? order by id desc limit 1", [run]).fetchone()[0]
        path = runs_dir / path  # stored relative to the runs dir
        metrics = conn.execute(
            "select step, key, value from metrics where run = ? and key not like 'perf/%' order by step, key", [run]
        ).fetchall()
    return load_file(f"{path}/adapter_model.safetensors"), metrics


def test_kill_and_resume_ends_identical_to_an_uninterrupted_run(tmp_path):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 4})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    done = run_in_process(["train", "grpo", "-r", str(recipe)], clean)
    assert done.returncode == 0, done.stderr

    trained = "select count(*) from stages where name like 'train/%' and status = 'done'"
    assert kill_when(["train", "grpo", "-r", str(recipe)], killed, trained, 2, timeout=300) == 2  # of 4
    done = run_in_process(["train", "grpo", "-r", str(recipe)], killed)  # the resume, in this process
    assert done.returncode == 0, done.stderr

    weights_a, metrics_a = _final_state(clean)
    weights_b, metrics_b = _final_state(killed)
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        assert torch.allclose(weights_a[k], weights_b[k], atol=1e-6), k
    assert [(s, k) for s, k, _ in metrics_a] == [(s, k) for s, k, _ in metrics_b]
    for (_, key, va), (_, _, vb) in zip(metrics_a, metrics_b):
        assert va == pytest.approx(vb, abs=1e-6), key


def _tiny_policy(lora=True, dtype="float32"):
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    torch.manual_seed(0)
    model, _ = load_policy(
        ModelSection(name="tiny-random", dtype=dtype),
        LoraSection(r=4, alpha=8, dropout=0.0) if lora else None,
        QuantizationSection(),
        trainable=True,
    )
    model.train()
    return model


def _multi_turn_sequences():
    """Three conversations sharing a 20-token prompt: one of two assistant turns with an observation
    between them, two of one turn; different lengths, so the micro-batch is padded."""
    prompt = list(range(3, 23))
    turns = [
        [(list(range(30, 36)), 1.0), (list(range(60, 64)), 0.0), (list(range(36, 41)), 1.0)],
        [(list(range(40, 43)), 1.0)],
        [(list(range(50, 59)), 1.0)],
    ]
    seqs = []
    for i, parts in enumerate(turns):
        ids, mask = list(prompt), [0.0] * len(prompt)
        for tokens, trainable in parts:
            ids += tokens
            mask += [trainable] * len(tokens)
        seqs.append(
            update.TrainSequence(
                i, 0, ids, mask, [0.0] * len(ids), [0] * len(ids), advantage=[float(i) - 1.0] * len(ids)
            )
        )
    return seqs


def _reference_logprobs(model, batch, temperature):
    """rlcli's update before chunking: the model's forward builds [B, keep, V] float32 logits, then a
    full log_softmax and entropy over them."""
    cache = None
    if batch.prefix_ids is not None:
        cache = model(input_ids=batch.prefix_ids, use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(batch.input_ids.shape[0])
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        past_key_values=cache,
        logits_to_keep=batch.keep + 1,
        use_cache=cache is not None,
    )
    logp_all = (out.logits[:, :-1, :].float() / temperature).log_softmax(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    return logp_all.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1), entropy


def _loss_and_grads(model, batch, logprobs):
    model.zero_grad(set_to_none=True)
    loss, _ = policy_loss(logprobs, logprobs.detach() - 0.1, batch.advantages, batch.mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _rel(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-30))


@pytest.mark.parametrize(
    "lora,checkpointing,share_prefix",
    [(True, False, True), (True, False, False), (True, True, False), (False, False, True)],
)
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_logits(monkeypatch, lora, checkpointing, share_prefix):
    """Chunked logprobs (a chunk of 2 positions here) equal full-vocabulary logits within 1e-5
    relative, and so do the loss's gradients: LoRA or every weight (the LM head's included),
    with gradient checkpointing, with and without the shared-prefix forward."""
    monkeypatch.setattr(update, "LOGIT_CHUNK_VALUES", 2 * 512)  # tiny-random's vocabulary is 512
    model = _tiny_policy(lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    seqs = _multi_turn_sequences()
    batch = update._collate(seqs, model, share_prefix=share_prefix)
    assert (batch.prefix_ids is not None) == share_prefix
    live = batch.mask > 0
    update.check_output_head(model, seqs[0].ids)

    logprobs, entropy = update.token_logprobs(model, batch, 0.7, entropy=True)
    loss, grads = _loss_and_grads(model, batch, logprobs)
    ref_logprobs, ref_entropy = _reference_logprobs(model, batch, 0.7)
    ref_loss, ref_grads = _loss_and_grads(model, batch, ref_logprobs)

    assert _rel(logprobs[live], ref_logprobs[live]) < 1e-5
    assert _rel(entropy[live], ref_entropy[live]) < 1e-5
    assert bool((logprobs[~live] == 0).all())
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    # Without LoRA the embeddings train, and tiny-random ties them to the LM head: its gradient is in theirs.
    assert grads.keys() == ref_grads.keys() and ("model.embed_tokens.weight" in grads) == (not lora)
    for name, grad in ref_grads.items():
        assert _rel(grads[name], grad) < 1e-5, name


def test_the_backward_keeps_no_logits(monkeypatch):
    """What autograd saves for the backward: hidden states, no [positions, vocab] logits."""
    monkeypatch.setattr(update, "LOGIT_CHUNK_VALUES", 2 * 512)
    model = _tiny_policy()
    seqs = _multi_turn_sequences()
    batch = update._collate(seqs, model)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:  # the LM head's weight is saved, and is no logit
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        update.token_logprobs(model, batch, 1.0, entropy=True)
    assert saved  # the hook sees what the backward keeps
    # No logits at all: each chunk's are recomputed when its gradient is needed.
    assert all(not s or s[-1] != 512 for s in saved), saved  # CUDA kernels also save scalars
    assert int((batch.mask > 0).sum()) > 2  # so the full micro-batch would have been more


def test_micro_batches_by_length_cover_the_minibatch_with_less_padding():
    """Rows of similar length go together: the same minibatch (so the same gradient), less padding
    than the shuffled order's split, and the same split every time."""
    lengths = [20, 80, 25, 75, 30, 70, 22, 78]
    seqs = [
        update.TrainSequence(i, 0, list(range(3, 3 + n)), [0.0] * (n - 5) + [1.0] * 5, [0.0] * n, [0] * n)
        for i, n in enumerate(lengths)
    ]
    shuffled = [5, 0, 3, 6, 1, 2, 7, 4]
    plan = update.micro_batches(seqs, shuffled, 2)
    assert sorted(i for micro in plan for i in micro) == sorted(shuffled)
    assert plan == update.micro_batches(seqs, shuffled, 2) == [[1, 7], [3, 5], [4, 2], [6, 0]]

    def pad_frac(micro_batches):
        counts = [update.padding([seqs[i] for i in m], 0) for m in micro_batches]
        return sum(pad for _, pad in counts) / sum(pos for pos, _ in counts)

    unsorted = [shuffled[k : k + 2] for k in range(0, 8, 2)]
    assert pad_frac(plan) < 0.05 < 0.3 < pad_frac(unsorted)


def test_bfloat16_weights_train_a_float32_adapter_within_stated_tolerances():
    """model.dtype bfloat16 with LoRA: the frozen weights are bf16, the adapter (and so AdamW's state)
    stays float32 (peft upcasts it). Against the same model in float32, on tiny-random: token logprobs
    within 1e-2 (measured 1.8e-3), the loss within 1e-2 relative (1e-3), the adapter's gradients within
    5e-2 relative (1.2e-2). The error is bf16's rounding of hidden states and logits (8 mantissa bits);
    models with larger logits than this random one round more coarsely."""
    results = {}
    old = None
    for dtype in ("float32", "bfloat16"):
        model = _tiny_policy(dtype=dtype)
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert trained == {torch.float32} and frozen == {getattr(torch, dtype)}
        batch = update._collate(_multi_turn_sequences(), model)
        logprobs, _ = update.token_logprobs(model, batch, 1.0)
        if old is None:  # the same pi_old for both, a little away from the policy so ratios vary
            old = logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0)).to(
                logprobs.device
            )
        loss, _ = policy_loss(logprobs, old, batch.advantages, batch.mask, clip_low=0.2, clip_high=0.2)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results[dtype] = logprobs.detach()[batch.mask > 0], loss.detach(), grads
    (lp32, loss32, grads32), (lp16, loss16, grads16) = results["float32"], results["bfloat16"]
    assert float((lp32 - lp16).abs().max()) < 1e-2
    assert float(loss16) == pytest.approx(float(loss32), rel=1e-2)
    for name, grad in grads32.items():
        if grad.norm() > 0:  # LoRA A starts with a zero gradient (B is 0)
            assert _rel(grads16[name], grad) < 5e-2, name


def test_grpo_trains_in_bfloat16_with_gradient_checkpointing(tmp_path):
    from safetensors.torch import load_file

    recipe = _learnable_recipe(
        tmp_path,
        model={"dtype": "bfloat16"},
        lora={"r": 4, "alpha": 8},
        grpo={"iterations": 1, "gradient_checkpointing": True},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    weights = load_file(f"{checkpoints(ctx.store)[-1].path}/adapter_model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)


def test_shared_prefix_forward_gives_the_same_loss_and_gradients(monkeypatch):
    """The update forwards a micro-batch's common prefix once; loss and LoRA gradients equal those
    of forwarding every full sequence (rows of different lengths, left padding included)."""
    model = _tiny_policy()
    seqs = _multi_turn_sequences()
    assert update._shared_prefix(seqs) == 19  # stops before the last prompt token, whose logit is trained

    def loss_and_grads():
        batch = update._collate(seqs, model)
        logprobs, _ = update.token_logprobs(model, batch, 1.0)
        return (batch, *_loss_and_grads(model, batch, logprobs))

    shared_batch, shared_loss, shared_grads = loss_and_grads()
    assert shared_batch.prefix_ids.shape == (1, 19)
    monkeypatch.setattr(update, "_shared_prefix", lambda micro: 0)
    full_batch, full_loss, full_grads = loss_and_grads()
    assert full_batch.prefix_ids is None
    assert torch.allclose(shared_loss, full_loss, atol=1e-5)
    for name, grad in full_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-3), name


def test_the_tokenizer_is_serialised_once_and_every_checkpoint_loads_it_alone(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from rlcli.models.loading import load_policy, save_checkpoint
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    model, tokenizer = load_policy(
        ModelSection(name="tiny-random", dtype="float32"), LoraSection(r=4), QuantizationSection()
    )
    calls = []
    original = tokenizer.save_pretrained
    monkeypatch.setattr(
        tokenizer, "save_pretrained", lambda folder, **kw: calls.append(folder) or original(folder, **kw)
    )
    for i in range(3):
        save_checkpoint(model, tokenizer, tmp_path / f"iter-{i}")
    assert len(calls) == 1
    shutil.rmtree(tmp_path / "iter-0")  # the folders share nothing that removing one would break
    text = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>"
    for i in (1, 2):
        loaded = AutoTokenizer.from_pretrained(tmp_path / f"iter-{i}")
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.chat_template == tokenizer.chat_template


# --- what training leaves out: one meaning of "truncated" -------------------------------------

TRUNCATED_REWARD = (
    "def truncated(completions, episodes, **kwargs):\n    return [float(ep['truncated']) for ep in episodes]\n"
)


def _stored_episode(ctx, sample: int, end_reason: EndReason, completion_ids: list[int]) -> Episode:
    """An episode of rollout/0, task 0, as the rollout engine would store it."""
    prompt_ids = list(range(3, 19))
    return Episode(
        id=None,
        run=ctx.run,
        stage="rollout/0",
        iteration=0,
        split="train",
        task_index=0,
        sample_index=sample,
        seed=0,
        policy="base",
        status="ok",
        end_reason=end_reason,
        env_return=0.0,
        success=False,
        num_turns=1,
        num_tokens=len(completion_ids),
        task={},
        messages=[{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}],
        template_consistent=True,
        error=None,
        created_at="2025-01-01T00:00:00.000+00:00",
        turns=[Turn(0, prompt_ids, completion_ids, [-1.0] * len(completion_ids))],
    )


def test_mask_truncated_follows_the_end_reason_and_rewards_see_the_same(tmp_path):
    """A reply ended by a stop string (its last token is no eos) is not truncated; the turn cap and
    the token cap are, whatever the last token. Reward functions get the same flag."""
    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_tokenizer
    from rlcli.recipe import ModelSection
    from rlcli.store.episodes import episodes_for_training, store_episodes

    (tmp_path / "truncated.py").write_text(TRUNCATED_REWARD)
    recipe = _learnable_recipe(
        tmp_path,
        lora={"r": 4, "alpha": 8},
        rewards=[{"fn": f"{tmp_path / 'truncated.py'}:truncated", "name": "truncated"}],
        rollout={"stop": ["5"]},
        grpo={"iterations": 1, "mask_truncated": True, "drop_zero_var_groups": False},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    eos = load_tokenizer(ModelSection(name="tiny-random"), resolve_model("tiny-random")).eos_token_id
    ended = [
        (EndReason.TERMINATED, [40, 41]),  # on the stop string "5"
        (EndReason.TERMINATED, [45, 41]),
        (EndReason.MAX_TURNS, [42, eos]),
        (EndReason.LENGTH, [43, 44]),
    ]
    store_episodes(ctx.rundb, [_stored_episode(ctx, i, reason, ids) for i, (reason, ids) in enumerate(ended)])
    # Marked done as the stage would be, with the summary of the four episodes stored above.
    summary = {"episodes": 4, "failed": 0, "return_mean": 0.0, "success_rate": 0.0, "turns_mean": 1.0, "tokens": 8}
    ctx.rundb.mark_stage(ctx.run, "rollout/0", "done", result=summary)
    run_grpo(ctx)

    labelled = episodes_for_training(ctx.store, "rollout/0", GRPO_LABEL_SET)
    assert [(e.episode.end_reason, e.reward) for e in labelled] == [
        (EndReason.TERMINATED, 0.0),
        (EndReason.TERMINATED, 0.0),
        (EndReason.MAX_TURNS, 1.0),
        (EndReason.LENGTH, 1.0),
    ]
    assert _metric(ctx, "train/sequences") == [2.0]  # the stop-string replies alone


# --- resuming ---------------------------------------------------------------------------------


def _resume(recipe, runs_dir, *overrides: str):
    """Continue the run with overrides that need --force (as `rlcli train grpo --force` does)."""
    from rlcli.engine.context import RunContext
    from rlcli.recipe import load_recipe

    new = load_recipe(recipe, list(overrides))
    rundb = RunDB.open(runs_dir)
    rundb.start_run(new.run.name, new, str(recipe), force=True)
    return RunContext(new, rundb, new.run.name, runs_dir)


def _interrupt_at(monkeypatch, stage: str) -> None:
    """Stop run_grpo like Ctrl-C as the rollout of `stage` begins."""
    collect = sources.collect

    def interrupted(ctx, **kwargs):
        if kwargs["stage"] == stage:
            raise KeyboardInterrupt
        return collect(ctx, **kwargs)

    monkeypatch.setattr(sources, "collect", interrupted)


def test_resume_from_another_directory_continues_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 1})
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    runs = first / "runs"
    monkeypatch.setenv("RLCLI_HOME", str(runs))

    def grpo(cwd, runs_dir, *overrides):
        monkeypatch.chdir(cwd)  # the command in this process, run from cwd
        return cli(capsys, "--runs-dir", runs_dir, "train", "grpo", "-r", recipe, *overrides)

    assert grpo(first, "runs")[0] == 0
    code, _, err = grpo(second, runs, "grpo.iterations=2")
    assert code == 0, err
    assert "iterations 1..1, starting from checkpoint" in err

    # A recorded checkpoint that cannot be found is an error naming it, never a fresh start.
    shutil.move(runs / "t" / "checkpoints" / "iter-0001", tmp_path / "moved")
    code, _, err = grpo(second, runs, "grpo.iterations=3")
    assert code == 2, err
    assert "iter-0001" in err and "Traceback" not in err


def test_force_lr_takes_effect_on_resume(tmp_path):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 1, "lr": 1e-2})
    runs = tmp_path / "runs"
    run_grpo(make_ctx(recipe, runs))
    ctx = _resume(recipe, runs, "grpo.lr=1e-4", "grpo.iterations=2")
    run_grpo(ctx)
    assert _metric(ctx, "train/lr") == pytest.approx([1e-2, 1e-4])


def test_raising_iterations_mid_schedule_continues_the_decay_without_a_jump(tmp_path, monkeypatch):
    recipe = _learnable_recipe(
        tmp_path,
        lora={"r": 4, "alpha": 8},
        grpo={"iterations": 4, "lr": 1e-2, "schedule": "linear", "drop_zero_var_groups": False},
    )
    runs = tmp_path / "runs"
    _interrupt_at(monkeypatch, "rollout/2")
    with pytest.raises(KeyboardInterrupt):
        run_grpo(make_ctx(recipe, runs))
    monkeypatch.undo()

    ctx = make_ctx(recipe, runs, ["grpo.iterations=8"])
    run_grpo(ctx)
    # One optimizer step per iteration: 4 steps planned, 2 taken, the remaining half of the decay
    # stretched over the 6 steps now left (the lr an iteration starts with).
    remaining = [0.5 - (0.5 / 6) * i for i in range(6)]
    assert _metric(ctx, "train/lr") == pytest.approx([1e-2 * f for f in [1.0, 0.75, *remaining]])


def test_an_iteration_commits_its_checkpoint_metrics_and_stage_together(tmp_path, monkeypatch):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 2})
    ctx = make_ctx(recipe, tmp_path / "runs")
    log_metrics = RunDB.log_metrics

    def killed_before_the_metrics(self, run, stage, step, values):
        if stage == learner.METRICS_STAGE and step == 1:
            raise RuntimeError("killed")
        return log_metrics(self, run, stage, step, values)

    monkeypatch.setattr(RunDB, "log_metrics", killed_before_the_metrics)
    with pytest.raises(RuntimeError, match="killed"):
        run_grpo(ctx)
    # Iteration 0 is recorded whole, iteration 1 not at all.
    assert [c.iteration for c in checkpoints(ctx.store)] == [0]
    assert not ctx.rundb.stage(ctx.run, "train/1").done
    assert {m.step for m in ctx.rundb.metrics(ctx.run)} == {0}

    monkeypatch.undo()
    run_grpo(ctx)
    assert [c.iteration for c in checkpoints(ctx.store)] == [0, 1]
    assert ctx.rundb.stage(ctx.run, "train/1").done
    assert {m.step for m in ctx.rundb.metrics(ctx.run)} == {0, 1}


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    from safetensors.torch import load_file

    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 2})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    newest = Path(checkpoints(ctx.store)[-1].path)
    weights = load_file(newest / "adapter_model.safetensors")
    state = newest / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # what a host crash can leave behind

    run_grpo(ctx)
    assert "unreadable" in capsys.readouterr().err
    assert [c.iteration for c in checkpoints(ctx.store)] == [0, 1]
    redone = load_file(newest / "adapter_model.safetensors")
    for key, value in weights.items():
        assert torch.allclose(redone[key], value, atol=1e-6), key
    torch.load(state, weights_only=True)


def test_episodes_of_a_resumed_iteration_name_the_policy_that_played_them(tmp_path):
    """Found by the kill-fuzz: resuming at iteration 1 labelled rollout/1's episodes with the
    resumed checkpoint's id instead of train/0, unlike an uninterrupted run."""
    from rlcli.store.episodes import stage_episodes

    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 1})
    runs = tmp_path / "runs"
    run_grpo(make_ctx(recipe, runs))
    ctx = make_ctx(recipe, runs, ["grpo.iterations=2"])  # a new process resumes from train/0's checkpoint
    run_grpo(ctx)
    assert {e.policy for e in stage_episodes(ctx.store, "rollout/1")} == {"train/0"}
