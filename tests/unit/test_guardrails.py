"""Run-time warnings (engine/guardrails.py) and run events (store/events.py)."""

from __future__ import annotations

import json

import pytest

from helpers import cli, make_ctx, write_recipe
from rlcli.engine import guardrails
from rlcli.engine.guardrails import (
    entropy_collapse,
    no_signal,
    reward_up_heldout_down,
    worse_than_start,
)
from rlcli.store.checkpoints import add_checkpoint
from rlcli.store.events import add_event, list_events

# --- the checks on constructed series ---------------------------------------------------------


def test_reward_up_heldout_down_fires_at_the_eval_that_completes_the_pattern():
    reward = {i: 0.1 + 0.05 * i for i in range(10)}  # rising all along
    heldout = {-1: 0.30, 4: 0.20, 9: 0.10}  # falling at every eval
    warning = reward_up_heldout_down(reward, heldout, 9, "r1")
    assert warning is not None and warning.kind == "reward_up_heldout_down"
    assert warning.details["iterations"] == [-1, 4, 9] and "rising" in warning.message
    assert "`rlcli runs episodes r1 --best`" in warning.message, "the advice names the run"
    assert reward_up_heldout_down(reward, heldout, 8, "r1") is None, "only judged where a held-out eval was made"
    assert reward_up_heldout_down(reward, {-1: 0.30, 4: 0.20}, 4, "r1") is None, "needs three evals"


@pytest.mark.parametrize(
    "reward, heldout",
    [
        ({i: 0.1 + 0.05 * i for i in range(10)}, {-1: 0.10, 4: 0.20, 9: 0.30}),  # both rise: healthy
        ({i: 0.1 + 0.05 * i for i in range(10)}, {-1: 0.30, 4: 0.32, 9: 0.10}),  # held-out not falling throughout
        ({i: 0.1 + 0.05 * i for i in range(10)}, {-1: 0.30, 4: 0.29, 9: 0.28}),  # within the noise margin
        ({i: 0.6 - 0.05 * i for i in range(10)}, {-1: 0.30, 4: 0.20, 9: 0.10}),  # train reward falls too
    ],
)
def test_reward_up_heldout_down_stays_quiet_otherwise(reward, heldout):
    assert reward_up_heldout_down(reward, heldout, 9, "r1") is None


def test_reward_up_heldout_down_is_raised_once_while_it_lasts():
    reward = {i: 0.05 * i for i in range(15)}
    heldout = {-1: 0.40, 4: 0.30, 9: 0.20, 14: 0.10}
    assert reward_up_heldout_down(reward, heldout, 9, "r1") is not None
    assert reward_up_heldout_down(reward, heldout, 14, "r1") is None


def test_worse_than_start_needs_the_drop_to_be_beyond_noise():
    # The dataset B: SFT 28% -> GRPO 3% held out, 64 tasks.
    warning = worse_than_start({-1: 0.28, 9: 0.03}, 9, 64, "sft")
    assert warning is not None and "making the sft policy worse" in warning.message
    assert warning.details["ci_high"] < 0.28
    assert worse_than_start({-1: 0.28, 9: 0.22}, 9, 64, "sft") is None  # within its interval
    assert worse_than_start({-1: 0.28, 9: 0.40}, 9, 64, "sft") is None  # better
    assert worse_than_start({-1: 0.28, 9: 0.03}, 8, 64, "sft") is None  # no eval at iteration 8
    assert worse_than_start({9: 0.03}, 9, 64, "sft") is None  # no starting point to compare with
    # Raised when it starts, not again at the next eval while it lasts.
    assert worse_than_start({-1: 0.28, 4: 0.03, 9: 0.02}, 9, 64, "sft") is None


