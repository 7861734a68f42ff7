"""The repair_tests env: generated projects whose planted bug every test catches, the expert's repairs, the
file and test tools and their errors, the reward as the share of passing tests, users' task folders, the
test runner's report, and the recipe's shape on the tiny model."""

from __future__ import annotations

import json
import random
import sys
import types
import unittest
from collections import Counter
from pathlib import Path

import pytest
from rlcli.builtin_envs.repair_tests import THEMES, generate, mutations

from helpers import REPO, make_ctx
from rlcli.engine.preflight import check_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.envs import coding, sandbox
from rlcli.envs.coding import RepairTests, folder_tasks, run_tests
from rlcli.envs.loading import load_env
from rlcli.envs.protocol import task_seed
from rlcli.envs.sandbox import Limits, bwrap_problem
from rlcli.envs.tool_use import ToolUse, tool_use_spec
from rlcli.errors import UsageError
from rlcli.recipe import EnvSection, Recipe

RECIPE = REPO / "recipes" / "repair_tests.yaml"


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tool_result(env, action: str) -> dict:
    """The one tool message that rlcli's tool box answers `action` (a call) with."""
    observation, reward, terminated, _, _ = env.step(action)
    assert reward == 0.0 and not terminated
    [message] = observation
    return message


def in_process(files: dict[str, str]) -> tuple[int, int]:
    """(tests passed, tests run) of a generated project, run here with unittest (the generator's own code)."""
    modules = {path.removesuffix(".py"): types.ModuleType(path.removesuffix(".py")) for path in files}
    saved = {name: sys.modules.get(name) for name in modules}
    try:
        sys.modules.update(modules)
        for path in sorted(files, key=lambda p: p.startswith("test_")):  # the code before its tests
            exec(compile(files[path], path, "exec"), modules[path.removesuffix(".py")].__dict__)
        suite = unittest.TestSuite(
            unittest.defaultTestLoader.loadTestsFromModule(m) for n, m in modules.items() if n.startswith("test_")
        )
        result = unittest.TestResult()
        suite.run(result)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return result.testsRun - len(result.failures) - len(result.errors), result.testsRun


def fixed(task) -> dict[str, str]:
    files = dict(task.files)
    for edit in task.fix:
        assert files[edit.path].count(edit.old) == 1, edit
        files[edit.path] = files[edit.path].replace(edit.old, edit.new)
    return files


@pytest.mark.parametrize("modules", [1, 2])
def test_every_test_of_every_generated_project_fails_and_its_fix_makes_them_all_pass(modules):
    """Over a thousand seeds, train and held-out: the bug breaks every test (editing nothing earns
    nothing), the planted fix makes every test pass, and each mutation family occurs."""
    kinds = Counter()
    seeds = [*range(500), *(task_seed("eval", i) for i in range(500))]
    for seed in seeds:
        task = generate(seed, modules=modules)
        passed, run = in_process(dict(task.files))
        assert passed == 0 and 2 <= run <= 3, (seed, task.bug)
        assert in_process(fixed(task)) == (run, run), (seed, task.bug)
        assert 1 <= sum(not path.startswith("test_") for path in task.files) <= modules
        kinds[task.bug.split(" in ")[0]] += 1
    assert set(kinds) >= {"wrong operator", "off by one", "wrong constant", "swapped operands", "swapped arguments"}
    assert min(kinds.values()) >= 5, kinds


def test_held_out_projects_are_not_training_projects():
    train = {json.dumps(generate(seed).files, sort_keys=True) for seed in range(2000)}
    held_out = [json.dumps(generate(task_seed("eval", i)).files, sort_keys=True) for i in range(300)]
    assert len(train) == 2000 and not train.intersection(held_out)


