"""`rlcli recipes explain` and docs/recipe.md: the recipe schema shown from the pydantic models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcli.cli.app import main
from rlcli.cli.recipes import REGENERATE_DOCS, schema_markdown
from rlcli.recipe import Recipe, schema_docs

DOCS = Path(__file__).parents[2] / "docs" / "recipe.md"


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def test_docs_match_the_schema():
    assert DOCS.read_text() == schema_markdown(), f"docs/recipe.md is out of date; run `{REGENERATE_DOCS}`"


def test_every_section_and_field_is_described():
    sections = schema_docs()
    assert [s.name for s in sections] == list(Recipe.model_fields)
    for section in sections:
        assert section.description, section.name
        for field in section.fields:
            assert field.description and field.type, field.path


def test_explain_everything(capsys):
    code, out, err = cli(capsys, "recipes", "explain")
    assert code == 0, err
    for section in schema_docs():
        assert f"{section.name} (" in out
    assert "grpo.tis_cap" in out and "float > 0, or null" in out


def test_explain_a_section(capsys):
    code, out, _ = cli(capsys, "recipes", "explain", "lora")
    assert code == 0
    assert "lora.r" in out and "section or null" in out and "grpo." not in out


def test_explain_a_field_as_json(capsys):
    code, out, _ = cli(capsys, "recipes", "explain", "grpo.iterations", "--json")
    assert code == 0
    [section] = json.loads(out)
    assert section["name"] == "grpo"
    assert section["fields"] == [
        {
            "path": "grpo.iterations",
            "type": "int >= 0",
            "required": False,
            "default": 10,
            "description": "Rollout -> label -> update iterations.",
            "resume_safe": True,
        }
    ]


def test_required_field_has_no_default(capsys):
    code, out, _ = cli(capsys, "recipes", "explain", "rewards.fn", "--json")
    assert code == 0
    [field] = json.loads(out)[0]["fields"]
    assert field["required"] and field["default"] is None


@pytest.mark.parametrize(
    ("name", "hint"),
    [("grpoo", "did you mean grpo?"), ("grpo.lrr", "did you mean grpo.lr?"), ("rewards.wieght", "rewards.weight?")],
)
def test_unknown_name_says_what_was_meant(capsys, name, hint):
    code, out, err = cli(capsys, "recipes", "explain", name)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and hint in lines[0] and "Traceback" not in err


def test_markdown_is_for_the_whole_schema(capsys):
    code, out, _ = cli(capsys, "recipes", "explain", "--markdown")
    assert code == 0 and out == schema_markdown()
    code, _, err = cli(capsys, "recipes", "explain", "grpo", "--markdown")
    assert code == 2 and "--markdown" in err


def test_database_docs_list_every_field_that_may_change_on_resume():
    """docs/database.md names, field by field, what a resumed run may change without --force: exactly
    the fields the code lets through (recipe.changed_fields)."""
    import re

    text = (DOCS.parent / "database.md").read_text()
    paragraph = text[text.index("Continuing a run compares") : text.index("Any other change is refused")]
    listed = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", paragraph))
    safe = {f.path for section in schema_docs() for f in section.fields if f.resume_safe}
    assert listed == safe, f"missing: {sorted(safe - listed)}; not resume-safe: {sorted(listed - safe)}"


def test_every_field_the_database_docs_list_may_change_on_resume_as_the_code_allows():
    """Each field docs/database.md lists, changed on its own, passes recipe.changed_fields (the
    check start_run makes), a reward's field in every reward; a field it does not list does not."""
    import copy
    import re

    from rlcli.recipe import changed_fields, load_recipe

    text = (DOCS.parent / "database.md").read_text()
    paragraph = text[text.index("Continuing a run compares") : text.index("Any other change is refused")]
    old = load_recipe(None, ["rewards=[{fn: env_return}, {fn: format}]"]).to_dict()

    def changed(path: str) -> list[str]:
        section, field = path.split(".")
        new = copy.deepcopy(old)
        for part in new[section] if isinstance(new[section], list) else [new[section]]:
            part[field] = ["changed", part.get(field)]  # unlike any value it held
        return changed_fields(old, new)

    for path in sorted(set(re.findall(r"`([a-z_]+\.[a-z_]+)`", paragraph))):
        assert changed(path) == [], path
    for path in ("grpo.lr", "rollout.group_size", "rewards.weight", "rewards.kwargs", "sft.source"):
        assert changed(path), path


def test_the_docs_say_that_with_env_workers_0_a_timed_out_call_runs_on_in_a_thread():
    """With env.workers 0 a call past env.step_timeout_s cannot be stopped: each leaves a thread
    running. The fields that choose this and the env docs say so."""
    for path in ("env.workers", "env.step_timeout_s"):
        [section] = schema_docs(path)
        [field] = section.fields
        assert "thread" in field.description and "each" in field.description, path
    text = (DOCS.parent / "environments.md").read_text()
    assert "each timed-out call leaves a thread running" in " ".join(text.split())


def test_explain_fits_80_columns_with_every_field_name_whole():
    """At a terminal's 80 columns, every line fits and no field name is split across two lines
    (grpo.minibatch_siz / e); the type, the default and the description are read under it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "rlcli", "recipes", "explain"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    names = {word.strip("│┃ ") for line in lines for word in line.split("│")}
    missing = [f.path for s in schema_docs() for f in s.fields if f.path not in names]
    assert not missing, missing
    assert "float > 0, or null" in done.stdout and "Peak learning rate (AdamW)." in done.stdout
