"""Coding envs: repair a small Python project until its tests pass, with tools to read and edit its files
and run its tests.

A task (`CodingTask`) is a project, its files as text, with an instruction and, when known, the fix (a
list of `Edit`s) that its expert applies. `RepairTests` plays one task per episode:

- reset(seed): the task's instruction, its files' names and the output of its tests (which fail).
- tools, run by rlcli when the policy calls them (docs/tools.md): `read_file(path)`, `str_replace(path,
  old, new)` (the editors' tool: `old` must occur exactly once in the file, else a clear error) and
  `run_tests()`. Test files (`test_*.py`) cannot be edited, so the tests that grade are the task's own.
- step(reply): a reply that calls no tool ends the episode: the tests run once more and the reward is the
  share of them that pass; success is all of them passing. An episode cut off at env.max_turns earns
  nothing.
- expert_action(): reads each file the fix edits, applies the fix's edits, runs the tests, then finishes.

The project lives in memory: each test run writes the files into a fresh scratch folder, runs the tests
there and removes the folder, so that nothing a run writes survives it, an episode that rlcli cuts off
leaves no folder behind, and replaying the same actions gives the same observations. All runs go through
`run_tests`, as python_exec's code does (envs/sandbox.py's run_sandboxed): in bubblewrap when the env is
made with bwrap (no network, no home folder, the system read-only), else with the limits alone; either
way with time, memory, process, file-size and output limits, no variable of rlcli's in its
environment, and death with rlcli.

Tasks come from a generator (the built-in `repair_tests`, envs/repair_tests.py) or from folders: see
`folder_tasks` for the layout of users' own tasks.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from rlcli.envs import coding_runner
from rlcli.envs.protocol import task_seed
from rlcli.envs.sandbox import Limits, run_sandboxed
from rlcli.envs.subprocesses import hide_environment
from rlcli.envs.tool_calls import hermes_tool_call

# A test run's limits: python_exec's (10 s: the generated projects' tests take milliseconds, so only a
# loop the model wrote, or a very busy machine, reaches it), but for the output kept, which holds the
# counts' line at its end past a flood of prints.
LIMITS = Limits(output_chars=64_000)
OUTPUT_LIMIT_CHARS = 4000  # of a run's output shown to the model, as env.tool_result_chars' default
# Finished test runs kept by their project's files (see run_tests), the least recently used dropped first.
KEPT_RUNS = 512
_finished: OrderedDict[tuple[bool, tuple[tuple[str, str], ...]], TestRun] = OrderedDict()
_finished_lock = threading.Lock()  # tools run in threads, and episodes side by side with env.workers 0
RUNNER_SOURCE = Path(coding_runner.__file__).read_text()
INSTRUCTION_FILE = "INSTRUCTION.md"
FIX_FILE = "fix.json"
# Held-out tasks of a task folder are played from these seeds on (the default env.eval_seed_start).
EVAL_SEED_START = task_seed("eval", 0)
# Short, as a small model's context is: the tools' specs go to the chat template too, where it shows them.
SYSTEM = (
    "Fix the bug so that the tests pass. Tools: read_file(path); str_replace(path, old, new), where old "
    'occurs once in the file; run_tests(). Call one as <tool_call>{"name": "run_tests", "arguments": {}}'
    "</tool_call>. When the tests pass, reply without a tool call."
)
FINISH = "The tests pass."


@dataclass(frozen=True)
class Edit:
    """One str_replace: in `path`, the text `old` (which occurs once) becomes `new`."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class CodingTask:
    name: str
    instruction: str
    files: Mapping[str, str]  # relative path (with "/") -> text; files named test_*.py hold the tests
    fix: tuple[Edit, ...] = ()  # what the expert applies; empty when the task gives none
    bug: str = ""  # what the planted bug is, when known ("off by one in total"), to read results by kind

    def as_dict(self) -> dict[str, Any]:
        """The task as info["task"] stores it with every episode."""
        fix = [{"path": e.path, "old": e.old, "new": e.new} for e in self.fix]
        return {
            "name": self.name,
            "instruction": self.instruction,
            "files": dict(self.files),
            "fix": fix,
            "bug": self.bug,
        }


@dataclass(frozen=True)
class TestRun:
    """What one run of a project's tests gave."""

    passed: int
    total: int  # the tests found; a test file that cannot be imported counts as one
    output: str  # what the runner printed, and why the run was stopped if it was