def test_entropy_collapse_fires_when_entropy_falls_below_the_threshold():
    entropy = {0: 0.9, 1: 0.4, 2: 0.03, 3: 0.02}
    warning = entropy_collapse(entropy, 2, 0.05)
    assert warning is not None and warning.kind == "entropy_collapse" and "0.030" in warning.message
    assert entropy_collapse(entropy, 3, 0.05) is None, "raised once while it lasts"
    assert entropy_collapse(entropy, 1, 0.05) is None
    assert entropy_collapse(entropy, 2, 0.0) is None, "0 disables it"
    assert entropy_collapse({0: 0.01}, 0, 0.05) is not None


def test_no_signal_fires_after_patience_iterations_without_variance():
    groups = dict.fromkeys(range(8), 4.0)
    zero_var = {0: 1.0, 1: 4.0, 2: 4.0, 3: 4.0, 4: 4.0, 5: 2.0, 6: 4.0, 7: 4.0}
    warning = no_signal(zero_var, groups, 3, 3)
    assert warning is not None and warning.message.startswith("GRPO is getting no signal")
    assert "too hard or too easy" in warning.message and "group_size" in warning.message
    assert warning.details["iterations"] == [1, 2, 3]
    assert [it for it in range(8) if no_signal(zero_var, groups, it, 3)] == [3], "once per stretch"
    assert no_signal(zero_var, groups, 3, 0) is None, "0 disables it"
    assert no_signal(dict.fromkeys(range(8), 0.0), groups, 5, 3) is None  # healthy: every group varies


# --- stored as run events -------------------------------------------------------------------


def metrics_ctx(tmp_path, **grpo):
    recipe = write_recipe(tmp_path / "r.yaml", grpo={"iterations": 10, "eval_every": 5, "eval_tasks": 64, **grpo})
    return make_ctx(recipe, tmp_path / "runs")


def log_run(ctx, iterations, heldout=None, **series):
    """Write per-iteration metrics as run_grpo does (stage grpo, step = iteration)."""
    for it in iterations:
        values = {key: values[it] for key, values in series.items() if it in values}
        ctx.rundb.log_metrics(ctx.run, "grpo", it, values)
    for it, rate in (heldout or {}).items():
        ctx.rundb.log_metrics(ctx.run, "grpo", it, {guardrails.HELDOUT: rate})


def test_a_collapsing_run_raises_each_warning_once_and_a_resume_does_not_repeat_them(tmp_path):
    ctx = metrics_ctx(tmp_path)
    sft = tmp_path / "sft"
    sft.mkdir()
    add_checkpoint(ctx.store, "sft", 0, sft, "lora")
    log_run(
        ctx,
        range(10),
        heldout={-1: 0.28, 4: 0.22, 9: 0.03},  # 0.22 is within the noise of 0.28
        **{
            guardrails.REWARD: {i: 0.1 + 0.05 * i for i in range(10)},
            guardrails.ENTROPY: {i: 1.0 / (i + 1) ** 2 for i in range(10)},  # below 0.05 from iteration 4
            guardrails.ZERO_VAR: {i: 2.0 if i >= 6 else 0.0 for i in range(10)},
            guardrails.GROUPS: dict.fromkeys(range(10), 2.0),
        },
    )
    raised = {it: [w.kind for w in guardrails.check(ctx, it)] for it in range(10)}
    assert raised[4] == ["entropy_collapse"]
    assert raised[8] == ["no_signal"]
    assert raised[9] == ["reward_up_heldout_down", "worse_than_start"]
    assert sum(len(kinds) for kinds in raised.values()) == 4
    events = list_events(ctx.store)
    assert [(e.iteration, e.kind, e.stage) for e in events] == [
        (4, "entropy_collapse", "train/4"),
        (8, "no_signal", "train/8"),
        (9, "reward_up_heldout_down", "train/9"),
        (9, "worse_than_start", "train/9"),
    ]
    assert events[3].details["start"] == "sft" and events[3].details["episodes"] == 64

    # A resumed run checks its redone iterations again: nothing new is printed or stored.
    assert all(guardrails.check(ctx, it) == [] for it in range(10))
    assert len(list_events(ctx.store)) == 4