def test_the_mutations_of_a_line():
    source = "def f(a, b):\n    '''Doc: a + b.'''\n    return max(a - 1, b) < 3 and a\n"
    found = {(m.kind, m.text.strip()) for m in mutations(source)}
    assert ("wrong operator", "return max(a + 1, b) < 3 and a") in found
    assert ("off by one", "return max(a, b) < 3 and a") in found  # the - 1 left out
    assert ("swapped arguments", "return max(b, a - 1) < 3 and a") in found
    assert ("swapped operands", "return 3 < max(a - 1, b) and a") in found
    assert ("min for max", "return min(a - 1, b) < 3 and a") in found
    assert ("or for and", "return max(a - 1, b) < 3 or a") in found
    assert ("wrong constant", "return max(a - 1, b) < 4 and a") in found
    assert all("Doc" not in m.text for m in mutations(source))  # docstrings are left alone


def test_the_expert_repairs_generated_projects_through_the_tools():
    """Played as rlcli plays it (the tool calls answered by the tool box): it reads the buggy file, replaces
    the buggy text, sees every test pass, and finishes with reward 1."""
    factory = load_env("repair_tests", {"modules": 2})
    for seed in [*range(12), *(task_seed("eval", i) for i in range(12))]:
        env = factory()
        observation, info = env.reset(seed)
        task = info["task"]
        tests = sum(text.count("def test_") for path, text in task["files"].items() if path.startswith("test_"))
        assert observation[1]["content"].endswith(f"\n0 of {tests} tests pass."), observation
        [edit] = task["fix"]
        read = tool_result(env, env.expert_action())
        assert read["content"] == task["files"][edit["path"]] and read["call"]["error"] is None
        assert tool_result(env, env.expert_action())["content"] == f"Replaced the text in {edit['path']}."
        assert tool_result(env, env.expert_action())["content"].startswith("All ")
        feedback, reward, terminated, truncated, step_info = env.step(env.expert_action())
        assert (reward, terminated, truncated, step_info["success"]) == (1.0, True, False, True), (seed, feedback)


def test_bad_tool_calls_get_one_clear_error_each_and_change_nothing():
    env = load_env("repair_tests", {})()
    _, info = env.reset(3)
    [edit] = info["task"]["fix"]
    path, tests = edit["path"], next(p for p in info["task"]["files"] if p.startswith("test_"))
    cases = {
        call("read_file", path="missing.py"): "there is no file 'missing.py'; the files are ",
        call("str_replace", path=tests, old="self", new="x"): f"{tests} is a test file, which cannot be edited",
        call("str_replace", path=path, old="", new="x"): "old is empty",
        call("str_replace", path=path, old="def ", new="x"): "occurs ",
        call("str_replace", path=path, old="nowhere in it", new="x"): "'nowhere in it' does not occur in ",
        call("str_replace", path=path, old=edit["old"], new=edit["old"]): "old and new are the same text",
        call("str_replace", path=path): "Bad arguments for str_replace",
        call("delete_file", path=path): "Unknown tool 'delete_file': the tools are read_file, str_replace, run_tests",
    }
    for action, expected in cases.items():
        message = tool_result(env, action)
        assert expected in message["content"] and message["call"]["error"], (action, message)
        assert "\n" not in message["call"]["error"]
    assert tool_result(env, call("read_file", path=f"./{path}"))["content"] == info["task"]["files"][path]
    feedback, reward, terminated, _, step_info = env.step("I am done.")
    assert (reward, terminated, step_info["success"]) == (0.0, True, False) and feedback.startswith("0 of ")


def write_task(folder: Path, files: dict[str, str], instruction: str = "Make the tests pass.", fix=None) -> Path:
    folder.mkdir(parents=True)
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    if instruction is not None:
        (folder / "INSTRUCTION.md").write_text(instruction)
    if fix is not None:
        (folder / "fix.json").write_text(json.dumps(fix))
    return folder


# A project with four tests: two catch the bug in double(), two in half(); plain test functions and a TestCase.
CALC = {
    "calc/ops.py": "def double(x):\n    return x + 1\n\n\ndef half(x):\n    return x // 3\n",
    "calc/__init__.py": "",
    "test_calc.py": (
        "import unittest\nfrom calc.ops import double, half\n\n\ndef test_double():\n    assert double(3) == 6\n\n\n"
        "def test_double_zero():\n    assert double(0) == 0\n\n\nclass TestHalf(unittest.TestCase):\n"
        "    def test_half(self):\n        self.assertEqual(half(8), 4)\n\n    def test_half_odd(self):\n"
        "        self.assertEqual(half(9), 4)\n"
    ),
}
FIX = [
    {"path": "calc/ops.py", "old": "x + 1", "new": "x * 2"},
    {"path": "calc/ops.py", "old": "x // 3", "new": "x // 2"},
]


