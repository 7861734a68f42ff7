"""The command line: exit codes, one-line errors, --json output, fast startup (no torch).

Stage modules (rlcli.engine.rollout, rlcli.engine.grpo.loop, ...) are not exercised here: every stage command below
fails in `open_run` before it imports one, and runs are started through `open_run` directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import cli, write_recipe
from rlcli.cli.app import main
from rlcli.engine.context import RunContext
from rlcli.engine.opening import open_run
from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import Recipe
from rlcli.store.checkpoints import add_checkpoint
from rlcli.store.db import DB_NAME, RunDB
from rlcli.store.run_store import RunStore
from rlcli.store.stages import run_stage

REPO = Path(__file__).parents[2]
RLCLI = Path(sys.executable).parent / "rlcli"


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    # Nothing the CLI writes by default (./runs, git lookups) may land in the repository.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "good.yaml"
    path.write_text("run:\n  name: good\n  seed: 3\ngrpo:\n  lr: 3.0e-4\n  iterations: 2\n")
    return path


@pytest.fixture
def bad(tmp_path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  lrr: 1\n")
    return path


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True, timeout=60, **kwargs
    )


# --- fast startup ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["recipes", "validate", "{good}"],
        ["recipes", "explain", "grpo"],
        ["runs", "list", "--json"],
        ["rollout", "--help"],
    ],
    ids=["help", "recipes-validate", "recipes-explain", "runs-list", "rollout-help"],
)
def test_light_commands_do_not_import_torch(argv, good):
    argv = [a.format(good=good) for a in argv]
    proc = python(
        f"""
        import sys
        from rlcli.cli.app import app
        try:
            app(args={argv!r}, prog_name="rlcli")
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        heavy = [m for m in ("torch", "transformers", "trl", "peft", "datasets") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    assert proc.returncode == 0, proc.stderr


def test_every_command_and_option_has_help():
    import click
    import typer.main

    from rlcli.cli.app import app

    def walk(command: click.Command, path: str) -> None:
        for param in command.params:
            assert getattr(param, "help", None), f"{path} {param.name}"
        for name, sub in getattr(command, "commands", {}).items():
            assert sub.help, f"{path} {name}"
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "rlcli")


def test_no_help_text_loses_brackets_to_rich_markup():
    """Typer renders help as rich markup, where "[image <sha256> WxH]" is a style tag and vanished
    from `runs episodes --help`; such text must be escaped ("\\[")."""
    import click
    import typer.main
    from rich.text import Text

    from rlcli.cli.app import app

    def check(text: str | None, where: str) -> None:
        if text:
            assert Text.from_markup(text).plain.count("[") == text.count("["), where

    def walk(command: click.Command, path: str) -> None:
        check(command.help, path)
        for param in command.params:
            check(getattr(param, "help", None), f"{path} {param.name}")
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "rlcli")


def _commands() -> list[tuple[list[str], object]]:
    """Every command and command group of the app, with the words that name it (["recipes", "list"])."""
    import typer.main

    from rlcli.cli.app import app

    found = []

    def walk(command, path: list[str]) -> None:
        found.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_help_paragraphs_break_where_the_terminal_ends_not_where_the_source_did(capsys, monkeypatch):
    """A docstring's paragraphs are folded to fit the source; rich help kept those line breaks in a
    group's list of commands (`rlcli recipes --help` broke `list`'s line after "Run one with")."""
    import inspect

    from rich.text import Text

    monkeypatch.setenv("COLUMNS", "3000")  # so wide that only a line break in the text breaks a line
    for path, command in _commands():
        code, out, _ = cli(capsys, *path, "--help")
        assert code == 0, path
        lines = out.splitlines()
        texts = [(path, command.help)] + [([*path, n], sub.help) for n, sub in getattr(command, "commands", {}).items()]
        for where, text in texts:
            # the command's own paragraphs, and each subcommand's first (its line in the list)
            paragraphs = (
                inspect.cleandoc(text).split("\n\n") if where == path else [inspect.cleandoc(text).split("\n\n")[0]]
            )
            for paragraph in paragraphs:
                if paragraph.startswith("Examples:"):
                    continue
                one = Text.from_markup(" ".join(paragraph.split())).plain
                assert any(one in " ".join(line.split()) for line in lines), (where, paragraph)


# The commands a newcomer reaches for first: each one's help ends with examples to copy.
EXAMPLE_COMMANDS = [
    ["run"], ["sft"], ["rollout"], ["label"], ["train", "grpo"], ["eval"],
    ["runs", "show"], ["runs", "list"], ["recipes", "validate"],
]  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLE_COMMANDS, ids=" ".join)
def test_main_commands_show_examples_that_parse(capsys, path):
    """`--help` of each main command ends with an Examples section, a command line a line; each one
    names this command and parses with its options (an example naming a renamed option fails here)."""
    import shlex

    code, out, _ = cli(capsys, *path, "--help")
    assert code == 0
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Examples:"), None)
    assert start is not None, out
    examples = [line.strip() for line in lines[start + 1 :] if line.strip().startswith("rlcli ")]
    assert examples, out
    commands = dict((" ".join(p), c) for p, c in _commands())
    for example in examples:
        words = shlex.split(example, comments=True)[1:]
        while words[0] in ("--debug", "--runs-dir"):  # the shared options, before the command
            words = words[2:] if words[0] == "--runs-dir" else words[1:]
        assert words[: len(path)] == path, example
        command = commands[" ".join(path)]
        with command.make_context(" ".join(path), words[len(path) :]) as ctx:  # raises on a bad option
            assert ctx.command is command


