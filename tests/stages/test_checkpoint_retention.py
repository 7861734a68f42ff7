"""grpo.keep_checkpoints (issue 56: the quickstart kept 2 GB of checkpoints): the newest, the best and
the named checkpoints keep their weights, the others lose them once evaluated; training, resume after
kill -9 and `-c ID` for a kept one are unchanged, and asking for a pruned one says so in one sentence."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, cli, kill_when, make_ctx, run_in_process, write_recipe
from rlcli.errors import UsageError
from rlcli.models.loading import PRUNED_NOTE
from rlcli.recipe import load_recipe
from rlcli.store.checkpoints import best_checkpoint, train_checkpoints

GRPO = {"iterations": 5, "eval_every": 2, "eval_tasks": 2}


def final_state(runs: Path) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """The last checkpoint's adapter and every GRPO metric of run t but its timings."""
    with sqlite3.connect(runs / "rlcli.db") as conn:
        [path] = conn.execute("select path from checkpoints where run = 't' order by id desc limit 1").fetchone()
        metrics = conn.execute(
            "select step, key, value from metrics where stage = 'grpo' and key not like 'perf/%' order by step, key"
        ).fetchall()
    return load_file(runs / path / "adapter_model.safetensors"), metrics


def test_pruning_keeps_the_newest_best_and_named_and_changes_no_training(tmp_path, capsys):
    from rlcli.engine.grpo.loop import run_grpo

    everything = make_ctx(write_recipe(tmp_path / "all.yaml", grpo=GRPO), tmp_path / "all")
    run_grpo(everything)
    # eval.checkpoints names checkpoint 1 (iteration 0): kept, although neither newest nor best.
    pruning = write_recipe(
        tmp_path / "r.yaml", grpo={**GRPO, "keep_checkpoints": 1}, eval={"tasks": 2, "checkpoints": ["base", "1"]}
    )
    ctx = make_ctx(pruning, tmp_path / "runs")
    run_grpo(ctx)

    saved = train_checkpoints(ctx.store)
    assert [c.iteration for c in saved] == [0, 1, 2, 3, 4]  # every row stays
    best = best_checkpoint(ctx.store)
    kept = {saved[-1].id, 1} | ({best.checkpoint.id} if best is not None and best.checkpoint is not None else set())
    for checkpoint in saved:
        files = sorted(p.name for p in Path(checkpoint.path).iterdir())
        if checkpoint.id in kept:
            assert "adapter_model.safetensors" in files and "trainer_state.pt" in files
        else:
            assert files == [PRUNED_NOTE], (checkpoint.iteration, files)
    # Deleting weights changes nothing the training computed.
    assert len(kept) < len(saved)
    weights, metrics = final_state(tmp_path / "runs")
    expected_weights, expected_metrics = final_state(tmp_path / "all")
    assert metrics == expected_metrics
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)

    runs = tmp_path / "runs"
    never_evaluated = next(c for c in saved if c.id not in kept and c.iteration % 2 == 0)  # eval_every 2: 1, 3, 4
    code, out, err = cli(capsys, "--runs-dir", runs, "eval", "-r", pruning, "-c", str(never_evaluated.id))
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert code == 2 and len(lines) == 1, err
    assert f"Checkpoint {never_evaluated.id} (train/{never_evaluated.iteration}) of run 't' was pruned" in lines[0]
    assert "Traceback" not in err
    # A pruned one whose eval is done shows its stored result; a kept one evaluates as always.
    evaluated = next(c for c in saved if c.id not in kept and c.iteration % 2 == 1)
    code, out, err = cli(capsys, "--runs-dir", runs, "eval", "-r", pruning, "-c", str(evaluated.id))
    assert code == 0 and "95% CI" in out, err
    code, out, err = cli(capsys, "--runs-dir", runs, "eval", "-r", pruning, "-c", "1", "eval.tasks=3")
    assert code == 0 and "3×1" in out, err


def test_a_run_killed_after_pruning_resumes_exactly(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", grpo={**GRPO, "keep_checkpoints": 1})
    runs = tmp_path / "runs"
    # Killed once the fourth checkpoint is committed, so that the checkpoints before it are pruned or due.
    kill_when(["train", "grpo", "-r", str(recipe)], runs, "select count(*) from checkpoints", 4)
    done = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert done.returncode == 0, done.stderr

    clean = tmp_path / "clean"
    assert run_in_process(["train", "grpo", "-r", str(recipe)], clean).returncode == 0
    weights, metrics = final_state(runs)
    expected_weights, expected_metrics = final_state(clean)
    assert metrics == expected_metrics
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)
    with sqlite3.connect(runs / "rlcli.db") as conn:
        paths = [runs / p for (p,) in conn.execute("select path from checkpoints where stage like 'train/%'")]
    assert len(paths) == 5 and sum((p / "adapter_model.safetensors").exists() for p in paths) < 5


def test_the_quickstart_prunes_what_it_no_longer_needs():
    grpo = load_recipe(REPO / "recipes" / "quickstart.yaml", []).grpo
    assert grpo.keep_checkpoints == 1 and grpo.eval_every > 0  # pruned once evaluated; the best is kept


def test_an_opponent_pool_is_refused_with_pruning(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "textarena:TicTacToe-v0", "opponent": "pool:3"},
        eval={"tasks": 2, "opponents": ["random"]},
        grpo={"iterations": 1, "keep_checkpoints": 1},
    )
    with pytest.raises(UsageError, match="draws from the run's earlier GRPO checkpoints"):
        load_recipe(recipe, [])
