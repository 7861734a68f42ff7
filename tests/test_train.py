"""`train grpo` end to end on the tiny model: learning, options, exact resume after kill -9."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time

import pytest
import torch

from helpers import RLCLI, cli_env, make_ctx, run_cli, write_recipe
from rlcli.engine.train import run_grpo

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
    assert len(ctx.rundb.checkpoints(ctx.run)) == 12


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

    ckpt = ctx.rundb.checkpoints(ctx.run)[-1]
    weights = load_file(f"{ckpt.path}/adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "LoRA B starts at zero and must have moved"
    assert _metric(ctx, "train/loss")


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
        metrics = conn.execute(
            "select step, key, value from metrics where run = ? and key not like 'perf/%' order by step, key", [run]
        ).fetchall()
    return load_file(f"{path}/adapter_model.safetensors"), metrics


def test_kill_and_resume_ends_identical_to_an_uninterrupted_run(tmp_path):
    recipe = _learnable_recipe(tmp_path, lora={"r": 4, "alpha": 8}, grpo={"iterations": 4})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_cli(["train", "grpo", "-r", str(recipe)], clean).returncode == 0

    proc = subprocess.Popen(
        RLCLI + ["train", "grpo", "-r", str(recipe)],
        env=cli_env(killed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        try:
            with sqlite3.connect(killed / "rlcli.db") as conn:
                done = conn.execute(
                    "select count(*) from stages where name like 'train/%' and status = 'done'"
                ).fetchone()[0]
        except sqlite3.Error:
            continue
        if done >= 2:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_cli(["train", "grpo", "-r", str(recipe)], killed)
    assert resumed.returncode == 0, resumed.stderr

    weights_a, metrics_a = _final_state(clean)
    weights_b, metrics_b = _final_state(killed)
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        assert torch.allclose(weights_a[k], weights_b[k], atol=1e-6), k
    assert [(s, k) for s, k, _ in metrics_a] == [(s, k) for s, k, _ in metrics_b]
    for (_, key, va), (_, _, vb) in zip(metrics_a, metrics_b):
        assert va == pytest.approx(vb, abs=1e-6), key


def test_shared_prefix_forward_gives_the_same_loss_and_gradients(monkeypatch):
    """The update forwards a micro-batch's common prefix once; loss and LoRA gradients equal those
    of forwarding every full sequence (rows of different lengths, left padding included)."""
    from rlcli.engine import grpo, train
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    torch.manual_seed(0)
    model, _ = load_policy(
        ModelSection(name="tiny-random"), LoraSection(r=4, alpha=8, dropout=0.0), QuantizationSection(), trainable=True
    )
    model.train()
    prompt = list(range(3, 23))  # 20 shared tokens
    tails = [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53, 54, 55, 56]]
    seqs = []
    for i, tail in enumerate(tails):
        ids = prompt + tail
        mask = [0.0] * (len(prompt) + 1) + [1.0] * (len(tail) - 1)
        seqs.append(
            train.TrainSequence(
                i, 0, ids, mask, [0.0] * len(ids), [0] * len(ids), advantage=[float(i) - 1.0] * len(ids)
            )
        )
    assert train._shared_prefix(seqs) == 20

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        batch = train._collate(seqs, model)
        logprobs = grpo.selective_log_softmax(train._forward(model, batch), batch["targets"])
        loss, _ = grpo.policy_loss(
            logprobs, logprobs.detach() - 0.1, batch["advantages"], batch["mask"], clip_low=0.2, clip_high=0.2
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return batch, loss.detach(), grads

    shared_batch, shared_loss, shared_grads = loss_and_grads()
    assert shared_batch["prefix_ids"].shape == (1, 20)
    monkeypatch.setattr(train, "_shared_prefix", lambda micro: 0)
    full_batch, full_loss, full_grads = loss_and_grads()
    assert full_batch["prefix_ids"] is None
    assert torch.allclose(shared_loss, full_loss, atol=1e-5)
    for name, grad in full_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-3), name