@pytest.mark.parametrize("argv", [["recipes", "list"], ["envs", "list"], ["recipes", "explain", "grpo"]], ids=" ".join)
def test_piped_tables_end_their_lines_at_their_last_character(capsys, argv):
    """Piped, a table was padded with spaces to the console's width (160 columns) on every line."""
    code, out, _ = cli(capsys, *argv)
    assert code == 0 and out.count("\n") > 3
    assert [line for line in out.splitlines() if line != line.rstrip()] == []


def test_envs_list_says_textarena_games_may_have_two_players(capsys):
    """It called the TextArena adapter's games single-player, though TicTacToe-v0 and others play a seat
    against env.opponent."""
    code, out, _ = cli(capsys, "envs", "list")
    text = " ".join(out.split())
    assert code == 0 and "single-player TextArena games" not in text
    assert "two-player against env.opponent, e.g. textarena:TicTacToe-v0" in text


def test_help_lists_the_commands(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    for command in ("run", "sft", "rollout", "label", "train", "eval", "export", "runs", "envs", "models", "recipes"):
        assert command in out


def test_version(capsys):
    """The version is set once, in rlcli.__version__ (pyproject.toml reads it there; it said 0.1.0 in both
    after three releases' work), and --version prints the running code's, not an editable install's
    metadata from the day it was installed."""
    import re

    import rlcli

    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "rlcli.__version__" }' in pyproject
    project = pyproject.split("\n[project]\n")[1].split("\n[")[0]
    assert not re.search(r"^version\s*=", project, re.MULTILINE)  # no second place to forget
    assert re.fullmatch(r"\d+\.\d+\.\d+", rlcli.__version__)
    code, out, err = cli(capsys, "--version")
    assert code == 0 and err == ""
    assert out.strip() == f"rlcli {rlcli.__version__}"


@pytest.mark.parametrize(
    "argv", [["runs", "list"], ["runs", "show"], ["run"], ["eval"], ["recipes", "validate"], []], ids=" ".join
)
def test_help_shows_no_bool_metavar_nor_braces(capsys, argv):
    """Flags take no value, so their help shows none (`--force`, not `--force <bool>`), and usage
    names arguments as click does (`RUN`, `[OVERRIDES]...`), not in braces (`{run}`)."""
    code, out, _ = cli(capsys, *argv, "--help")
    assert code == 0
    usage = next(line for line in out.splitlines() if "Usage:" in line)
    assert "<bool>" not in out and "{" not in usage, out
    assert "--help" in out


# --- recipes validate ----------------------------------------------------------------------


def unwrapped(out: str) -> str:
    """stdout without the line breaks rich folds a long path with at the console's 80 columns (a
    pytest-xdist worker's tmp_path is 10 characters longer than a serial run's)."""
    return out.replace("\n", "")


def test_recipes_validate_good(capsys, good):
    code, out, err = cli(capsys, "recipes", "validate", good)
    assert code == 0 and str(good) in unwrapped(out) and err == ""


def test_recipes_validate_good_and_bad(capsys, good, bad):
    """A line a recipe, on stdout, passed or failed: the failures went to stderr, away from the passes."""
    code, out, err = cli(capsys, "recipes", "validate", good, bad)
    assert code == 2 and err == ""
    passed, failed = out.splitlines()
    assert passed == f"✓ {good}"
    assert failed.startswith(f"✗ {bad}:") and "grpo.lrr" in failed and "grpo.lr?" in failed


def test_recipes_validate_reports_every_bad_file(capsys, tmp_path, bad):
    missing = tmp_path / "missing.yaml"
    code, out, _ = cli(capsys, "recipes", "validate", bad, missing)
    assert code == 2
    assert "grpo.lrr" in out and str(missing) in out and "does not exist" in out


def test_recipes_validate_applies_overrides_as_a_stage_command_does(capsys, good, tmp_path):
    """It took recipe files only: an override a stage command would refuse could not be checked first."""
    code, out, _ = cli(capsys, "recipes", "validate", good, "grpo.lr=-1", "run.name=bad name!")
    line = one_line(out)
    assert code == 2 and line.startswith(f"✗ {good}:") and "grpo.lr" in line
    code, out, _ = cli(capsys, "recipes", "validate", good, "run.name=bad name!")
    assert code == 2 and "Run name 'bad name!' is not valid" in one_line(out)
    code, out, _ = cli(capsys, "recipes", "validate", good, "sft.source=missing.jsonl", "--schema")
    assert code == 0 and one_line(out) == f"✓ {good}"  # the schema alone: no file looked for
    code, out, _ = cli(capsys, "recipes", "validate", good, "grpo.lr=1e-4", "--json")
    assert code == 0 and json.loads(out)["overrides"] == ["grpo.lr=1e-4"]
    code, _, err = cli(capsys, "recipes", "validate", "grpo.lr=1e-4")
    assert code == 2 and "No recipe to validate" in one_line(err)


