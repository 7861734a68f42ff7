"""Results on stdout, progress on stderr: `rlcli ... > results.txt` keeps every result table."""

from __future__ import annotations

from helpers import cli, write_recipe


def test_runs_resume_prints_its_result_tables_on_stdout(tmp_path, capsys, monkeypatch, rlcli_home):
    """`runs resume` printed its stage summaries on stderr, where `rlcli run` prints them on stdout."""
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", grpo={"iterations": 0}, eval={"tasks": 1, "checkpoints": ["base"]})
    code, out, err = cli(capsys, "run", "-r", recipe)
    assert code == 0, err
    assert "Evaluation" in out and "Evaluation" not in err
    curves = rlcli_home / "t" / "metrics.png"
    assert f"curves: {curves}" in out
    curves.unlink()
    code, out, err = cli(capsys, "runs", "resume", "t")
    assert code == 0, err
    assert "Evaluation" in out and "best" in out
    assert "Evaluation" not in err and "┃" not in err
    # and draws the run's curves, as `rlcli run` does (it wrote none before)
    assert curves.is_file() and f"curves: {curves}" in out