def test_the_reward_is_the_share_of_tests_that_pass(tmp_path, monkeypatch):
    write_task(tmp_path / "tasks" / "train" / "calc", CALC, fix=FIX)
    write_task(tmp_path / "tasks" / "eval" / "calc", CALC)
    factory = load_env("repair_tests", {"tasks_dir": str(tmp_path / "tasks")})
    env = factory()
    observation, _ = env.reset(0)
    prompt = observation[1]["content"]
    assert prompt.startswith("Make the tests pass.\n\nFiles: calc/__init__.py, calc/ops.py, test_calc.py\n")
    assert "    assert double(0) == 0\nAssertionError\n" in prompt and prompt.endswith("\n0 of 4 tests pass.")
    assert env.step("Nothing to do.")[1:4] == (0.0, True, False)
    for edits, reward in [([FIX[0]], 0.5), (FIX, 1.0), ([{**FIX[0], "new": "x * 2 +"}], 0.0)]:
        env = factory()
        env.reset(0)
        for edit in edits:
            tool_result(env, call("str_replace", **edit))
        feedback, got, terminated, _, info = env.step("Done.")
        assert (got, terminated, info["success"]) == (reward, True, reward == 1.0), feedback
        assert info["tests_passed"] == 4 * reward
    monkeypatch.setattr(coding, "LIMITS", Limits(time_s=1.0))  # a loop the model wrote: stopped, passing nothing
    env = factory()
    env.reset(0)
    tool_result(env, call("str_replace", path="calc/ops.py", old="return x + 1", new="while True:\n        pass"))
    assert tool_result(env, call("run_tests"))["content"].endswith("[timed out after 1 s]")
    assert env.step("Done.")[1] == 0.0


def test_users_task_folders_split_train_and_held_out_tasks(tmp_path):
    for split, names in (("train", ["a", "b", "c"]), ("eval", ["x", "y"])):
        for name in names:
            write_task(tmp_path / split / name, {**CALC, "NOTES.txt": name}, instruction=f"Task {name}.", fix=FIX)
    task_for = folder_tasks(tmp_path)
    assert [task_for(seed).name for seed in range(5)] == ["a", "b", "c", "a", "b"]
    assert [task_for(task_seed("eval", i)).name for i in range(3)] == ["x", "y", "x"]
    task = task_for(0)
    assert task.instruction == "Task a." and "INSTRUCTION.md" not in task.files and "fix.json" not in task.files
    env = load_env("repair_tests", {"tasks_dir": str(tmp_path)})()
    env.reset(1)
    assert [tool_result(env, env.expert_action())["call"]["error"] for _ in range(4)] == [None] * 4
    assert env.step(env.expert_action())[1] == 1.0


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda root: None, "has no task folder under train/"),
        (lambda root: write_task(root / "train" / "t", CALC, instruction=None), "has no INSTRUCTION.md"),
        (lambda root: write_task(root / "train" / "t", {"a.py": "x = 1\n"}), "has no test file (test_*.py)"),
        (lambda root: write_task(root / "train" / "t", CALC, fix=[{"path": "calc/ops.py"}]), "is not a JSON list of"),
        (
            lambda root: write_task(root / "train" / "t", CALC, fix=[{**FIX[0], "old": "x"}]),
            "does not occur exactly once",
        ),
    ],
)
def test_a_bad_task_folder_is_refused_in_one_sentence(tmp_path, make, expected):
    (tmp_path / "tasks").mkdir()
    make(tmp_path / "tasks")
    with pytest.raises(UsageError, match="refused env.kwargs") as refused:
        load_env("repair_tests", {"tasks_dir": str(tmp_path / "tasks")})()
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"code_sandbox": "docker"}, "code_sandbox must be none, bwrap or auto, got 'docker'"),
        ({"themes": ["stats", "poetry"]}, "themes must be a list of some of stats, text, prices"),
        ({"themes": []}, "themes must be a list of some of"),
        ({"functions": 1}, "functions and tests at least 2"),
        ({"tests": 1}, "functions and tests at least 2"),
    ],
)
def test_bad_kwargs_are_refused_in_one_sentence(kwargs, expected):
    with pytest.raises(UsageError, match="refused env.kwargs") as refused:
        load_env("repair_tests", kwargs)()
    assert expected in str(refused.value)