def test_recipes_validate_json(capsys, good, bad):
    code, out, err = cli(capsys, "recipes", "validate", good, bad, "--json")
    assert code == 2 and err == ""
    report = json.loads(out)
    assert report["ok"] is False
    assert [(f["path"], f["ok"]) for f in report["files"]] == [(str(good), True), (str(bad), False)]
    assert report["files"][0]["errors"] == [] and "grpo.lrr" in report["files"][1]["errors"][0]
    code, out, err = cli(capsys, "recipes", "validate", good, "--json")
    assert code == 0 and err == "" and json.loads(out)["ok"] is True


def test_recipes_validate_shipped_recipes(capsys):
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert REPO / "recipes" / "quickstart.yaml" in recipes  # deleting the recipes must fail, not pass
    # --schema: the GPU recipes name hub models, which this offline machine cannot run.
    code, _, err = cli(capsys, "recipes", "validate", "--schema", *recipes)
    assert code == 0, err
    # multihop_search_agent starts from a model that another recipe's run exports (its header says how).
    cpu = [r for r in recipes if "gpu" not in r.stem and r.stem not in ("gui_click_vlm", "multihop_search_agent")]
    code, _, err = cli(capsys, "recipes", "validate", *cpu)
    assert code == 0, err


@pytest.mark.parametrize("name", ["résumé", "models", "rlcli.db"])
def test_recipes_validate_refuses_a_run_name_every_command_refuses(capsys, tmp_path, name):
    """It used to pass run names (résumé) that every command then refused."""
    recipe = write_recipe(tmp_path / "r.yaml", run={"name": name, "seed": 0})
    for schema in ([], ["--schema"]):  # a rule, the same on every machine
        code, out, _ = cli(capsys, "recipes", "validate", *schema, recipe)
        line = one_line(out)
        assert code == 2 and str(recipe) in line and f"Run name {name!r} is" in line, line
    code, _, err = cli(capsys, "rollout", "-r", recipe)
    assert code == 2 and f"Run name {name!r} is" in one_line(err)


# A package no machine has: wandb's stands in for it below, so that a run would refuse the tracker.
MISSING_PACKAGE = "rlcli_no_such_package"


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"rewards": [{"fn": "exact_matsh"}]}, "exact_matsh"),
        ({"model": {"name": "smollm-135m"}}, "did you mean smollm2-135m?"),
        ({"env": {"name": "guess_number", "kwargs": {"hihg": 3}}}, "hihg"),
        ({"run": {"name": "t", "trackers": ["wandb"]}}, f"pip install {MISSING_PACKAGE}"),
    ],
)
def test_recipes_validate_checks_what_a_run_would_before_starting(capsys, monkeypatch, tmp_path, section, expected):
    from rlcli.engine import trackers

    monkeypatch.setitem(trackers.PACKAGES, "wandb", MISSING_PACKAGE)
    recipe = write_recipe(tmp_path / "r.yaml", **section)
    code, out, _ = cli(capsys, "recipes", "validate", recipe)
    assert code == 2 and expected in one_line(out) and str(recipe) in out, out
    code, _, err = cli(capsys, "recipes", "validate", "--schema", recipe)  # the schema alone takes each
    assert code == 0, err


# --- stage commands: errors before any stage module is imported ------------------------------


def test_unknown_recipe_key_through_a_stage_command(capsys, bad):
    code, _, err = cli(capsys, "rollout", "-r", bad)
    assert code == 2
    line = one_line(err)
    assert "grpo.lrr" in line and "did you mean grpo.lr?" in line and str(bad) in line


def test_bad_override_through_a_stage_command(capsys, good):
    code, _, err = cli(capsys, "train", "grpo", "-r", good, "grpo.lr")
    assert code == 2 and "section.field=value" in one_line(err)
    code, _, err = cli(capsys, "eval", "-r", good, "rollout.group_size=many")
    assert code == 2 and "rollout.group_size" in one_line(err)
    code, _, err = cli(capsys, "eval", "-r", good, "rollout.stop=[")  # was an "unexpected ScannerError"
    assert code == 2 and "'rollout.stop=['" in one_line(err) and "not valid YAML" in one_line(err)


def test_missing_recipe_file(capsys, tmp_path):
    code, _, err = cli(capsys, "sft", "-r", tmp_path / "nope.yaml")
    assert code == 2 and "does not exist" in one_line(err)


def test_stage_command_without_recipe_or_run(capsys):
    code, _, err = cli(capsys, "rollout")
    assert code == 2 and "--recipe" in one_line(err)


@pytest.mark.parametrize("name", ["bad/name", "../up", "with space", ".hidden"])
def test_bad_run_name_via_run_option(capsys, good, name):
    code, _, err = cli(capsys, "rollout", "-r", good, "--run", name)
    assert code == 2
    line = one_line(err)
    assert "not valid" in line and repr(name) in line


def test_a_run_name_differing_only_in_case_is_refused(capsys, tmp_path, rlcli_home):
    # On a case-insensitive file system (macOS) Exp1 and exp1 share a folder, and so their checkpoints.
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    with open_run(recipe, "exp1", rlcli_home, []):
        pass
    code, _, err = cli(capsys, "rollout", "-r", recipe, "--run", "Exp1")
    assert code == 2 and "'exp1'" in one_line(err) and "case" in one_line(err)
    assert _run_rows(rlcli_home, "Exp1")["runs"] == [] and not (rlcli_home / "Exp1").exists()


