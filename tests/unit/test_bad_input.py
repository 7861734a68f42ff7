"""Bad input of every kind, from a user or a model: one sentence naming what is wrong, exit 2, never a
traceback, an "unexpected" error, a message of megabytes or text that takes the terminal over.

Issue 51: YAML alias bombs, duplicate keys, huge integers, bad -k values, click's usage errors and
bidirectional-override characters.
"""

from __future__ import annotations

import io

import pytest
from rich.table import Table

from helpers import cli
from rlcli.console import terminal_console
from rlcli.errors import MESSAGE_LIMIT, UsageError
from rlcli.recipe import load_recipe


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[:3000]
    assert "Traceback" not in err and "unexpected" not in err, err[:3000]
    return lines[0]


def laughs(levels: int) -> str:
    """A "billion laughs": each level a list of nine aliases of the level below; 9**levels values."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "env:\n  name: arithmetic\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)


# --- YAML: aliases, duplicate keys, nesting --------------------------------------------------


@pytest.mark.parametrize("levels", [5, 9])
def test_an_alias_bomb_is_refused_in_one_short_sentence(capsys, tmp_path, levels):
    """Nine levels (about 900 bytes) stood for 387 million values: validation walked them for half a minute
    and quoted them all in its error. Five levels quote 400 KB."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs(levels) + f"run: {{name: bomb, description: *l{levels - 1}}}\n")
    assert len(bomb.read_text()) < 1000
    code, out, _ = cli(capsys, "recipes", "validate", "--schema", bomb)
    assert code == 2 and "aliases repeat more than 10,000 values" in one_line(out)
    assert len(out) < 400


def test_aliases_within_the_limit_and_merges_still_work(tmp_path):
    """A key merged in by `<<: *name` may be overridden: that is not a key written twice."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "run: {name: merged}\n"
        "rollout: {stop: &stops [END, STOP]}\n"
        "eval: &eval {tasks: 6, k: 2}\n"
        "env:\n  name: arithmetic\n  kwargs: {<<: *eval, k: 3, stops: *stops}\n"
    )
    assert load_recipe(recipe).env.kwargs == {"tasks": 6, "k": 3, "stops": ["END", "STOP"]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("run: &a {name: x, description: [*a]}\n", "the alias *a refers to a value that contains it"),
        ("run: {name: x}\nenv: {name: arithmetic, kwargs: {deep: " + "[" * 5000 + "]" * 5000 + "}}\n", "nested"),
    ],
    ids=["alias-inside-itself", "5000-levels"],
)
def test_recursive_and_deep_yaml_is_refused(capsys, tmp_path, text, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code, out, _ = cli(capsys, "recipes", "validate", "--schema", recipe)
    assert code == 2 and expected in one_line(out)


def test_a_section_written_twice_is_refused_naming_the_key_and_line(capsys, tmp_path):
    """PyYAML keeps the last of two equal keys: the first rollout section was dropped without a word."""
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("run:\n  name: twice\nrollout:\n  tasks: 4\nrollout:\n  group_size: 2\n")
    code, out, _ = cli(capsys, "recipes", "validate", "--schema", recipe)
    line = one_line(out)
    assert code == 2 and "line 5" in line and "key rollout is written twice, first at line 3" in line


def test_a_key_written_twice_inside_a_section_is_refused(capsys, tmp_path):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("run:\n  name: twice\n  seed: 1\n  seed: 2\n")
    code, out, _ = cli(capsys, "recipes", "validate", "--schema", recipe)
    assert code == 2 and "key seed is written twice, first at line 3" in one_line(out)


def test_an_override_value_is_read_within_the_same_bounds(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: r}\n")
    code, _, err = cli(capsys, "recipes", "plan", recipe, "env.kwargs={a: 1, a: 2}", "--gpu-gb", 24)
    assert code == 2 and "key a is written twice" in one_line(err)


# --- messages of bounded length ----------------------------------------------------------------


def test_a_huge_value_is_quoted_short(capsys, tmp_path):
    recipe = tmp_path / "long.yaml"
    recipe.write_text(f"run: {{name: long, seed: {'x' * 200_000}}}\n")
    code, out, _ = cli(capsys, "recipes", "validate", "--schema", recipe)
    assert code == 2 and "run.seed" in one_line(out) and len(out) < 600


def test_every_error_message_is_bounded(capsys, tmp_path, rlcli_home):
    """An error quoting a 200,000-character argument prints its start and its end, not all of it."""
    code, _, err = cli(capsys, "runs", "show", "a" * 200_000 + "/")
    assert code == 2 and "characters left out" in one_line(err) and len(err) < MESSAGE_LIMIT + 100


# --- numbers past what the run can hold ---------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["run.seed=99999999999999999999999"], "run.seed"),
        (["run.seed=-1"], "run.seed"),
        (["rollout.tasks=10000000000000"], "rollout.tasks"),
        (["rollout.group_size=10000000000000000000000"], "rollout.group_size"),
        (["rollout.tasks=2000", "rollout.group_size=1000"], "rollout.tasks x the group size"),
        (["eval.tasks=1000", "eval.k=1001"], "eval.tasks x eval.k"),
        (["env.eval_seed_start=99999999999999999999"], "env.eval_seed_start"),
    ],
)
def test_a_number_past_what_a_run_can_hold_is_refused(overrides, field):
    """They ended in an "unexpected" OverflowError (SQLite, numpy's seed) or MemoryError (a rollout's
    episodes planned up front). Checked on the schema: a run given them would fill the memory."""
    with pytest.raises(UsageError, match=field):
        load_recipe(None, overrides)


def test_a_huge_seed_is_refused_before_a_run_is_opened(capsys, tmp_path, rlcli_home):
    """It left a failed run behind."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: big}\n")
    code, _, err = cli(capsys, "rollout", "-r", recipe, "run.seed=99999999999999999999999")
    assert code == 2 and "run.seed: Input should be less than 4294967296" in one_line(err)
    assert not rlcli_home.exists()


