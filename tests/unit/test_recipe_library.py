"""Recipes as a library (issue 35, item 5): the shipped recipes are listed with their purpose, copied
out to edit (never over a file), and run by name (`-r quickstart`)."""

from __future__ import annotations

import json
import re
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
    assert code == 0 and out.strip() == "my-arithmetic.yaml"
    assert load_recipe("my-arithmetic.yaml").grpo == load_recipe("arithmetic").grpo
    (tmp_path / "mine").mkdir()
    code, out, _ = cli(capsys, "recipes", "copy", "arithmetic", "mine")
    assert code == 0 and Path(out.strip()) == Path("mine/my-arithmetic.yaml")
    # An existing file stays as it was.
    (tmp_path / "edited.yaml").write_text("# my edits\n")
    code, out, err = cli(capsys, "recipes", "copy", "arithmetic", "edited.yaml")
    assert code == 2 and "edited.yaml already exists" in err and out == ""
    assert (tmp_path / "edited.yaml").read_text() == "# my edits\n"
    code, _, err = cli(capsys, "recipes", "copy", "nosuch")
    assert code == 2 and "No shipped recipe named 'nosuch'" in err and "quickstart" in err


def test_a_copied_recipe_says_its_own_name_and_command(tmp_path, capsys, monkeypatch):
    """A copy kept the shipped header's command (`rlcli run -r recipes/quickstart.yaml`), its measured
    "About 8 minutes" as if said of the copy, and `run.name: quickstart`: running the copy resumed, or
    was refused by, the demo's own run."""
    monkeypatch.chdir(tmp_path)
    for name in SHIPPED:
        code, out, err = cli(capsys, "recipes", "copy", name)
        assert code == 0, err
        copy = Path(out.strip())
        text = copy.read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert header[0].startswith(f"# my-{name}: a copy of rlcli's shipped recipe {name}"), header[0]
        assert "not of this copy" in " ".join(header[:3])
        commands = [line for line in header if re.search(r"rlcli .*(-r|recipes plan) ", line)]
        assert commands and all(f"my-{name}.yaml" in line for line in commands if f" {name}" in line), commands
        assert not any(f"recipes/{name}.yaml" in line or f"-r {name} " in f"{line} " for line in header), name
        shipped = load_recipe(name)
        copied = load_recipe(copy)
        assert copied.run.name == f"my-{name}" and copied.model_copy(update={"run": shipped.run}) == shipped
    # Named by the user: the file's name is the run's; one the shipped run has is made the copy's own.
    code, out, _ = cli(capsys, "recipes", "copy", "quickstart", "guess-lr.yaml")
    assert code == 0 and load_recipe("guess-lr.yaml").run.name == "guess-lr"
    assert "rlcli run -r guess-lr.yaml" in Path("guess-lr.yaml").read_text()
    code, out, _ = cli(capsys, "recipes", "copy", "quickstart", "quickstart.yaml")
    assert code == 0 and load_recipe("quickstart.yaml").run.name == "my-quickstart"
    code, out, err = cli(capsys, "recipes", "copy", "quickstart", "my exp.yaml")
    assert code == 2 and "'my exp'" in err and "named after its file" in err and not Path("my exp.yaml").exists()


def test_a_shipped_recipe_runs_by_its_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here: the name alone finds it
    assert recipe_file("quickstart").read_text() == (REPO / "recipes" / "quickstart.yaml").read_text()
    assert load_recipe("quickstart") == load_recipe(REPO / "recipes" / "quickstart.yaml")
    code, out, _ = cli(capsys, "recipes", "validate", "quickstart")
    assert code == 0 and "quickstart" in out
    # A file of that name in the working folder comes first: a user's own file is never shadowed.
    (tmp_path / "quickstart").write_text("run: {name: mine}\n")
    assert load_recipe("quickstart").run.name == "mine"
    code, out, _ = cli(capsys, "recipes", "validate", "quikstart")
    assert code == 2 and "did you mean quickstart?" in out and "rlcli recipes list" in out


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