def test_an_invalid_run_name_is_refused_before_the_database_is_created(capsys, rlcli_home, good):
    for name in ("bad/name", "a" * 300):
        code, _, err = cli(capsys, "rollout", "-r", good, "--run", name)
        assert code == 2 and "not valid" in one_line(err)
        assert not rlcli_home.exists()
    code, _, err = cli(capsys, "rollout", "-r", good, "--run", "a" * 300)
    assert "at most 100 characters" in err


def test_bad_run_name_via_runs_resume(capsys):
    code, _, err = cli(capsys, "runs", "resume", "bad/name")
    assert code == 2 and "not valid" in one_line(err)


def test_resume_of_unknown_run(capsys):
    code, _, err = cli(capsys, "runs", "resume", "ghost")
    assert code == 2 and "'ghost'" in one_line(err)


def test_usage_errors_from_click_exit_2(capsys):
    code, _, err = cli(capsys, "rollout", "--no-such-option")
    assert code == 2 and "No such option" in err


# --- open_run -----------------------------------------------------------------------------------


def test_open_run_overrides_reach_the_stored_recipe(tmp_path, good):
    runs = tmp_path / "runs"
    with open_run(good, None, runs, ["grpo.lr=1e-3", "rollout.group_size=8"]) as ctx:
        assert isinstance(ctx, RunContext)
        assert ctx.run == "good" and ctx.run_dir == runs / "good"
        assert ctx.recipe.grpo.lr == 1e-3
        assert (runs / "good" / "lock").read_text() == str(os.getpid())
    rundb = RunDB.open(runs)
    try:
        stored = rundb.run_recipe("good")
        record = rundb.get_run("good")
    finally:
        rundb.close()
    assert stored.grpo.lr == 1e-3 and stored.rollout.group_size == 8
    assert stored.grpo.iterations == 2 and stored.run.seed == 3  # file values kept
    assert record.recipe_path == str(good) and record.seed == 3
    assert record.recipe_sha256 == stored.sha256()


def test_open_run_run_option_names_the_run(tmp_path, good):
    runs = tmp_path / "runs"
    with open_run(good, "other", runs, []) as ctx:
        assert ctx.run == "other" and ctx.recipe.run.name == "other"
    rundb = RunDB.open(runs)
    try:
        assert [r.name for r in rundb.list_runs()] == ["other"]
        assert rundb.run_recipe("other").run.name == "other"
    finally:
        rundb.close()


def _produce_something(ctx: RunContext) -> None:
    """A stage's output in the run's tables: from here on its recipe may change only with --force."""
    ctx.store.log_metrics("grpo", 0, {"train/loss": 1.0})


def test_open_run_changed_recipe_needs_force(tmp_path, good):
    runs = tmp_path / "runs"
    with open_run(good, None, runs, []) as ctx:
        _produce_something(ctx)
    with open_run(good, None, runs, ["grpo.iterations=20"]):  # resume-safe
        pass
    with pytest.raises(UsageError, match="grpo.lr"), open_run(good, None, runs, ["grpo.lr=1e-3"]):
        pytest.fail("entered a run whose recipe changed")
    with open_run(good, None, runs, ["grpo.lr=1e-3"], force=True) as ctx:
        assert ctx.recipe.grpo.lr == 1e-3


def test_open_run_continues_a_recorded_run_from_its_stored_recipe(tmp_path, good):
    runs = tmp_path / "runs"
    with open_run(good, None, runs, ["grpo.lr=1e-3"]) as ctx:
        _produce_something(ctx)
    with open_run(None, "good", runs, ["grpo.iterations=5"]) as ctx:
        assert ctx.recipe.grpo.lr == 1e-3 and ctx.recipe.grpo.iterations == 5
    with pytest.raises(UsageError, match="grpo.lr"), open_run(None, "good", runs, ["grpo.lr=1"]):
        pass


def _fail_a_stage(ctx: RunContext, identity: dict) -> None:
    """Stage sft fails as it starts, storing nothing; the command ends with its error."""

    def work() -> None:
        raise UsageError("row 2 is not a conversation")

    run_stage(ctx.store, "sft", work, identity=identity)


def test_a_run_whose_stages_stored_nothing_takes_the_corrected_recipe(tmp_path, good):
    """A stage that failed before storing anything left a failed run that refused the corrected command:
    "exists with a different recipe" (another data file), or the failed stage's identity (the same
    file, mended). Nothing of it can mix with new work, so it starts over; once it has stored
    something, a changed recipe needs --force again."""
    runs = tmp_path / "runs"
    with pytest.raises(UsageError), open_run(good, None, runs, ["grpo.lr=1e-3"]) as ctx:
        _fail_a_stage(ctx, {"data_sha256": "bad"})
    with open_run(good, None, runs, ["grpo.lr=2e-3"]) as ctx:  # the corrected recipe
        assert ctx.store.stage("sft") is None  # the failed attempt, forgotten
        run_stage(ctx.store, "sft", lambda: {"steps": 1}, identity={"data_sha256": "mended"})
        _produce_something(ctx)
    rundb = RunDB.open(runs)
    try:
        reasons = [version.reason for version in rundb.recipe_history("good")]
        assert reasons == ["created", "recipe changed before the run produced anything: grpo.lr"], reasons
    finally:
        rundb.close()
    with (
        pytest.raises(UsageError, match="exists with a different recipe"),
        open_run(good, None, runs, ["grpo.lr=3e-3"]),
    ):
        pytest.fail("entered a run that has stored work, with another recipe")


