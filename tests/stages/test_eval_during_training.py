"""grpo.eval_every, `-c best` and grpo.keep_best: held-out evals as GRPO trains, resumable after
kill -9, and the checkpoint they rank best."""

from __future__ import annotations

import json
import sqlite3

import pytest

from helpers import DEVICE, kill_when, make_ctx, run_in_process, write_recipe
from rlcli.engine.evaluate import eval_metrics, run_eval
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe
from rlcli.store.checkpoints import add_checkpoint, best_checkpoint, checkpoint_note, resolve_checkpoint
from rlcli.store.db import now
from rlcli.store.episodes import stage_episodes, store_episodes
from rlcli.store.evals import replace_eval
from rlcli.store.records import EndReason, Episode, EvalResult
from test_vllm_engine import KV_CACHE_BYTES, needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)


def query(runs, sql: str) -> list[tuple]:
    with sqlite3.connect(runs / "rlcli.db") as conn:
        return conn.execute(sql).fetchall()


# --- eval stages as GRPO trains ------------------------------------------------------------


def test_eval_stages_follow_eval_every_and_the_last_iteration(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo

    recipe = write_recipe(
        tmp_path / "r.yaml", grpo={"iterations": 5, "eval_every": 2, "eval_tasks": 3}, eval={"tasks": 4}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)

    ids = {c["iteration"]: c["id"] for c in ctx.rundb.db["checkpoints"].rows}
    # After iterations 1 and 3 (every 2nd) and 4 (the last), plus the starting point (base) first.
    expected = ["eval/base", *(f"eval/ckpt-{ids[i]}" for i in (1, 3, 4))]
    evals = [s.name for s in ctx.rundb.stages(ctx.run) if s.name.startswith("eval/")]
    assert evals == expected
    assert all(ctx.rundb.stage(ctx.run, name).done for name in expected)
    results = {r["stage"]: r for r in ctx.rundb.db["evals"].rows}
    assert set(results) == set(expected) and {r["tasks"] for r in results.values()} == {3}
    assert results[f"eval/ckpt-{ids[3]}"]["checkpoint"] == str(ids[3])
    held_out = [(m.step, m.stage) for m in ctx.rundb.metrics(ctx.run, "eval/success_rate")]
    assert held_out == [(-1, "grpo"), (1, "grpo"), (3, "grpo"), (4, "grpo")]

    # `rlcli eval -c <id>` finds the stage done and plays nothing again.
    episodes = ctx.rundb.db["episodes"].count
    [again] = run_eval(ctx, [str(ids[3])])
    assert again.stage == f"eval/ckpt-{ids[3]}" and ctx.rundb.db["episodes"].count == episodes + 4 - 3
    # (eval.tasks is 4, one more than grpo.eval_tasks: only the missing task was played.)


def test_evals_only_at_saved_checkpoints_and_the_sft_checkpoint_is_the_starting_point(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo

    recipe = write_recipe(
        tmp_path / "r.yaml", grpo={"iterations": 3, "eval_every": 1, "checkpoint_every": 2}, eval={"tasks": 2}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    sft_folder = tmp_path / "sft"
    _save_fresh_adapter(ctx, sft_folder)
    sft_id = add_checkpoint(ctx.store, "sft", 0, sft_folder, "lora")
    run_grpo(ctx)

    saved = {c["iteration"]: c["id"] for c in ctx.rundb.db["checkpoints"].rows_where("stage like 'train/%'")}
    assert sorted(saved) == [1, 2]  # checkpoint_every 2, and the last
    evals = [s.name for s in ctx.rundb.stages(ctx.run) if s.name.startswith("eval/")]
    assert evals == [f"eval/ckpt-{sft_id}", f"eval/ckpt-{saved[1]}", f"eval/ckpt-{saved[2]}"]
    start = ctx.rundb.db["evals"].rows_where("stage = ?", [f"eval/ckpt-{sft_id}"])
    assert [r["checkpoint"] for r in start] == ["sft"]


DIGITS = "def digits(completions, **kwargs):\n    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions]\n"
EVAL_TURNS = (
    "select e.stage, e.task_index, e.sample_index, t.turn_index, t.completion_ids from episodes e "
    "join turns t on t.episode_id = e.id where e.split = 'eval' order by 1, 2, 3, 4"
)


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_evals_with_the_model_in_memory_equal_evals_from_disk(tmp_path, engine, request):
    """The trainer's model (and, with vllm, the engine synced to it) plays exactly the episodes that
    `rlcli eval` plays after loading each checkpoint from disk."""
    from rlcli.engine.grpo.loop import run_grpo

    # A dense reward and a large step, so that the checkpoints' greedy replies differ from the base model's.
    (tmp_path / "digits.py").write_text(DIGITS)
    sections = dict(
        rewards=[{"fn": f"{tmp_path / 'digits.py'}:digits", "name": "digits"}],
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16},
        eval={"tasks": 4},
    )
    if engine == "vllm":
        model = request.getfixturevalue("tiny64")
        sections["model"] = {"name": str(model), "max_length": 1024, "dtype": "float32", "device": DEVICE}
        sections["rollout"] |= {"engine": "vllm", "vllm_memory": KV_CACHE_BYTES}
    grpo = {"iterations": 2, "lr": 3e-2}
    during = write_recipe(tmp_path / "during.yaml", grpo={**grpo, "eval_every": 1}, **sections)
    after = write_recipe(tmp_path / "after.yaml", grpo=grpo, **sections)
    ctx = make_ctx(during, tmp_path / "during")
    run_grpo(ctx)
    later = make_ctx(after, tmp_path / "after")
    run_grpo(later)
    ids = [str(c["id"]) for c in later.rundb.db["checkpoints"].rows]
    run_eval(later, ["base", *ids])
    turns = query(tmp_path / "during", EVAL_TURNS)
    assert turns == query(tmp_path / "after", EVAL_TURNS)
    by_stage = {}
    for stage, *rest in turns:
        by_stage.setdefault(stage, []).append(rest)
    assert list(by_stage) == ["eval/base", f"eval/ckpt-{ids[0]}", f"eval/ckpt-{ids[1]}"]
    assert by_stage["eval/base"] != by_stage[f"eval/ckpt-{ids[1]}"]  # training changed the policy


def _save_fresh_adapter(ctx, folder):
    from rlcli.models.loading import load_policy, save_checkpoint

    recipe = ctx.recipe
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
    save_checkpoint(model, tokenizer, folder)


@pytest.fixture(scope="module")
def uninterrupted_eval_run(tmp_path_factory, session_models):
    """The recipe of the eval kill tests and its run without a kill, which they compare with (read only)."""
    folder = tmp_path_factory.mktemp("eval-kill")
    recipe = write_recipe(
        folder / "r.yaml",
        env={"name": "guess_number", "max_turns": 3},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 12, "batch_size": 4},
        grpo={"iterations": 2, "eval_every": 1},
        eval={"tasks": 16, "k": 2, "temperature": 1.0},
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLCLI_MODELS", str(session_models))
        done = run_in_process(["train", "grpo", "-r", str(recipe)], folder / "clean")
        assert done.returncode == 0, done.stderr
    return recipe, folder / "clean"


@pytest.mark.parametrize("killed", ["ckpt-1", "ckpt-2"])  # mid-run (resumes in memory), the last (from disk)
def test_kill_during_an_eval_stage_resumes_to_the_same_result(tmp_path, killed, uninterrupted_eval_run):
    recipe, clean = uninterrupted_eval_run
    runs = tmp_path / "runs"
    args = ["train", "grpo", "-r", str(recipe)]
    stage = f"eval/{killed}@t1-k2"

    stored = kill_when(args, runs, f"select count(*) from episodes where stage = '{stage}'", 4)
    assert 0 < stored < 32, "the kill must land mid-evaluation"
    assert query(runs, f"select status from stages where name = '{stage}'") == [("running",)]
    done = run_in_process(args, runs)  # the resume: a new run of the command, in this process
    assert done.returncode == 0, done.stderr

    keys = query(runs, "select stage, task_index, sample_index from episodes where split = 'eval'")
    assert len(keys) == len(set(keys)) == 3 * 32
    same = (
        "select e.stage, e.task_index, e.sample_index, t.turn_index, t.completion_ids from episodes e "
        "join turns t on t.episode_id = e.id order by 1, 2, 3, 4"
    )
    assert query(runs, same) == query(clean, same)
    result = (
        "select stage, checkpoint, tasks, k, success_rate, pass_at_k, mean_return, mean_tokens from evals order by 1"
    )
    assert query(runs, result) == query(clean, result)
    assert len(query(runs, result)) == 3
    held_out = "select step, value from metrics where key = 'eval/success_rate' order by step"
    assert query(runs, held_out) == query(clean, held_out)
    assert [step for step, _ in query(runs, held_out)] == [-1, 0, 1]


# --- -c best and keep_best -------------------------------------------------------------------


def eval_stage(ctx, checkpoint_id: int | None, successes: list[bool], which: str | None = None, suffix: str = ""):
    """Store an eval stage's episodes (one per task), its result and its row, done, as `rlcli eval` would."""
    stage = f"eval/{'base' if checkpoint_id is None else f'ckpt-{checkpoint_id}'}{suffix}"
    episodes = [
        Episode(
            id=None,
            run=ctx.run,
            stage=stage,
            iteration=None,
            split="eval",
            task_index=task,
            sample_index=0,
            seed=task,
            policy="base" if checkpoint_id is None else str(checkpoint_id),
            status="ok",
            end_reason=EndReason.TERMINATED,
            env_return=float(success),
            success=success,
            num_turns=1,
            num_tokens=4,
            task={},
            messages=[],
            template_consistent=True,
            error=None,
            created_at=now(),
        )
        for task, success in enumerate(successes)
    ]
    store_episodes(ctx.rundb, episodes)
    metrics = eval_metrics(stage_episodes(ctx.store, stage), 1)
    which = which or ("base" if checkpoint_id is None else str(checkpoint_id))
    replace_eval(
        ctx.rundb,
        EvalResult(
            id=None,
            run=ctx.run,
            stage=stage,
            checkpoint=which,
            checkpoint_id=checkpoint_id,
            split="eval",
            created_at=now(),
            **metrics,
        ),
    )
    ctx.store.mark_stage(stage, "done", params={"tasks": len(successes)}, started_at=now(), finished_at=now())


def run_with_checkpoints(tmp_path, **grpo):
    """A run with an SFT checkpoint and three GRPO checkpoints (iterations 0-2), nothing evaluated."""
    tmp_path.mkdir(exist_ok=True)
    recipe = write_recipe(tmp_path / "r.yaml", grpo={"iterations": 3, **grpo}, eval={"tasks": 4})
    ctx = make_ctx(recipe, tmp_path / "runs")
    ids = [add_checkpoint(ctx.store, "sft", 10, tmp_path / "sft", "lora")]
    for it in range(3):
        ids.append(add_checkpoint(ctx.store, f"train/{it}", it, tmp_path / f"iter-{it}", "lora"))
    return ctx, ids


Y, N = True, False


def test_best_is_the_highest_held_out_success_and_a_tie_goes_to_the_later(tmp_path):
    ctx, (sft, c0, c1, c2) = run_with_checkpoints(tmp_path)
    eval_stage(ctx, None, [Y, N, N, N])
    eval_stage(ctx, sft, [Y, Y, N, N], which="sft")
    eval_stage(ctx, c0, [Y, Y, Y, N])
    eval_stage(ctx, c2, [N, Y, Y, Y])  # ties with c0: the later one wins
    eval_stage(ctx, c1, [Y, Y, N, N])  # evaluated after c2: "later" is the training order, not the eval's
    best = best_checkpoint(ctx.store)
    assert best.checkpoint.id == c2 and best.success_rate == 0.75 and best.tasks == 4
    assert resolve_checkpoint(ctx.store, "best").id == c2
    assert (
        checkpoint_note(ctx.store, "best") == f"best = checkpoint {c2} (iteration 2, held-out 0.75 on 4 tasks, greedy)"
    )
    assert resolve_checkpoint(ctx.store, "latest").id == c2  # no keep_best: the newest


def test_best_can_be_the_sft_checkpoint_or_the_base_model(tmp_path):
    ctx, (sft, c0, c1, c2) = run_with_checkpoints(tmp_path)
    eval_stage(ctx, None, [Y, N, N, N])
    eval_stage(ctx, sft, [Y, Y, Y, N], which="sft")
    for ckpt in (c0, c1, c2):
        eval_stage(ctx, ckpt, [Y, Y, N, N])
    assert resolve_checkpoint(ctx.store, "best").id == sft
    assert checkpoint_note(ctx.store, "best") == f"best = checkpoint {sft} (sft, held-out 0.75 on 4 tasks, greedy)"

    ctx2, (sft2, *_) = run_with_checkpoints(tmp_path / "b")
    eval_stage(ctx2, None, [Y, Y, N, N])
    eval_stage(ctx2, sft2, [Y, N, N, N], which="sft")
    assert resolve_checkpoint(ctx2.store, "best") is None  # the base model


def test_best_compares_like_with_like(tmp_path):
    ctx, (sft, c0, c1, c2) = run_with_checkpoints(tmp_path)  # eval.tasks 4
    eval_stage(ctx, c0, [Y, N, N, N])
    eval_stage(ctx, c1, [N, N, N, N, Y, Y, Y, Y])  # 50% on 8 tasks, but 0% on the 4 compared
    eval_stage(ctx, c2, [Y, Y, Y])  # too few tasks to compare
    eval_stage(ctx, sft, [Y, Y, Y, Y], suffix="@t1-k1")  # another decoding
    best = best_checkpoint(ctx.store)
    assert best.checkpoint.id == c0 and best.tasks == 4


def test_best_without_evals_is_a_usage_error(tmp_path):
    ctx, _ = run_with_checkpoints(tmp_path)
    with pytest.raises(UsageError, match="grpo.eval_every or rlcli eval first"):
        resolve_checkpoint(ctx.store, "best")


def test_latest_is_the_newest_checkpoint_with_keep_best_too(tmp_path):
    ctx, (sft, c0, c1, c2) = run_with_checkpoints(tmp_path, eval_every=1, keep_best=True)
    eval_stage(ctx, sft, [Y, N, N, N], which="sft")
    eval_stage(ctx, c1, [Y, Y, Y, N])
    eval_stage(ctx, c2, [Y, Y, N, N])
    assert resolve_checkpoint(ctx.store, "best").id == c1
    assert resolve_checkpoint(ctx.store, "latest").id == c2  # one meaning: the newest checkpoint
    assert checkpoint_note(ctx.store, "latest") is None


def test_best_ranks_the_evals_of_another_decoding_when_the_recipes_has_none(tmp_path):
    """`rlcli eval -c best eval.temperature=0` on a run whose evals all sampled at 0.8: best is the
    checkpoint those evals rank first, and the note says which decoding ranked it."""
    ctx, (sft, c0, c1, c2) = run_with_checkpoints(tmp_path)  # greedy evals (eval.k 1)
    eval_stage(ctx, sft, [Y, N, N, N], which="sft", suffix="@t0.8-k1")
    eval_stage(ctx, c0, [Y, Y, Y, N], suffix="@t0.8-k1")
    eval_stage(ctx, c2, [Y, Y, N, N], suffix="@t0.8-k1")
    assert resolve_checkpoint(ctx.store, "best").id == c0
    assert (
        checkpoint_note(ctx.store, "best") == f"best = checkpoint {c0} (iteration 0, held-out 0.75 on 4 tasks, t0.8-k1)"
    )
    # Greedy evals of fewer policies (as `rlcli eval -c sft -c latest eval.temperature=0` leaves) do
    # not move it: best ranks on the decoding that evaluated the most of them.
    eval_stage(ctx, sft, [Y, Y, Y, Y], which="sft")
    eval_stage(ctx, c2, [N, N, N, N])
    assert resolve_checkpoint(ctx.store, "best").id == c0


def test_keep_best_has_run_evaluate_best_beside_latest(tmp_path):
    """With grpo.keep_best, `rlcli run` evaluates `best` as well as eval.checkpoints' `latest`, each
    labelled by the checkpoint it is."""
    from rlcli.engine.pipeline import run_all

    tmp_path.mkdir(exist_ok=True)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "stages": ["eval"]},
        grpo={"iterations": 2, "eval_every": 1, "keep_best": True},
        eval={"tasks": 4, "checkpoints": ["base", "latest"]},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    c0 = add_checkpoint(ctx.store, "train/0", 0, tmp_path / "iter-0", "lora")
    c1 = add_checkpoint(ctx.store, "train/1", 1, tmp_path / "iter-1", "lora")
    eval_stage(ctx, None, [N, N, N, N])
    eval_stage(ctx, c0, [Y, Y, N, N])
    eval_stage(ctx, c1, [Y, N, N, N])
    shown = []
    ending = run_all(ctx, shown.append)
    evals = next(summary for summary in shown if isinstance(summary, list))
    assert [r.label for r in evals] == ["base", f"latest (#{c1})", f"best (#{c0})"]
    assert (ending.best.checkpoint.id, ending.latest.id) == (c0, c1)


def test_keep_best_needs_eval_every(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", grpo={"keep_best": True})
    with pytest.raises(UsageError, match="grpo.eval_every"):
        load_recipe(recipe)


def test_run_reports_best_and_latest_and_eval_takes_best(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        grpo={"iterations": 2, "eval_every": 1},
        eval={"tasks": 2, "checkpoints": ["base", "latest", "best"]},
    )
    runs = tmp_path / "runs"
    done = run_in_process(["run", "-r", str(recipe)], runs)
    assert done.returncode == 0, done.stderr
    assert "best and latest" in done.stdout and "best and latest" not in done.stderr  # a result: stdout
    episodes = query(runs, "select count(*) from episodes")
    # The tiny random model never succeeds: every eval ties, so best is the newest checkpoint.
    again = run_in_process(["eval", "-r", str(recipe), "-c", "best", "--json"], runs)
    assert again.returncode == 0, again.stderr
    assert "best = checkpoint 2 (iteration 1, held-out 0.00 on 2 tasks, greedy)" in again.stderr
    assert query(runs, "select count(*) from episodes") == episodes  # reused, not played again
    shown = run_in_process(["runs", "show", "t", "--json"], runs)
    ending = json.loads(shown.stdout)["ending"]
    assert ending["best"]["id"] == ending["latest"]["id"] == 2 and ending["latest"]["success_rate"] == 0.0
    assert json.loads(shown.stdout)["heldout_curve"] == [0.0, 0.0, 0.0]
    # A decoding no eval has used still names the same best, ranked by the greedy evals.
    sampled = run_in_process(["eval", "-r", str(recipe), "-c", "best", "eval.temperature=1.0", "--json"], runs)
    assert sampled.returncode == 0, sampled.stderr
    assert "best = checkpoint 2 (iteration 1, held-out 0.00 on 2 tasks, greedy)" in sampled.stderr
    assert [(r["label"], r["decoding"]) for r in json.loads(sampled.stdout)] == [("best (#2)", "t1-k1")]
    plotted = run_in_process(["runs", "plot", "t", "--out", str(tmp_path / "curves.png")], runs)
    assert plotted.returncode == 0 and (tmp_path / "curves.png").stat().st_size > 0, plotted.stderr
