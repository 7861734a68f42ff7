"""`rlcli runs report RUN --html PATH`: the page about a run, on a real run of the tiny model, opened in
headless Chromium (tests/browser.py); and the curves it shares with `rlcli runs plot`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from browser import chromium, open_page  # noqa: F401 (chromium: a fixture)
from helpers import cli, run_in_process, write_recipe
from rlcli.recipe import Recipe
from rlcli.store.db import RunDB
from rlcli.store.run_store import RunStore

DIGITS = "def digits(completions, **kwargs):\n    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions]\n"


@pytest.fixture(scope="module")
def report_runs(tmp_path_factory, session_models) -> Path:
    """A real run, made once: 4 GRPO iterations of the tiny random model with a held-out eval every 2
    (a partial-credit reward, so that groups differ and the policy updates), then the eval of base
    and latest."""
    folder = tmp_path_factory.mktemp("report")
    (folder / "digits.py").write_text(DIGITS)
    recipe = write_recipe(
        folder / "r.yaml",
        run={"name": "rep", "seed": 0, "description": "the runs report test <b>not bold</b>"},
        rewards=[{"fn": f"{folder / 'digits.py'}:digits", "name": "digits"}],
        rollout={"tasks": 4, "group_size": 2, "max_new_tokens": 8, "batch_size": 8},
        grpo={"iterations": 4, "eval_every": 2, "eval_tasks": 3},
        eval={"tasks": 4, "checkpoints": ["base", "latest"]},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCLI_MODELS", str(session_models))
        done = run_in_process(["run", "-r", recipe], folder / "runs")
    assert done.returncode == 0, done.stderr
    return folder / "runs"


def test_report_page_in_a_browser(capsys, monkeypatch, report_runs, chromium, tmp_path):  # noqa: F811
    monkeypatch.setenv("RLCLI_HOME", str(report_runs))
    page_file = tmp_path / "out.html"
    code, out, err = cli(capsys, "runs", "report", "rep", "--html", page_file)
    assert code == 0, err
    assert out.strip() == str(page_file) and "Report of rep: 5 evals" in err
    source = page_file.read_text()
    # Self-contained: nothing to fetch, no script; the run's text is escaped.
    for fetch in ("http://", "https://", "<script", "<link", 'src="file', "@import"):
        assert fetch not in source, fetch
    assert "&lt;b&gt;not bold&lt;/b&gt;" in source

    with open_page(chromium, page_file, viewport={"width": 1280, "height": 900}) as (page, problems):
        sections = page.evaluate("() => [...document.querySelectorAll('.part')].map(p => p.id)")
        assert sections == ["summary", "evals", "curves", "warnings", "tasks", "best", "worst", "recipe"]
        # The recipe (YAML) and the versions recorded with the run.
        recipe = page.inner_text("#recipe pre")
        assert "name: rep" in recipe and "eval_every: 2" in recipe
        versions = page.inner_text("#versions")
        for package in ("rlcli", "torch", "transformers", "trl", "vllm"):
            assert package in versions
        # The curves: a decoded image.
        images = page.evaluate(
            "() => [...document.querySelectorAll('#curves img')].map(i => [i.complete, i.naturalWidth, i.naturalHeight])"
        )
        assert len(images) == 1 and all(done and width > 500 and height > 300 for done, width, height in images)
        # The eval table: the held-out evals during training (base and two checkpoints on 3 tasks), then
        # base and latest on 4, each with its interval.
        rows = page.evaluate(
            "() => [...document.querySelectorAll('#eval-table tr')].map(r => [...r.cells].map(c => c.innerText))"
        )
        header, body = rows[0], rows[1:]
        assert header[:5] == ["checkpoint", "decoding", "tasks×k", "success", "95% CI"] or header[:4] == [
            "checkpoint",
            "tasks×k",
            "success",
            "95% CI",
        ]
        ci = header.index("95% CI")
        labels = [r[0] for r in body]
        assert "base" in labels and any(label.startswith("latest") for label in labels) and len(body) == 5
        for r in body:
            low, high = (float(end.rstrip("%")) for end in r[ci].split("–"))
            assert 0 <= low <= float(r[ci - 1].rstrip("%")) <= high <= 100
        # Warnings, task difficulty, the best and the worst episodes (the episode viewer's sections).
        assert page.locator("#warnings table, #warnings p").count() >= 1
        assert "16 training tasks" in page.inner_text("#tasks")
        assert page.locator("#task-bins tr").count() == 6
        assert page.locator("#best section").count() == 3 and page.locator("#worst section").count() == 3
        assert "assistant" in page.inner_text("#best section >> nth=0")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert problems.all() == []
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000


def test_report_json_default_path_and_refusals(capsys, monkeypatch, report_runs, tmp_path):
    monkeypatch.setenv("RLCLI_HOME", str(report_runs))
    code, out, err = cli(capsys, "runs", "report", "rep", "--json", "-n", "1")
    assert code == 0, err
    data = json.loads(out)
    default = report_runs / "rep" / "report.html"
    assert data["files"] == [str(default)] and default.stat().st_size > 10_000
    assert len(data["episodes"]["best"]) == 1 and len(data["episodes"]["worst"]) == 1
    assert data["evals"] == 5 and data["tasks"] == 16  # 3 on grpo.eval_tasks during training, 2 on eval.tasks
    # The default file is rlcli's own: written again unasked.
    code, _, err = cli(capsys, "runs", "report", "rep", "-n", "0")
    assert code == 0 and "0 episodes" in err, err

    mine = tmp_path / "mine.html"
    mine.write_text("my notes")
    for args, message in (
        (["rep", "--html", mine], "pass --overwrite"),
        (["rep", "--html", tmp_path], "it is a folder"),
        (["ghost"], "No run named 'ghost'"),
        (["rep", "-n", "-1"], ""),  # Click's range check
    ):
        code, _, err = cli(capsys, "runs", "report", *args)
        assert code == 2 and message in err, (args, err)
    assert mine.read_text() == "my notes"
    code, _, err = cli(capsys, "runs", "report", "rep", "--html", mine, "--overwrite")
    assert code == 0, err
    assert mine.read_text().startswith("<!DOCTYPE html>") and list(tmp_path.glob(".mine.html.*")) == []


def test_report_of_a_run_with_nothing_yet(capsys, rlcli_home, tmp_path):
    rundb = RunDB.open(rlcli_home)
    rundb.start_run("empty", Recipe(), None)
    rundb.close()
    code, _, err = cli(capsys, "runs", "report", "empty", "--html", tmp_path / "empty.html")
    assert code == 0, err
    page = (tmp_path / "empty.html").read_text()
    assert "nothing to plot yet" in page and "No evaluation yet" in page and "None to show." in page


# --- the curves (report/plot.py, shared with `rlcli runs plot`) ------------------------------


def _gappy_run(folder: Path) -> RunDB:
    """Ten GRPO iterations; no update (no loss, KL or entropy) at iterations 3 and 4; an entropy that
    varies only in its fifth decimal, which matplotlib would show as 0 ... 12 and "1e-5+6.2121" in a corner."""
    rundb = RunDB.open(folder)
    rundb.start_run("g", Recipe(), None)
    for it in range(10):
        values = {"rollout/reward_mean": 0.1 * it, "rollout/success_rate": (it % 3) / 2}
        if it not in (3, 4):
            values |= {"train/loss": 0.5 - 0.01 * it, "train/kl": 0.001 * it, "train/entropy": 6.21212 + 0.00001 * it}
        rundb.log_metrics("g", "grpo", it, values)
    for it in (-1, 4, 9):
        rundb.log_metrics("g", "grpo", it, {"eval/success_rate": 0.2})
    return rundb


def _axes(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_curves_break_at_iterations_without_a_value_and_show_no_offset(tmp_path):
    from rlcli.report import plot

    rundb = _gappy_run(tmp_path)
    fig, drawn, evals = plot.run_figure(RunStore(rundb, "g"))
    rundb.close()
    fig.canvas.draw()
    assert {"train/loss", "train/entropy", "rollout/success_rate", "eval/success_rate"} <= set(drawn) and evals == []

    for title in ("Policy loss", "KL to reference", "Entropy"):
        [line] = _axes(fig, title).get_lines()
        xs, ys = line.get_xdata(), line.get_ydata()
        # No segment joins two points more than one iteration apart: a NaN sits in the gap.
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if math.isfinite(y0) and math.isfinite(y1):
                assert x1 - x0 <= 1, (title, x0, x1)
        assert any(math.isnan(y) for y in ys) and 2 in list(xs) and 5 in list(xs)

    entropy = _axes(fig, "Entropy")
    assert entropy.yaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in entropy.get_yticklabels() if t.get_text()]
    assert labels and all(label.startswith("6.212") for label in labels), labels

    # Train success: faint raw points and a moving mean over them; held-out evals stay joined.
    success = _axes(fig, "Success rate: train rollouts and held-out")
    lines = {line.get_label(): line for line in success.get_lines()}
    raw, smooth = lines["rollout/success_rate (raw)"], next(v for k, v in lines.items() if "mean of" in k)
    assert raw.get_alpha() < 0.5 and (smooth.get_alpha() or 1.0) == 1.0
    assert list(smooth.get_ydata()) != list(raw.get_ydata())
    assert not any(math.isnan(y) for y in lines["eval/success_rate"].get_ydata())


def test_plot_json_has_the_series_it_drew(capsys, rlcli_home, tmp_path):
    _gappy_run(rlcli_home).close()
    png = tmp_path / "g.png"
    code, out, err = cli(capsys, "runs", "plot", "g", "--out", png, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["run"] == "g" and data["files"] == [str(png)] and png.read_bytes().startswith(b"\x89PNG")
    loss = data["series"]["train/loss"]
    assert loss["stage"] == "grpo" and loss["steps"] == [0, 1, 2, 5, 6, 7, 8, 9] and len(loss["values"]) == 8
    assert data["series"]["eval/success_rate"]["steps"] == [-1, 4, 9] and data["evals"] == []
    code, out, _ = cli(capsys, "runs", "plot", "g", "--out", tmp_path / "kl.png", "-m", "train/kl", "--json")
    assert code == 0 and list(json.loads(out)["series"]) == ["train/kl"]