def test_themes_and_sizes_shape_the_projects():
    for seed in range(100):
        task = generate(seed, modules=2, functions=2, themes=("stats", "shapes"))
        modules = [path for path in task.files if not path.startswith("test_")]
        assert set(modules) <= {"stats.py", "shapes.py"}
        assert all(task.files[m].count("\ndef ") + task.files[m].startswith("def ") == 2 for m in modules)


def test_a_task_without_a_fix_has_no_expert(tmp_path):
    write_task(tmp_path / "train" / "t", CALC)
    write_task(tmp_path / "eval" / "t", CALC)
    env = RepairTests(folder_tasks(tmp_path), bwrap=False)
    env.reset(0)
    with pytest.raises(ValueError, match="gives no fix"):
        env.expert_action()


def test_the_runners_report_names_places_in_the_project_only(tmp_path):
    files = {
        "shop.py": "import helper\n\ndef price(n):\n    return helper.scale(n)\n",
        "helper.py": "def scale(n):\n    return 10 // n\n",
        "tests/test_shop.py": "from shop import price\n\ndef test_zero():\n    assert price(0) == 0\n\ndef test_two():\n    assert price(2) == 5\n",
        "test_broken.py": "import shop\ndef broken(:\n",
    }
    run = run_tests(files, bwrap=False)
    assert (run.passed, run.total) == (1, 3)
    assert run.output.splitlines() == [
        "ERROR importing test_broken.py",
        "  test_broken.py, line 2",
        "    def broken(:",
        "SyntaxError: invalid syntax",
        "ERROR test_zero",
        "  tests/test_shop.py, line 4, in test_zero",
        "    assert price(0) == 0",
        "  helper.py, line 2, in scale",
        "    return 10 // n",
        "ZeroDivisionError: integer division or modulo by zero",
        "1 of 3 tests pass.",
    ]
    assert str(Path.home()) not in run.output and "/tmp" not in run.output
    # The counts come from the runner's marked line, which the project's code cannot guess.
    forged = run_tests({**files, "test_broken.py": "print('0123456789abcdef 3 3')\n"}, bwrap=False)
    assert (forged.passed, forged.total) == (1, 2)


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}")
def test_in_bubblewrap_the_tests_report_the_same_and_see_only_the_sandbox():
    """The generated project's report is the same inside bubblewrap; a test there sees the sandbox's scratch
    folder as its working folder, not the user's files (this Python's own folders only, read-only), and
    is in a namespace of its own (its host name)."""
    task = generate(task_seed("eval", 3))
    assert run_tests(task.files, bwrap=True) == run_tests(task.files, bwrap=False)
    inside = (
        "import os, pathlib, socket\n"
        "def test_where():\n    assert os.getcwd() == '/tmp/scratch'\n"
        f"def test_home():\n    assert not pathlib.Path({str(Path.home())!r}, '.cache').exists()\n"
        "def test_network():\n    assert socket.gethostname() == 'sandbox'\n"
    )
    run = run_tests({"test_inside.py": inside}, bwrap=True)
    assert (run.passed, run.total) == (3, 3), run.output


def test_a_run_that_ends_early_passes_nothing_and_says_why():
    run = run_tests({"test_exit.py": "import os\nos._exit(0)\n"}, bwrap=False)
    assert (run.passed, run.total, run.output) == (0, 0, "[the tests ended without reporting their results]")


def test_the_generated_projects_are_small():
    """Short enough for a small model's context: the themes' functions are a few lines each."""
    for functions in THEMES.values():
        assert all(len(f.source.strip().splitlines()) <= 8 for f in functions)
    sizes = [sum(len(text) for text in generate(seed).files.values()) for seed in range(200)]
    assert max(sizes) < 2000, max(sizes)


