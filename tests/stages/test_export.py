"""`rlcli export --merge`: never deletes or overwrites a folder rlcli did not write (tiny-random)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import make_ctx, write_recipe
from rlcli.cli.app import main
from rlcli.store.checkpoints import add_checkpoint


@pytest.fixture
def run_with_checkpoint(tmp_path, rlcli_home, monkeypatch) -> str:
    """A run `t` whose latest checkpoint is a LoRA adapter on tiny-random."""
    from rlcli.models import loading

    monkeypatch.chdir(tmp_path)
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), rlcli_home)
    model, tokenizer = loading.load_policy(ctx.recipe.model, ctx.recipe.lora, ctx.recipe.quantization)
    checkpoint = loading.save_checkpoint(model, tokenizer, ctx.run_dir / "ckpt-0")
    add_checkpoint(ctx.store, "train/0", 0, checkpoint.resolve(), "lora")
    ctx.rundb.close()
    return ctx.run


def export(capsys, *args) -> tuple[int, str]:
    try:
        main(["export", *map(str, args)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_a_folder_rlcli_did_not_write_survives(capsys, run_with_checkpoint, tmp_path):
    base_model = tmp_path / "my-model"
    base_model.mkdir()
    files = {"config.json": "{}", "model.safetensors": "weights", "README.md": "mine"}
    for name, text in files.items():
        (base_model / name).write_text(text)
    code, err = export(capsys, run_with_checkpoint, "--merge", base_model)
    assert code == 2 and "not written by rlcli" in err and "Traceback" not in err
    assert {p.name: p.read_text() for p in base_model.iterdir()} == files


def test_export_draws_no_transformers_progress_bars(capsys, run_with_checkpoint, tmp_path):
    """transformers drew "Loading weights" and "Writing model shards" bars on export's stderr, among its
    sentences; rlcli's model loads turn them off, and so does the export."""
    from transformers.utils import logging as hf_logging

    drawn = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as a new process starts: the fixture's model load turned them off
    try:
        code, err = export(capsys, run_with_checkpoint, "--merge", tmp_path / "merged")
    finally:
        (hf_logging.enable_progress_bar if drawn else hf_logging.disable_progress_bar)()
    assert code == 0, err
    assert "it/s" not in err and "Loading weights" not in err and "shards" not in err, err


def test_a_second_export_needs_overwrite(capsys, run_with_checkpoint, tmp_path):
    out = tmp_path / "merged"
    assert export(capsys, run_with_checkpoint, "--merge", out)[0] == 0
    assert (out / "config.json").is_file()
    (out / "extra.txt").write_text("from the first export")
    code, err = export(capsys, run_with_checkpoint, "--merge", out)
    assert code == 2 and "--overwrite" in err
    assert (out / "extra.txt").is_file()
    assert export(capsys, run_with_checkpoint, "--merge", out, "--overwrite")[0] == 0
    assert (out / "config.json").is_file() and not (out / "extra.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["merged", "r.yaml", "rlcli-home"])


def test_merge_into_a_file_or_the_current_folder_exits_2(capsys, run_with_checkpoint, tmp_path):
    (tmp_path / "taken").write_text("mine")
    code, err = export(capsys, run_with_checkpoint, "--merge", tmp_path / "taken")
    assert code == 2 and "is a file" in err and (tmp_path / "taken").read_text() == "mine"
    code, err = export(capsys, run_with_checkpoint, "--merge", ".")
    assert code == 2 and "current folder" in err and "unexpected" not in err
    assert Path.cwd() == tmp_path and (tmp_path / "r.yaml").is_file()
