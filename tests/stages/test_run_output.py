"""What `rlcli run` shows a newcomer (issue 56): tables that fit an 80-column terminal with every
interval whole, one start-up summary line, the overall progress (plain lines where stderr is no
terminal, a bar where it is one), and the curves PNG written into the run's folder, its path printed."""

from __future__ import annotations

import io
import os
import re
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from helpers import RLCLI, write_recipe

# An eval table's 95% interval, as the table writes it: "34%–62%".
INTERVAL = re.compile(r"\b\d{1,3}%–\d{1,3}%")


@pytest.fixture(scope="module")
def narrow_run(tmp_path_factory, session_models) -> tuple[subprocess.CompletedProcess, Path]:
    """`rlcli run` of two GRPO iterations and a sampled eval (its table then has every column:
    decoding and entropy too) on the tiny model, under COLUMNS=80, stdout and stderr piped."""
    root = tmp_path_factory.mktemp("narrow")
    recipe = write_recipe(root / "r.yaml", grpo={"iterations": 2}, eval={"tasks": 3, "temperature": 0.8})
    env = {**os.environ, "RLCLI_HOME": str(root / "runs"), "RLCLI_MODELS": str(session_models), "COLUMNS": "80"}
    done = subprocess.run(
        [*RLCLI, "run", "-r", str(recipe)], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done, root / "runs"


def assert_whole(lines: list[str]) -> None:
    """No table was cut at the terminal's edge: each of its lines ends with its right border, and no
    cell lost its end to an ellipsis."""
    for line in lines:
        if line[:1] in BORDERS:
            assert line[-1] in BORDERS, "a table cut at the terminal's edge:\n" + "\n".join(lines)
    assert not any("…" in line for line in lines), "\n".join(lines)


BORDERS = set("┏┃┡│└┗╇┩┓┛┘├┤╭╰╮╯")


def table_body(lines: list[str], title: str) -> list[str]:
    """The rows of the table with this title."""
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    return [line for line in lines[start:end] if line.startswith("│")]


def iteration_rows(stderr: str) -> list[str]:
    """The per-iteration metrics rows on stderr: the header (it starts with "iter") and the lines after it
    that start with an iteration number."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["iter"])
    return [lines[start], *(line for line in lines[start + 1 :] if re.match(r"\s*\d+\s", line))]


def test_every_table_fits_80_columns_and_keeps_its_interval_whole(narrow_run):
    done, runs = narrow_run
    path_line = str(runs / "t" / "metrics.png")
    tables = [line for line in done.stdout.splitlines() if path_line not in line]
    assert max(map(len, tables)) <= 80, "\n".join(line for line in tables if len(line) > 80)
    assert_whole(tables)
    eval_rows = table_body(tables, "Evaluation (held-out tasks)")
    assert len(eval_rows) == 2 and all(INTERVAL.search(row) for row in eval_rows), "\n".join(tables)

    rows = iteration_rows(done.stderr)
    assert len(rows) == 3  # the header and iterations 0 and 1
    assert max(map(len, rows)) <= 80, "\n".join(rows)
    assert rows[0].split()[:4] == ["iter", "reward", "success", "held-out"]  # the columns a researcher watches first


def quickstart_eval_row(label: str, rate: float, low: float, high: float, failed: int = 0) -> dict:
    """An eval table row as the quickstart's evals fill it: 96 games sampled at 0.8, with an entropy."""
    details = {"entropy": 0.4213, **({"failed_episodes": failed} if failed else {})}
    return {
        "label": label,
        "checkpoint": label,
        "decoding": "t0.8-k1",
        "opponent": None,
        "tasks": 96,
        "k": 1,
        "success_rate": rate,
        "ci_low": low,
        "ci_high": high,
        "mean_return": 0.5208,
        "pass_at_k": rate,
        "mean_turns": 3.406,
        "mean_tokens": 27.35,
        "details": details,
    }


@pytest.mark.parametrize("width", [80, 60, 120])
def test_the_eval_table_gives_up_columns_before_its_interval(width):
    from rlcli.report.tables import evals_table

    rows = [
        quickstart_eval_row("base", 0.0417, 0.0163, 0.1024),
        quickstart_eval_row("sft", 0.2083, 0.1399, 0.2993, failed=2),
        quickstart_eval_row("latest (#25)", 0.5208, 0.4215, 0.6185),
    ]
    out = io.StringIO()
    Console(file=out, width=width).print(evals_table(rows))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= width
    assert_whole(lines)
    body = [line for line in lines if line.startswith("│")]
    assert [INTERVAL.findall(line) for line in body] == [["2%–10%"], ["14%–30%"], ["42%–62%"]]
    header = {cell.strip() for cell in next(line for line in lines if line.startswith("┃")).split("┃")}
    assert {"checkpoint", "success", "95% CI", "failed"} <= header
    if width >= 120:  # room for all of them
        assert {"return", "pass@k", "turns", "tokens", "entropy", "decoding"} <= header


def test_runs_list_keeps_run_names_and_intervals_whole_at_80_columns():
    """At 80 columns `runs list` cut every cell to a few characters: `quicks…` for both quickstart and
    quickstart-distill, `79% [70–86…`, so no run could be told from another."""
    from rlcli.report.tables import runs_table

    def row(name: str, stages: str, held: dict | None) -> dict:
        done = {"summary": stages}
        return dict(
            name=name,
            status="done",
            model="smollm2-135m",
            env="guess_number",
            stages_done=done,
            held_out=held,
            created_at="2026-11-28T16:26:25.123+00:00",
        )

    held = {"success_rate": 0.7917, "ci_low": 0.70, "ci_high": 0.86, "label": "latest (#33)"}
    rows = [
        row("quickstart", "sft, grpo 32/32, 6 evals", held),
        row("quickstart-distill", "sft, distill 32/32, 8 evals", {**held, "label": "best (#50)"}),
        row("a-run-with-a-rather-long-name-x", "none", None),
    ]
    out = io.StringIO()
    Console(file=out, width=80).print(runs_table(rows))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert_whole(lines)
    text = out.getvalue()
    for name in ("quickstart ", "quickstart-distill", "79% [70–86%]", "latest (#33)", "best (#50)"):
        assert name in text, text
    first_cells = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert "a-run-with-a-rather-long-name-x" in first_cells  # a name too long for one line folds, whole


def test_the_stage_commands_summaries_fit_80_columns():
    """`rlcli rollout` and `rlcli label` end with a table each: whole at 80 columns."""
    from rlcli.engine.labelling import LabelSummary
    from rlcli.report.tables import episodes_table, labels_table
    from rlcli.store.records import EpisodeSummary

    out = io.StringIO()
    console = Console(file=out, width=80)
    console.print(episodes_table("rollout", EpisodeSummary(64, 1, 0.5123, 0.25, 3.4, 12345, 2)))
    components = ("env_return", "format_ok", "length_penalty", "judge_score", "tool_calls_ok")
    means = {"reward_mean": 0.9, **{f"{name}_mean": -0.0123 for name in components}}
    console.print(labels_table([LabelSummary("rollout/12", "default", 64, means)]))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert_whole(lines)
    for name in ("return_mean", "success_rate", "replayed_lost", "total", *components):
        assert name in out.getvalue()


def test_one_startup_summary_line_says_what_runs_where(narrow_run):
    done, _ = narrow_run
    summary = [line for line in done.stderr.splitlines() if line.startswith("rlcli run ")]
    assert len(summary) == 1, done.stderr
    line = summary[0]
    for part in ("run t:", "tiny-random", "LoRA r4", "on cpu", "engine hf", "torch thread", "stages grpo, eval"):
        assert part in line, line


def test_overall_progress_is_plain_lines_when_stderr_is_no_terminal(narrow_run):
    done, _ = narrow_run
    progress = [line for line in done.stderr.splitlines() if line.startswith("progress: ")]
    assert len(progress) == 4, done.stderr
    assert progress[0] == "progress: stage 1/2, grpo" and progress[3] == "progress: stage 2/2, eval"
    assert re.fullmatch(r"progress: grpo, iteration 1/2, about \d+ (s|min) left", progress[1]), progress[1]
    assert progress[2] == "progress: grpo, iteration 2/2"
    assert "\x1b[" not in done.stderr  # no cursor moves or colours in a pipe


def test_run_writes_the_curves_png_into_the_run_folder_and_prints_its_path(narrow_run):
    done, runs = narrow_run
    png = runs / "t" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done.stdout.splitlines()[-1] == f"curves: {png}"


def test_the_overall_bar_on_a_terminal_shows_the_stage_the_iteration_and_an_estimate():
    from rlcli.console import RunProgress

    out = io.StringIO()
    progress = RunProgress(Console(file=out, force_terminal=True, width=80))
    with progress.running("t", ["grpo", "eval"]):  # the first stage at work
        progress.steps(0, 4, "iteration")
        progress.steps(1, 4, "iteration")
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the text, without the terminal's codes
    assert "t: grpo (stage 1/2)" in shown and "iteration 1/4" in shown, shown
    assert re.search(r"about \d+ (s|min) left", shown), shown
    assert "progress: " not in shown  # a terminal gets the bar, not the plain lines
