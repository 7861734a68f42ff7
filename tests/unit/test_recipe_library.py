"""Recipes as a library (issue 35, item 5): the shipped recipes are listed with their purpose, copied
out to edit (never over a file), and run by name (`-r quickstart`)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import REPO, cli
from rlcli.recipe import load_recipe, recipe_file

SHIPPED = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def test_list_names_every_shipped_recipe_with_its_purpose(capsys):
    code, out, _ = cli(capsys, "recipes", "list", "--json")
    assert code == 0
    listed = json.loads(out)
    assert [r["name"] for r in listed] == SHIPPED
    assert all(r["purpose"] and r["purpose"].endswith(".") for r in listed), listed
    quickstart = next(r for r in listed if r["name"] == "quickstart")
    assert quickstart["purpose"] == "The quickstart: SmolLM2-135M-Instruct learns a multi-turn guessing game on CPU."
    assert Path(quickstart["path"]).read_text() == (REPO / "recipes" / "quickstart.yaml").read_text()
    code, out, _ = cli(capsys, "recipes", "list")
    assert code == 0 and "quickstart" in out and "Dr. GRPO" in out


def test_copy_writes_the_recipe_out_and_never_over_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli(capsys, "recipes", "copy", "arithmetic")
    assert code == 0 and out.strip() == "arithmetic.yaml"
    assert (tmp_path / "arithmetic.yaml").read_text() == (REPO / "recipes" / "arithmetic.yaml").read_text()
    (tmp_path / "mine").mkdir()
    code, out, _ = cli(capsys, "recipes", "copy", "arithmetic", "mine")
    assert code == 0 and Path(out.strip()) == Path("mine/arithmetic.yaml")
    # An existing file stays as it was.
    (tmp_path / "edited.yaml").write_text("# my edits\n")
    code, out, err = cli(capsys, "recipes", "copy", "arithmetic", "edited.yaml")
    assert code == 2 and "edited.yaml already exists" in err and out == ""
    assert (tmp_path / "edited.yaml").read_text() == "# my edits\n"
    code, _, err = cli(capsys, "recipes", "copy", "nosuch")
    assert code == 2 and "No shipped recipe named 'nosuch'" in err and "quickstart" in err


def test_a_shipped_recipe_runs_by_its_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here: the name alone finds it
    assert recipe_file("quickstart").read_text() == (REPO / "recipes" / "quickstart.yaml").read_text()
    assert load_recipe("quickstart") == load_recipe(REPO / "recipes" / "quickstart.yaml")
    code, out, _ = cli(capsys, "recipes", "validate", "quickstart")
    assert code == 0 and "quickstart" in out
    # A file of that name in the working folder comes first: a user's own file is never shadowed.
    (tmp_path / "quickstart").write_text("run: {name: mine}\n")
    assert load_recipe("quickstart").run.name == "mine"
    code, _, err = cli(capsys, "recipes", "validate", "quikstart")
    assert code == 2 and "did you mean quickstart?" in err and "rlcli recipes list" in err


def test_piped_output_keeps_a_table_row_on_one_line(tmp_path):
    import os
    import subprocess

    from helpers import RLCLI

    purpose = "Single-turn verifiable rewards: GRPO on two-digit addition with a numeric-match reward."
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run([*RLCLI, "recipes", "list"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert piped.returncode == 0 and any("arithmetic" in line and purpose in line for line in piped.stdout.splitlines())
    narrow = subprocess.run([*RLCLI, "recipes", "list"], capture_output=True, text=True, env={**env, "COLUMNS": "80"})
    assert not any(purpose in line for line in narrow.stdout.splitlines())  # COLUMNS still rules