def test_a_file_in_the_run_folder_is_output_too(tmp_path, good):
    """A Trainer checkpoint written before any row (SFT's resume point) is work a changed recipe must not
    resume from."""
    runs = tmp_path / "runs"
    with pytest.raises(UsageError), open_run(good, None, runs, []) as ctx:
        (ctx.run_dir / "sft" / "checkpoint-2").mkdir(parents=True)
        (ctx.run_dir / "sft" / "checkpoint-2" / "trainer_state.json").write_text("{}")
        _fail_a_stage(ctx, {"data_sha256": "a"})
    with (
        pytest.raises(UsageError, match="exists with a different recipe"),
        open_run(good, None, runs, ["grpo.lr=1e-3"]),
    ):
        pytest.fail("entered a run that has stored work, with another recipe")


def test_starting_over_is_undone_when_the_correcting_command_fails_before_any_stage(tmp_path, good):
    runs = tmp_path / "runs"
    with pytest.raises(UsageError), open_run(good, None, runs, []) as ctx:
        _fail_a_stage(ctx, {"data_sha256": "a"})
    before = _run_rows(runs, "good")
    with pytest.raises(UsageError, match="no checkpoint 7"), open_run(good, None, runs, ["grpo.lr=1e-3"]):
        raise UsageError("no checkpoint 7")  # as eval -c 7 fails, before its stage starts
    assert _run_rows(runs, "good") == before


def test_open_run_refuses_a_locked_run(tmp_path, good):
    runs = tmp_path / "runs"
    with (
        open_run(good, None, runs, []),
        pytest.raises(RlcliError, match=f"pid {os.getpid()}"),
        open_run(good, None, runs, []),
    ):
        pytest.fail("entered a locked run")


# --- runs list / show ----------------------------------------------------------------------------


def test_runs_list_json_on_an_empty_dir(capsys, rlcli_home):
    code, out, err = cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    assert json.loads(out) == []


def test_runs_list_empty_says_what_to_run(capsys, rlcli_home):
    code, out, err = cli(capsys, "runs", "list")
    assert code == 0 and out == ""
    assert "rlcli run -r" in one_line(err) and str(rlcli_home) in err


def test_runs_list_json_lists_runs(capsys, rlcli_home):
    rundb = RunDB.open(rlcli_home)
    try:
        rundb.start_run("r1", Recipe(), None)
        rundb.log_metrics("r1", "rollout", 0, {"rollout/reward_mean": 0.5, "other/x": 1.0})
    finally:
        rundb.close()
    code, out, _ = cli(capsys, "runs", "list", "--json")
    assert code == 0
    [row] = json.loads(out)
    assert row["name"] == "r1" and row["status"] == "created"
    assert row["metrics"] == {"rollout/reward_mean": 0.5}
    code, out, _ = cli(capsys, "runs", "list")
    assert code == 0 and "r1" in out