def is_test_file(path: str) -> bool:
    return PurePosixPath(path).name.startswith("test_") and path.endswith(".py")


def run_tests(files: Mapping[str, str], bwrap: bool) -> TestRun:
    """Run the tests of a project given as {relative path: text}, in a fresh scratch folder: in bubblewrap
    (bwrap) or with the limits alone (envs/sandbox.py's run_sandboxed).

    The one place a coding env runs code: the runner (coding_runner.py) imports the project's tests and
    the code they test in `python -I`, and ends its output with a line that starts with a mark drawn for
    this run (from the environment, which the runner clears before the project's code runs), giving the
    counts; that line is taken off the output the model sees.

    A project's tests are taken to be deterministic: a run that reported its counts is kept, by the files,
    and the same files give it again without running (the episodes of a GRPO group reset one task, and
    an episode without an edit ends on the files it started with). A run stopped at a limit is not kept:
    on a busy machine it need not happen again.
    """
    key = (bwrap, tuple(sorted(files.items())))
    with _finished_lock:
        if key in _finished:
            _finished.move_to_end(key)
            return _finished[key]
    hide_environment()  # the project's code cannot read this process's API keys through /proc
    mark = secrets.token_hex(8)
    argv = [sys.executable, "-I", "-c", RUNNER_SOURCE]
    outcome = run_sandboxed(argv, files, bwrap=bwrap, limits=LIMITS, env={coding_runner.MARK_VARIABLE: mark})
    lines = outcome.output.rstrip("\n").splitlines()
    counts = [line.split()[1:] for line in lines if line.startswith(mark + " ")]
    shown = "\n".join(line for line in lines if not line.startswith(mark + " "))
    if len(shown) > OUTPUT_LIMIT_CHARS:
        shown = shown[:OUTPUT_LIMIT_CHARS] + f"\n[output cut at {OUTPUT_LIMIT_CHARS} characters]"
    if not counts:  # stopped at a limit, crashed, or the project's code ended the process early
        why = outcome.status or "the tests ended without reporting their results"
        return TestRun(0, 0, f"{shown}\n[{why}]".lstrip("\n"))
    passed, total = (int(n) for n in counts[-1])
    run = TestRun(passed, total, shown)
    with _finished_lock:
        _finished[key] = run
        if len(_finished) > KEPT_RUNS:
            _finished.popitem(last=False)
    return run


@dataclass
class _Episode:
    task: CodingTask
    files: dict[str, str]  # the project as the policy's edits left it
    total: int  # tests found at reset: a run that finds fewer (its code no longer imports) passes fewer
    plan: list[str] = field(default_factory=list)  # the expert's actions, in order
    expert_turns: int = 0