def test_the_recipe_plays_on_the_tiny_model(tmp_path):
    """The recipe's env, horizon and token cap, the tiny random model in place of SmolLM2: its rollouts are
    stored, and the expert's demos (SFT's data) end solved within model.max_length, their tool results
    stored as tool messages."""
    small = ["model.name=tiny-random", "rollout.tasks=2", "rollout.group_size=2", "rollout.max_new_tokens=16"]
    ctx = make_ctx(RECIPE, tmp_path / "runs", [*small, "rollout.engine=hf"])
    assert run_rollout_stage(ctx, stage="rollout", policy="base", split="train").episodes == 4
    expert = run_rollout_stage(ctx, stage="demos", policy="expert", split="train")
    assert expert.episodes == 4
    rows = list(ctx.rundb.db.query("select * from episodes where run = ? and stage = 'demos'", [ctx.run]))
    assert all(row["status"] == "ok" and row["env_return"] == 1.0 for row in rows), rows
    assert all(row["end_reason"] == "terminated" and row["num_turns"] == 4 for row in rows)
    tools = [m.get("name") for row in rows for m in json.loads(row["messages"]) if m["role"] == "tool"]
    assert tools == ["read_file", "str_replace", "run_tests"] * 4


def test_a_seed_draws_its_project_from_the_seed_alone():
    rng = random.Random(0)
    seeds = [rng.randrange(10**6) for _ in range(20)]
    assert [generate(seed) for seed in seeds] == [generate(seed) for seed in reversed(seeds)][::-1]


@pytest.mark.parametrize("setting", ["none", "bwrap"])
def test_env_code_sandbox_reaches_the_coding_env(setting):
    """The recipe's env.code_sandbox decides where repair_tests runs its tests, as it does python_exec's code
    (it used to be the env's own kwarg, auto whatever the recipe said)."""
    if setting == "bwrap" and (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    section = EnvSection(name="repair_tests", code_sandbox=setting)
    made = load_env("repair_tests", {}, tools=tool_use_spec(section, REPO))()
    env = made.env if isinstance(made, ToolUse) else made
    assert env.bwrap is (setting == "bwrap")


def test_an_env_that_takes_code_sandbox_gets_the_recipes_answer(tmp_path):
    """A user's env with a code_sandbox parameter gets bwrap or none; env.kwargs.code_sandbox wins; an env
    without the parameter gets nothing."""
    (tmp_path / "asks.py").write_text(
        "class Env:\n"
        "    def __init__(self, code_sandbox='unset'):\n"
        "        self.code_sandbox = code_sandbox\n"
        "    def reset(self, seed):\n"
        "        return [], {}\n"
        "    def step(self, action):\n"
        "        return '', 0.0, True, False, {}\n"
        "def make_env(code_sandbox='unset'):\n"
        "    return Env(code_sandbox)\n"
        "def plain():\n"
        "    return Env()\n"
    )
    name = str(tmp_path / "asks.py")
    tools = tool_use_spec(EnvSection(name=name, code_sandbox="none"), tmp_path)
    assert load_env(name, {}, tmp_path, tools)().code_sandbox == "none"
    assert load_env(name, {"code_sandbox": "auto"}, tmp_path, tools)().code_sandbox == "auto"
    assert load_env(name, {}, tmp_path)().code_sandbox == "unset"  # no recipe: the env's own default
    assert load_env(f"{name}:plain", {}, tmp_path, tools)().code_sandbox == "unset"


def test_env_code_sandbox_bwrap_where_it_cannot_run_is_refused_before_any_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no bwrap on it
    monkeypatch.setattr(sandbox, "_said", set())
    bwrap_problem.cache_clear()
    try:
        recipe = Recipe.model_validate(
            {"model": {"name": "tiny-random"}, "env": {"name": "repair_tests", "code_sandbox": "bwrap"}}
        )
        with pytest.raises(UsageError, match="env.code_sandbox is bwrap, but"):
            check_recipe(recipe, ["rollout"])
    finally:
        bwrap_problem.cache_clear()