def test_runs_dir_option_and_env(capsys, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    rundb = RunDB.open(elsewhere)
    rundb.start_run("far", Recipe(), None)
    rundb.close()
    code, out, _ = cli(capsys, "--runs-dir", elsewhere, "runs", "list", "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["far"]
    monkeypatch.setenv("RLCLI_HOME", str(elsewhere))
    code, out, _ = cli(capsys, "runs", "list", "--json")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["far"]


def test_runs_dir_reaches_stage_commands(capsys, monkeypatch, tmp_path, good):
    import rlcli.engine.pipeline

    monkeypatch.setattr(rlcli.engine.pipeline, "run_all", lambda ctx, on_summary=None: None)
    code, _, err = cli(capsys, "--runs-dir", tmp_path / "elsewhere", "run", "-r", good)
    assert code == 0, err
    assert (tmp_path / "elsewhere" / DB_NAME).exists() and not (tmp_path / "runs").exists()


def test_shared_options_go_before_the_command(capsys, tmp_path):
    code, _, err = cli(capsys, "runs", "list", "--runs-dir", tmp_path)
    assert code == 2 and "--runs-dir goes before the command" in one_line(err)
    code, _, err = cli(capsys, "run", "-r", "x.yaml", "--debug")
    assert code == 2 and "--debug goes before the command" in one_line(err) and "Traceback" not in err
    # Before the command they are options; a value of --runs-dir is not mistaken for the command.
    code, _, err = cli(capsys, "--runs-dir", tmp_path, "--debug", "runs", "list")
    assert code == 0, err


def test_runs_show_unknown_run_without_a_database(capsys, rlcli_home):
    code, out, err = cli(capsys, "runs", "show", "nosuchrun", "--json")
    assert code == 2 and out == ""
    line = one_line(err)
    assert "nosuchrun" in line and "no run database" in line and str(rlcli_home / DB_NAME) in line
    assert not (rlcli_home / DB_NAME).exists()


def test_runs_show_unknown_run_in_a_database(capsys, rlcli_home):
    rundb = RunDB.open(rlcli_home)
    rundb.start_run("known", Recipe(), None)
    rundb.close()
    code, out, err = cli(capsys, "runs", "show", "nosuchrun", "--json")
    assert code == 2 and out == ""
    line = one_line(err)
    assert "'nosuchrun'" in line and "known" in line


def test_runs_show_json_has_stable_keys(capsys, rlcli_home):
    rundb = RunDB.open(rlcli_home)
    try:
        recipe = Recipe()
        rundb.start_run("r1", recipe, None)
        store = RunStore(rundb, "r1")
        run_stage(store, "sft", lambda: {"loss": 0.25})
        with pytest.raises(RuntimeError):
            run_stage(store, "rollout/0", lambda: (_ for _ in ()).throw(RuntimeError("env crashed")))
        rundb.log_metrics("r1", "rollout", 0, {"rollout/reward_mean": 0.1})
        rundb.log_metrics("r1", "rollout", 1, {"rollout/reward_mean": 0.3})
        add_checkpoint(store, "sft", 0, rlcli_home / "r1" / "sft", "lora")
    finally:
        rundb.close()
    code, out, err = cli(capsys, "runs", "show", "r1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {"name", "status", "recipe_sha256", "stages"} <= data.keys()
    assert data["name"] == "r1" and data["status"] == "created" and data["recipe_sha256"] == recipe.sha256()
    assert [s["name"] for s in data["stages"]] == ["sft", "rollout/0"]
    for stage in data["stages"]:
        assert {"name", "status", "started_at", "finished_at", "error"} <= stage.keys()
    sft, rollout = data["stages"]
    assert (sft["status"], sft["error"], sft["result"]) == ("done", None, {"loss": 0.25})
    assert (rollout["status"], rollout["error"]) == ("failed", "env crashed")
    assert sft["started_at"] and sft["finished_at"]
    assert data["reward_curve"] == [0.1, 0.3]
    assert data["latest_metrics"] == {"rollout/reward_mean": 0.3}
    assert [c["path"] for c in data["checkpoints"]] == [str(rlcli_home.absolute() / "r1" / "sft")]
    assert data["episodes"] == {"total": 0, "failed": 0, "replayed_lost": 0}
    # The table view renders the same run.
    code, out, _ = cli(capsys, "runs", "show", "r1")
    assert code == 0 and "r1" in out and "rollout/0" in out


def test_non_sqlite_database_is_refused_untouched(capsys, rlcli_home):
    rlcli_home.mkdir(parents=True)
    path = rlcli_home / DB_NAME
    path.write_text("these are my notes, not a database\n")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    for argv in (["runs", "list"], ["runs", "list", "--json"], ["runs", "show", "x", "--json"]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == ""
        line = one_line(err)
        assert str(path) in line and "not an SQLite database" in line
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert os.listdir(rlcli_home) == [DB_NAME]


# --- errors and --debug ---------------------------------------------------------------------------


def test_debug_lets_the_exception_propagate(capsys):
    with pytest.raises(UsageError, match="nosuchrun"):
        main(["--debug", "runs", "show", "nosuchrun"])


def test_debug_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("RLCLI_DEBUG", "1")
    with pytest.raises(UsageError, match="nosuchrun"):
        main(["runs", "show", "nosuchrun"])


def test_without_debug_no_traceback(capsys):
    code, _, err = cli(capsys, "runs", "show", "nosuchrun")
    assert code == 2
    assert "Traceback" not in err and err.startswith("Error:")


def test_debug_traceback_in_a_real_process(tmp_path):
    env = {**os.environ, "RLCLI_HOME": str(tmp_path / "home")}
    plain = subprocess.run(
        [str(RLCLI), "runs", "show", "ghost"], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "ghost" in plain.stderr
    debug = subprocess.run(
        [str(RLCLI), "--debug", "runs", "show", "ghost"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "UsageError" in debug.stderr


def test_unexpected_error_is_one_line_without_debug(capsys, monkeypatch, good, smollm2_cache):
    capsys.readouterr()  # the recipe's model is pulled (smollm2_cache) before, not in the stderr read below
    import rlcli.engine.pipeline

    def boom(ctx, on_summary=None):
        ctx.stage("sft", lambda: {})  # some work done, so the run is kept, marked failed
        raise RuntimeError("kaboom")

    monkeypatch.setattr(rlcli.engine.pipeline, "run_all", boom)
    code, _, err = cli(capsys, "run", "-r", good)
    assert code == 1
    summary, error = err.splitlines()  # the start-up summary as the work began, then the error
    assert summary.startswith("rlcli run · run good:")
    line = one_line(error)
    assert "RuntimeError" in line and "kaboom" in line and "--debug" in line
    with pytest.raises(RuntimeError, match="kaboom"):
        main(["--debug", "run", "-r", str(good)])
    rundb = RunDB.open()
    try:
        assert rundb.get_run("good").status == "failed"
    finally:
        rundb.close()
    # `runs show` says why it failed.
    code, out, _ = cli(capsys, "runs", "show", "good", "--json")
    assert code == 0 and json.loads(out)["error"] == "RuntimeError: kaboom"
    code, out, _ = cli(capsys, "runs", "show", "good")
    assert code == 0 and "RuntimeError: kaboom" in out


# --- a command that fails before doing work leaves the database as it was -------------------------


def _run_rows(runs: Path, run: str) -> dict[str, list[tuple]]:
    import sqlite3

    with sqlite3.connect(runs / DB_NAME) as conn:
        return {
            table: conn.execute(f"select * from {table} where {key} = ? order by 1", [run]).fetchall()
            for table, key in (("runs", "name"), ("run_recipes", "run"), ("stages", "run"))
        }


def test_commands_refused_before_work_leave_the_run_as_it_was(capsys, monkeypatch, tmp_path, rlcli_home):
    from helpers import write_recipe
    from rlcli.engine import trackers

    monkeypatch.setitem(trackers.PACKAGES, "wandb", MISSING_PACKAGE)
    recipe = write_recipe(tmp_path / "t.yaml")
    with open_run(recipe, None, rlcli_home, []) as ctx:
        ctx.stage("sft", lambda: {})
        ctx.rundb.set_run_status("t", "done")
    before = _run_rows(rlcli_home, "t")
    refused = [
        (["rollout", "--policy", "lastest"], "'lastest'"),
        (["label", "--force", "rewards=[{fn: exact_mach}]"], "did you mean exact_match?"),
        (["train", "grpo", "run.trackers=[wandb]"], f"pip install {MISSING_PACKAGE}"),
        (["rollout", "env.name=no_such_env"], "no_such_env"),
    ]
    for args, says in refused:
        code, _, err = cli(capsys, *args, "-r", recipe)
        assert code == 2 and says in one_line(err), (args, err)
        assert _run_rows(rlcli_home, "t") == before, args
    # Nothing was marked failed or changed: the same recipe continues the run, unforced.
    with open_run(recipe, None, rlcli_home, []):
        pass


def test_a_new_run_refused_before_work_is_not_created(capsys, tmp_path, rlcli_home):
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    RunDB.open(rlcli_home).close()
    code, _, err = cli(capsys, "rollout", "-r", recipe, "--policy", "sft")
    assert code == 2 and "no SFT checkpoint" in one_line(err)
    assert _run_rows(rlcli_home, "t") == {"runs": [], "run_recipes": [], "stages": []}


def test_a_new_run_refused_before_work_leaves_no_folder_behind(capsys, tmp_path, rlcli_home):
    # The run's lock made runs/<run>/ with a lock file in it, and a refused new run left both.
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    RunDB.open(rlcli_home).close()
    before = sorted(p.name for p in rlcli_home.iterdir())
    for args, says in [
        (["rollout", "--policy", "sft"], "no SFT checkpoint"),
        (["rollout", "--policy", "lastest"], "'lastest'"),
    ]:
        code, _, err = cli(capsys, *args, "-r", recipe)
        assert code == 2 and says in one_line(err), (args, err)
        assert sorted(p.name for p in rlcli_home.iterdir()) == before, args
    # The run can still be made, and its lock still keeps a second process out.
    with open_run(recipe, None, rlcli_home, []):
        assert (rlcli_home / "t" / "lock").is_file()
        with pytest.raises(RlcliError, match="in use by another rlcli process"), open_run(recipe, None, rlcli_home, []):
            pass
    # An existing run's folder stays whatever a command does to it.
    code, _, _ = cli(capsys, "rollout", "--policy", "sft", "-r", recipe)
    assert code == 2 and (rlcli_home / "t" / "lock").is_file()


def test_a_lock_taken_on_a_removed_lock_file_is_taken_again(tmp_path, monkeypatch):
    # A refused new run removes its folder while it holds the lock; a process that opened the lock
    # file just before must not hold a lock on a file no longer there, beside a third on the new one.
    from rlcli.store import stages

    locked = stages._flock
    calls = []

    def flock_then_removed(fh, operation):
        locked(fh, operation)
        calls.append(fh.name)
        if len(calls) == 1:  # the holder removed the file between our open and our lock
            Path(fh.name).unlink()

    monkeypatch.setattr(stages, "_flock", flock_then_removed)
    with stages.RunLock(tmp_path, "r") as lock:
        assert len(calls) == 2 and lock.path.is_file()
        assert os.path.samestat(os.fstat(lock._fh.fileno()), os.stat(lock.path))
        assert stages.RunLock.held(tmp_path, "r")


@pytest.mark.parametrize("stage", ["dpo", "sft", "grpo"])
def test_a_rollout_stage_may_not_take_a_name_rlcli_owns(capsys, tmp_path, rlcli_home, stage):
    # `rollout --stage dpo` then `train dpo` failed on the rollout's summary as if it were DPO's.
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    code, _, err = cli(capsys, "rollout", "-r", recipe, "--stage", stage)
    assert code == 2 and f"--stage {stage!r} is not allowed" in one_line(err)
    assert _run_rows(rlcli_home, "t")["stages"] == []


def test_vllm_on_a_model_its_cpu_build_cannot_serve_is_refused_before_work(capsys, tmp_path, rlcli_home):
    # tiny-random's head size is 16, which vLLM's CPU attention does not take: this was
    # "unexpected RuntimeError: Unsupported CPU attention configuration" after the engine started.
    pytest.importorskip("vllm")
    from helpers import write_recipe
    from rlcli.models.cache import pull_model

    pull_model("tiny-random")
    recipe = write_recipe(tmp_path / "t.yaml", model={"name": "tiny-random", "device": "cpu"})
    capsys.readouterr()
    code, _, err = cli(capsys, "rollout", "-r", recipe, "rollout.engine=vllm")
    line = one_line(err)
    assert code == 2 and "head size 16" in line and "rollout.engine: hf" in line
    assert not (rlcli_home / DB_NAME).exists()


def test_runs_delete_removes_rows_and_folder_after_confirmation(capsys, tmp_path, rlcli_home, monkeypatch):
    import io
    import sqlite3

    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    for run in ("t", "keep"):
        with open_run(recipe, run, rlcli_home, []) as ctx:
            ctx.stage("sft", lambda: {})
            ctx.rundb.log_metrics(run, "sft", 0, {"sft/loss": 1.0})
            add_checkpoint(ctx.store, "sft", 0, ctx.run_dir / "sft", "lora")
            (ctx.run_dir / "sft").mkdir()
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, _, err = cli(capsys, "runs", "delete", "t")
    assert code == 1 and (rlcli_home / "t").exists() and _run_rows(rlcli_home, "t")["runs"]
    code, out, err = cli(capsys, "runs", "delete", "t", "--yes")
    assert code == 0, err
    assert not (rlcli_home / "t").exists() and (rlcli_home / "keep" / "sft").exists()
    with sqlite3.connect(rlcli_home / DB_NAME) as conn:
        tables = [r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")]
        for table in tables:
            columns = [c[1] for c in conn.execute(f"pragma table_info({table})")]
            if "run" in columns:
                assert conn.execute(f"select count(*) from {table} where run = 't'").fetchone()[0] == 0, table
        assert conn.execute("select count(*) from checkpoints where run = 'keep'").fetchone()[0] == 1
    code, _, err = cli(capsys, "runs", "delete", "t", "--yes")
    assert code == 2 and "'t'" in one_line(err)


def test_runs_delete_refuses_a_run_in_use(capsys, tmp_path, rlcli_home):
    from helpers import write_recipe

    recipe = write_recipe(tmp_path / "t.yaml")
    with open_run(recipe, None, rlcli_home, []):
        code, _, err = cli(capsys, "runs", "delete", "t", "--yes")
        assert code == 1 and "in use" in one_line(err)
    assert _run_rows(rlcli_home, "t")["runs"]


def test_lock_held_elsewhere_exits_1_naming_the_pid(capsys, rlcli_home, good):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\nfrom rlcli.store.stages import RunLock\n"
                "with RunLock(sys.argv[1], 'good'):\n    print('locked', flush=True)\n    time.sleep(60)\n"
            ),
            str(rlcli_home),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = cli(capsys, "rollout", "-r", good)
        assert code == 1
        assert f"pid {holder.pid}" in one_line(err)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()


def test_interrupt_prints_the_resume_hint(capsys, monkeypatch, good):
    import rlcli.engine.pipeline

    def interrupted(ctx, on_summary=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlcli.engine.pipeline, "run_all", interrupted)
    code, _, err = cli(capsys, "run", "-r", good)
    assert code == 130
    assert "Interrupted" in err and "resume" in err


# A process that works on run r1: its status says running while it holds the run's lock.
RUN_HOLDER = textwrap.dedent(
    """
    import sys, time
    from rlcli.recipe import Recipe
    from rlcli.store.db import RunDB
    from rlcli.store.stages import RunLock

    rundb = RunDB.open(sys.argv[1])
    with RunLock(sys.argv[1], "r1"):
        rundb.start_run("r1", Recipe(), None)
        rundb.set_run_status("r1", "running")
        rundb.mark_stage("r1", "rollout", "running")
        print("running", flush=True)
        time.sleep(120)
    """
)


def _status(capsys, *command: str) -> str:
    code, out, err = cli(capsys, "runs", *command, "--json")
    assert code == 0, err
    data = json.loads(out)
    return (data[0] if isinstance(data, list) else data)["status"]


def test_a_killed_run_is_listed_as_stopped(capsys, rlcli_home):
    proc = subprocess.Popen([sys.executable, "-c", RUN_HOLDER, str(rlcli_home)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        assert _status(capsys, "list") == "running"
        assert _status(capsys, "show", "r1") == "running"
    finally:
        proc.kill()  # SIGKILL: the status row still says running
        proc.wait(timeout=10)
        proc.stdout.close()
    assert _status(capsys, "list") == "stopped"
    assert _status(capsys, "show", "r1") == "stopped"
    code, out, _ = cli(capsys, "runs", "show", "r1", "--json")
    assert [s["status"] for s in json.loads(out)["stages"]] == ["stopped"]  # the stage it was killed in
    code, out, _ = cli(capsys, "runs", "list")
    assert code == 0 and "stopped" in out


def test_a_changed_reward_file_is_warned_about_and_the_history_shown(capsys, tmp_path, rlcli_home):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    first_hash = hashlib.sha256(rewards.read_bytes()).hexdigest()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run:\n  name: prov\nrewards:\n  - fn: my_rewards.py:score\n")
    with open_run(recipe, None, rlcli_home, []):
        pass
    assert capsys.readouterr().err == ""
    rewards.write_text("def score(completions, **kw):\n    return [0.0 for _ in completions]\n")
    with open_run(recipe, None, rlcli_home, []):
        pass
    warning = capsys.readouterr().err
    assert len(warning.strip().splitlines()) == 1 and "my_rewards.py" in warning and "changed" in warning
    code, out, _ = cli(capsys, "runs", "show", "prov", "--json")
    history = json.loads(out)["recipe_history"]
    assert [h["reason"] for h in history] == ["created", "code changed: my_rewards.py"]
    assert history[0]["code"] == {"my_rewards.py": first_hash}
    assert history[1]["code"] == {"my_rewards.py": hashlib.sha256(rewards.read_bytes()).hexdigest()}
    code, out, _ = cli(capsys, "runs", "show", "prov")
    assert code == 0 and "recipe history: 1 change(s); last: code changed:" in out and "my_rewards.py" in out