def test_a_healthy_run_raises_no_warning(tmp_path):
    ctx = metrics_ctx(tmp_path)
    log_run(
        ctx,
        range(10),
        heldout={-1: 0.10, 4: 0.25, 9: 0.40},
        **{
            guardrails.REWARD: {i: 0.1 + 0.05 * i for i in range(10)},
            guardrails.ENTROPY: {i: 0.8 - 0.02 * i for i in range(10)},
            guardrails.ZERO_VAR: {i: 1.0 for i in range(10)},
            guardrails.GROUPS: dict.fromkeys(range(10), 2.0),
        },
    )
    assert [w for it in range(10) for w in guardrails.check(ctx, it)] == []
    assert list_events(ctx.store) == []


def test_metrics_after_the_iteration_checked_are_not_read(tmp_path):
    # An interrupted run may have left metrics of iterations that the resumed run is redoing.
    ctx = metrics_ctx(tmp_path)
    log_run(ctx, range(5), **{guardrails.ENTROPY: {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.01, 4: 0.01}})
    assert guardrails.check(ctx, 2) == []
    assert [w.kind for w in guardrails.check(ctx, 3)] == ["entropy_collapse"]


def test_thresholds_come_from_the_recipe(tmp_path):
    ctx = metrics_ctx(tmp_path, min_entropy=0.0, zero_signal_patience=0)
    log_run(
        ctx,
        range(5),
        **{
            guardrails.ENTROPY: dict.fromkeys(range(5), 0.001),
            guardrails.ZERO_VAR: dict.fromkeys(range(5), 2.0),
            guardrails.GROUPS: dict.fromkeys(range(5), 2.0),
        },
    )
    assert [w for it in range(5) for w in guardrails.check(ctx, it)] == []


def test_add_event_is_idempotent_per_kind_and_iteration(tmp_path):
    ctx = metrics_ctx(tmp_path)
    assert add_event(ctx.store, "train/3", 3, "no_signal", "first", {"a": 1})
    assert not add_event(ctx.store, "train/3", 3, "no_signal", "again", {"a": 2})
    assert add_event(ctx.store, "train/4", 4, "no_signal", "later", {})
    assert add_event(ctx.store, "train/3", 3, "entropy_collapse", "other kind", {})
    events = list_events(ctx.store)
    assert [(e.iteration, e.kind, e.message) for e in events] == [
        (3, "no_signal", "first"),
        (4, "no_signal", "later"),
        (3, "entropy_collapse", "other kind"),
    ]
    assert events[0].details == {"a": 1}
    assert [e.iteration for e in list_events(ctx.store, kind="no_signal")] == [3, 4]


def test_runs_show_lists_the_events(tmp_path, capsys, monkeypatch):
    ctx = metrics_ctx(tmp_path)
    add_event(ctx.store, "train/7", 7, "no_signal", "GRPO is getting no signal: try things.", {"x": 1})
    ctx.rundb.close()
    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "runs"))

    def show(*options: str) -> str:
        code, out, err = cli(capsys, "runs", "show", ctx.run, *options)
        assert code == 0, err
        return out

    data = json.loads(show("--json"))
    assert [(e["iteration"], e["kind"], e["details"]) for e in data["events"]] == [(7, "no_signal", {"x": 1})]
    out = show()
    assert "Warnings" in out and "no_signal" in out and "GRPO is getting no signal" in out


def test_train_grpo_stores_and_prints_the_warnings_it_raises(tmp_path):
    from rich.console import Console

    from rlcli.engine.grpo.loop import run_grpo

    # The tiny random model never answers the arithmetic tasks: every group is all zeros.
    recipe = write_recipe(tmp_path / "r.yaml", grpo={"iterations": 2, "zero_signal_patience": 2})
    ctx = make_ctx(recipe, tmp_path / "runs")
    ctx.console = Console(record=True, width=200)
    run_grpo(ctx)
    assert [(e.iteration, e.kind) for e in list_events(ctx.store)] == [(1, "no_signal")]
    assert ctx.console.export_text().count("GRPO is getting no signal") == 1
