"""Evaluation: estimators against hand-computed values, several checkpoints in one call, resume."""

from __future__ import annotations

import json
import math

import pytest

from helpers import make_ctx, run_in_process, write_recipe
from rlcli.engine.evaluate import eval_metrics, mean_interval, pass_at_k, run_eval, wilson_interval
from rlcli.store.records import EndReason, Episode


def test_pass_at_k_matches_hand_computed_values():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(4, 2, 3) == 1.0  # fewer failures than k: some draw always contains a success
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_wilson_interval_matches_hand_computed_values():
    # 8/10, z=1.96: centre (0.8 + 0.19208)/1.38416 = 0.71682, half 0.23520.
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(0, 20)[1] > 0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval_is_normal_over_task_rates():
    low, high = mean_interval([0.0, 0.5, 1.0, 0.5])
    sd = math.sqrt(((0.5) ** 2 * 2) / 3)
    assert low == pytest.approx(0.5 - 1.96 * sd / 2) and high == pytest.approx(0.5 + 1.96 * sd / 2)


def eval_episode(task: int, sample: int, success: bool, status: str = "ok") -> Episode:
    return Episode(
        id=None,
        run="r",
        stage="eval/base",
        iteration=None,
        split="eval",
        task_index=task,
        sample_index=sample,
        seed=0,
        policy="base",
        status=status,
        end_reason=EndReason.TERMINATED if status == "ok" else EndReason.ERROR,
        env_return=float(success),
        success=success,
        num_turns=2,
        num_tokens=10,
        task={},
        messages=[],
        template_consistent=True,
        error=None if status == "ok" else "env step failed: step exceeded the 1s step time limit",
        created_at="",
    )