class RepairTests:
    """Plays `task_for(seed)` (see the module docstring)."""

    def __init__(self, task_for: Callable[[int], CodingTask], bwrap: bool) -> None:
        self.task_for, self.bwrap = task_for, bwrap
        self.tools = [self.read_file, self.str_replace, self.run_tests]
        self.episode: _Episode | None = None

    def reset(self, seed: int) -> tuple[list[dict], dict]:
        task = self.task_for(seed)
        first = run_tests(task.files, self.bwrap)
        edited = list(dict.fromkeys(edit.path for edit in task.fix))
        plan = [hermes_tool_call("read_file", {"path": path}) for path in edited]
        plan += [hermes_tool_call("str_replace", {"path": e.path, "old": e.old, "new": e.new}) for e in task.fix]
        plan += [hermes_tool_call("run_tests", {}), FINISH]
        self.episode = _Episode(task, dict(task.files), max(first.total, 1), plan)
        prompt = f"{task.instruction}\n\nFiles: {', '.join(sorted(task.files))}\n\nThe tests:\n{first.output}"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}], {"task": task.as_dict()}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        episode = self._current()
        final = run_tests(episode.files, self.bwrap)
        passed, total = final.passed, max(final.total, episode.total)
        feedback = f"{passed} of {total} tests pass." if passed < total else f"All {total} tests pass."
        return feedback, passed / total, True, False, {"success": passed == total, "tests_passed": passed}

    def expert_action(self) -> str:
        """The plan's next action: read each file the fix edits, apply the edits, run the tests, finish."""
        episode = self._current()
        if not episode.task.fix:
            raise ValueError(f"task {episode.task.name} gives no fix ({FIX_FILE}), so there is no expert for it")
        action = episode.plan[min(episode.expert_turns, len(episode.plan) - 1)]
        episode.expert_turns += 1
        return action

    def read_file(self, path: str) -> str:
        """Show the whole text of a file of the project.

        Args:
            path: The file's path, as the list of files gives it, such as stats.py.
        """
        episode = self._current()
        return episode.files[self._known(episode, path)]

    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace a piece of text in a file of the project with new text.

        Args:
            path: The file's path, such as stats.py.
            old: The exact text to replace, spaces included; it must occur exactly once in the file.
            new: The text to put in its place.
        """
        episode = self._current()
        path = self._known(episode, path)
        if is_test_file(path):
            raise ValueError(f"{path} is a test file, which cannot be edited: fix the code it tests")
        text = episode.files[path]
        if not old:
            raise ValueError("old is empty: give the exact text to replace, as read_file shows it")
        count = text.count(old)
        if count == 0:
            raise ValueError(f"{old!r} does not occur in {path}; copy the exact text, spaces included, from read_file")
        if count > 1:
            raise ValueError(
                f"{old!r} occurs {count} times in {path}; give more of the text around it so that it occurs once"
            )
        if old == new:
            raise ValueError("old and new are the same text: the file would not change")
        episode.files[path] = text.replace(old, new)
        return f"Replaced the text in {path}."

    def run_tests(self) -> str:
        """Run the project's tests and show which fail, and why."""
        return run_tests(self._current().files, self.bwrap).output

    def _current(self) -> _Episode:
        if self.episode is None:
            raise ValueError("no task yet: reset the env first")
        return self.episode

    @staticmethod
    def _known(episode: _Episode, path: str) -> str:
        """`path` as a key of the project's files ("./a.py" and " a.py" are a.py); else a ValueError listing them."""
        cleaned = str(PurePosixPath(path.strip())) if path.strip() else ""
        if cleaned not in episode.files:
            raise ValueError(f"there is no file {path!r}; the files are {', '.join(sorted(episode.files))}")
        return cleaned


def folder_task(folder: Path) -> CodingTask:
    """A task from a folder: its files (subfolders included), the tests among them (`test_*.py`), the
    instruction in INSTRUCTION.md and, optionally, the fix in fix.json (a list of {"path", "old", "new"}),
    both left out of the project. A ValueError says what is wrong with it."""
    instruction_path = folder / INSTRUCTION_FILE
    if not instruction_path.is_file():
        raise ValueError(f"task folder {folder} has no {INSTRUCTION_FILE} (the instruction the model gets)")
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        parts = path.relative_to(folder).parts
        if relative in (INSTRUCTION_FILE, FIX_FILE) or any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue  # the task's own files, hidden files, and bytecode
        try:
            files[relative] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text; a task folder holds the project's text files only") from None
    if not any(is_test_file(path) for path in files):
        raise ValueError(f"task folder {folder} has no test file (test_*.py)")
    fix: tuple[Edit, ...] = ()
    if (folder / FIX_FILE).is_file():
        try:
            fix = tuple(Edit(e["path"], e["old"], e["new"]) for e in json.loads((folder / FIX_FILE).read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f'{folder / FIX_FILE} is not a JSON list of {{"path", "old", "new"}} edits ({exc})'
            ) from None
        for edit in fix:
            if files.get(edit.path, "").count(edit.old) != 1:
                raise ValueError(f"{folder / FIX_FILE}: {edit.old!r} does not occur exactly once in {edit.path}")
    return CodingTask(folder.name, instruction_path.read_text(encoding="utf-8").strip(), files, fix)


def folder_tasks(tasks_dir: Path) -> Callable[[int], CodingTask]:
    """Users' own tasks: `tasks_dir/train/<task>/` and `tasks_dir/eval/<task>/`, one folder per task (see
    folder_task). Training seed s plays train task s mod n (in the order of their names); held-out seed
    1,000,000 + i plays eval task i mod m, so held-out tasks stay out of training."""
    splits = {}
    for split in ("train", "eval"):
        folder = tasks_dir / split
        tasks = [folder_task(p) for p in sorted(folder.iterdir()) if p.is_dir()] if folder.is_dir() else []
        if not tasks:
            raise ValueError(f"tasks_dir {tasks_dir} has no task folder under {split}/ (expected {split}/<task>/)")
        splits[split] = tasks

    def task_for(seed: int) -> CodingTask:
        if seed < EVAL_SEED_START:
            return splits["train"][seed % len(splits["train"])]
        return splits["eval"][(seed - EVAL_SEED_START) % len(splits["eval"])]

    return task_for