# --- envs try -k ---------------------------------------------------------------------------------


def test_envs_try_kwargs_value_that_is_not_yaml(capsys):
    code, _, err = cli(capsys, "envs", "try", "arithmetic", "-k", "low=[1")
    line = one_line(err)
    assert code == 2 and "--kwargs 'low=[1'" in line and "expected key=value with a YAML value" in line


# --- click's usage errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected", "command"),
    [
        (["envs", "try", "arithmetic", "--seed", "abc"], "Invalid value for '--seed'", "rlcli envs try"),
        (["recipes", "plan", "quickstart", "--gpu-gb", "0"], "Invalid value for '--gpu-gb'", "rlcli recipes plan"),
        (["runs", "list", "--no-such-option"], "No such option: --no-such-option", "rlcli runs list"),
        (["envs", "try"], "Missing argument", "rlcli envs try"),
        (["runs", "lst"], "No such command 'lst'", "rlcli runs"),
    ],
    ids=["not-an-int", "out-of-range", "no-such-option", "missing-argument", "no-such-command"],
)
def test_click_usage_errors_are_one_sentence(capsys, argv, expected, command):
    """Typer printed a usage line, a hint and a 6-line box."""
    code, out, err = cli(capsys, *argv)
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith("Error: ") and expected in line and line.endswith(f"(see {command} --help).")


def test_no_arguments_still_print_the_help(capsys):
    code, out, err = cli(capsys, "runs")
    assert code == 2 and "Usage: rlcli runs" in out + err and "Error" not in out + err


# --- text that would take the terminal over --------------------------------------------------------


def test_bidi_controls_in_a_message_are_written_out(capsys, tmp_path):
    """After U+202E, a terminal shows the rest of the line right to left: `report\u202egpj.yaml` reads
    `reportlmay.jpg`."""
    code, out, _ = cli(capsys, "recipes", "validate", tmp_path / "report\u202egpj.yaml")
    assert code == 2 and "report\\u202egpj.yaml" in one_line(out)
    assert "\u202e" not in out


def test_everything_printed_has_its_control_characters_written_out():
    """The consoles escape at the output boundary, whatever prints (a table cell here), and keep their styles."""
    out = io.StringIO()
    console = terminal_console(file=out, force_terminal=True, width=100)
    table = Table("name")
    table.add_row("a\u202eb \u2066c\u2069 \x1b]0;owned\x07 \x9b2J")
    console.print(table)
    console.print("[bold]bold[/bold]")
    text = out.getvalue()
    assert "\\u202e" in text and "\\u2066" in text and "\\x1b]0;owned" in text and "\\x9b2J" in text
    assert not any(c in text for c in "\u202e\u2066\u2069\x07\x9b")
    assert "\x1b[1mbold" in text  # rich's own escape sequences pass