def test_eval_metrics_from_episodes():
    episodes = [
        eval_episode(task, sample, bool(s))
        for task, successes in enumerate([[1, 1, 0], [0, 0, 0]])
        for sample, s in enumerate(successes)
    ]
    m = eval_metrics(episodes, k=3)
    assert m["tasks"] == 2 and m["success_rate"] == pytest.approx(2 / 6)
    assert m["pass_at_k"] == pytest.approx(0.5)  # task 0 passes at k=3, task 1 never
    assert m["avg_at_k"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["details"]["pass@1"] == pytest.approx(2 / 6)
    assert m["mean_turns"] == 2 and m["mean_tokens"] == 10


def test_eval_success_is_over_the_episodes_that_ran_with_failures_beside_it():
    episodes = [eval_episode(0, 0, True), eval_episode(1, 0, False), eval_episode(2, 0, False, status="failed")]
    m = eval_metrics(episodes, k=1)
    assert m["success_rate"] == pytest.approx(1 / 2) and m["details"]["failed_episodes"] == 1
    assert m["tasks"] == 3 and m["mean_return"] == pytest.approx(1 / 2) and m["mean_turns"] == 2
    assert (m["ci_low"], m["ci_high"]) == pytest.approx(wilson_interval(1, 2))


def test_eval_run_again_keeps_its_timed_out_episodes_as_an_uninterrupted_eval_does(tmp_path):
    from helpers import write_env_file
    from rlcli.envs.protocol import task_seed
    from test_rollout import SLOW_ENV

    slow_seed = task_seed("eval", 1)
    env_file = write_env_file(tmp_path / "slow.py", SLOW_ENV.replace("self.seed == 1", f"self.seed == {slow_seed}"))
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": str(env_file), "step_timeout_s": 0.3}, eval={"tasks": 3})
    (tmp_path / "under-load").touch()
    ctx = make_ctx(recipe, tmp_path / "runs")
    (first,) = run_eval(ctx, ["base"])
    assert first.details["failed_episodes"] == 1 and first.success_rate == 1.0  # 2 of 2 that ran
    (tmp_path / "under-load").unlink()
    (second,) = run_eval(ctx, ["base"])  # a stored episode is final (env.timeout_retries retries in the stage)
    assert second.details["failed_episodes"] == 1 and second.success_rate == 1.0 and second.tasks == 3
    assert ctx.rundb.db["episodes"].count == 3


NESTING_ENV = '''
class Nesting:
    """Succeeds on the answer "ok"; a tool of its own, so that its replies are read for calls. Its expert
    answers the odd seeds with a thousand nested brackets, past what Python's JSON reader can nest."""

    def __init__(self):
        self.tools = [self.echo]

    def echo(self, text: str) -> str:
        """Say a text back.

        Args:
            text: What to say.
        """
        return text

    def reset(self, seed):
        self.seed = seed
        return "Say ok.", {}

    def step(self, action):
        ok = action.strip() == "ok"
        return "done", float(ok), True, False, {"success": ok}

    def expert_action(self):
        return "[" * 1000 + "]" * 1000 if self.seed % 2 else "ok"
'''


def test_eval_scores_a_reply_the_tool_call_reader_cannot_read_as_a_failure_in_its_success_rate(tmp_path):
    from helpers import write_env_file

    env_file = write_env_file(tmp_path / "nesting.py", NESTING_ENV)
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": str(env_file)}, eval={"tasks": 4})
    (row,) = run_eval(make_ctx(recipe, tmp_path / "runs"), ["expert"])
    # Half the answers unreadable: the model's failures, in the denominator, not env failures left out of it.
    assert row.details["failed_episodes"] == 0 and row.success_rate == 0.5 and row.tasks == 4


def test_eval_several_checkpoints_in_one_call_and_resume(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number", "max_turns": 2, "kwargs": {"low": 1, "high": 3}},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
        grpo={"iterations": 1, "lr": 1e-3},
        eval={"tasks": 3, "k": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    from rlcli.engine.grpo.loop import run_grpo

    run_grpo(ctx)
    rows = run_eval(ctx, ["base", "latest", "expert"])
    assert [r.checkpoint for r in rows] == ["base", "latest", "expert"]
    assert all(r.tasks == 3 and r.k == 2 for r in rows)
    expert = rows[-1]
    assert expert.success_rate == 1.0 and expert.pass_at_k == 1.0
    # Eval tasks are the held-out split.
    seeds = {r["seed"] for r in ctx.rundb.db.query("select seed from episodes where split = 'eval'")}
    train_seeds = {r["seed"] for r in ctx.rundb.db.query("select seed from episodes where split = 'train'")}
    assert seeds and not seeds & train_seeds
    # A second call repeats nothing.
    n = ctx.rundb.db["episodes"].count
    run_eval(ctx, ["base", "latest"])
    assert ctx.rundb.db["episodes"].count == n and ctx.rundb.db["evals"].count == 3


def test_eval_with_other_decoding_or_more_tasks_is_measured_not_read_back(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number", "max_turns": 2, "kwargs": {"low": 1, "high": 3}},
        eval={"tasks": 3, "k": 1},
    )
    runs = tmp_path / "runs"
    (greedy,) = run_eval(make_ctx(recipe, runs), ["base"])
    (sampled,) = run_eval(make_ctx(recipe, runs, ["eval.temperature=1.0"]), ["base"])
    (more,) = run_eval(make_ctx(recipe, runs, ["eval.tasks=5"]), ["base"])
    assert (greedy.stage, sampled.stage, more.stage) == ("eval/base", "eval/base@t1-k1", "eval/base")
    assert (greedy.tasks, sampled.tasks, more.tasks) == (3, 3, 5)
    ctx = make_ctx(recipe, runs)
    assert ctx.rundb.db.execute("select count(*) from episodes where stage = 'eval/base'").fetchone()[0] == 5
    from rlcli.store.evals import eval_results

    results = eval_results(ctx.store)
    # The 3-task eval stays beside the 5-task one that extended its stage: both were measured (the
    # 32-game evals GRPO makes during training, then the 96-game one at the end).
    assert [(r.label, r.decoding, r.tasks) for r in results] == [
        ("base", "greedy", 3),
        ("base", "t1-k1", 3),
        ("base", "greedy", 5),
    ]
    # The table shows how each sampled, in a column of its own, and never cuts a label.
    from rich.console import Console

    from rlcli.report.tables import evals_table
    from rlcli.report.views import eval_view

    console = Console(width=60, record=True)
    console.print(evals_table([eval_view(r) for r in results]))
    lines = console.export_text().splitlines()
    assert any("base" in line and "t1-k1" in line for line in lines) and any("greedy" in line for line in lines)
    # A sampled eval estimates the policy's entropy from the logprobs of what it sampled; greedy cannot.
    from rlcli.store.blobs import unpack_floats

    blobs = ctx.rundb.db.execute(
        "select t.logprobs from turns t join episodes e on e.id = t.episode_id where e.stage = 'eval/base@t1-k1'"
    ).fetchall()
    logprobs = [lp for (blob,) in blobs for lp in unpack_floats(blob)]
    assert results[1].details["entropy"] == pytest.approx(-sum(logprobs) / len(logprobs), rel=1e-6)
    assert "entropy" not in results[0].details and "entropy" not in results[2].details
    wide = Console(width=160, record=True)
    wide.print(evals_table([eval_view(r) for r in results]))
    assert "entropy" in wide.export_text()


def test_cli_eval_json_and_runs_show_include_evals(tmp_path):
    runs = tmp_path / "runs"
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "arithmetic"}, eval={"tasks": 2})
    out = run_in_process(["eval", "-r", str(recipe), "-c", "base", "--json"], runs)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows[0]["checkpoint"] == "base" and rows[0]["tasks"] == 2
    show = run_in_process(["runs", "show", "t", "--json"], runs)
    data = json.loads(show.stdout)
    assert data["evals"][0]["success_rate"] == rows[0]["success_rate"]
    assert any(s["name"] == "eval/base" and s["status"] == "done" for s in data["stages"])


def test_cli_eval_table_on_stdout_progress_on_stderr(tmp_path):
    """Results on stdout (`rlcli eval ... > out.txt` keeps the table), progress on stderr; under
    --json stdout holds the JSON alone."""
    runs = tmp_path / "runs"
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "arithmetic"}, eval={"tasks": 2})
    out = run_in_process(["eval", "-r", str(recipe), "-c", "base"], runs)
    assert out.returncode == 0, out.stderr
    assert "base" in out.stdout and "success" in out.stdout, out.stdout
    assert out.stderr.strip() and "success" not in out.stderr, out.stderr
    again = run_in_process(["eval", "-r", str(recipe), "-c", "base", "--json"], runs)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)[0]["checkpoint"] == "base"


def test_eval_table_counts_failed_episodes_beside_the_success_rate():
    from dataclasses import replace

    from rich.console import Console

    from rlcli.report.tables import evals_table
    from rlcli.report.views import eval_view
    from rlcli.store.records import EvalResult

    metrics = eval_metrics([eval_episode(0, 0, True), eval_episode(1, 0, False, status="failed")], k=1)
    result = EvalResult(
        id=1, run="r", stage="eval/base", checkpoint="base", checkpoint_id=None, split="eval", created_at="", **metrics
    )
    console = Console(width=120, record=True)
    console.print(evals_table([eval_view(result), eval_view(replace(result, details={}))]))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "│" in line]
    assert "failed" in next(line for line in text.splitlines() if "checkpoint" in line)
    assert "100.0%" in rows[0] and rows[0].split("│")[-2].strip() == "1"
    assert rows[1].split("│")[-2].strip() == "0"  # results stored before failures were counted
