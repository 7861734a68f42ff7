"""The test runner of the coding envs (envs/coding.py): run a project's tests, report them briefly.

Run as `python -I -c <this file's source>` in the project's folder, with the variable MARK_VARIABLE set.
It imports every `test_*.py` below the folder (sorted by path) and runs each module's unittest test
cases and its plain `test_*` functions (pytest's style, without pytest: importing pytest alone takes
longer than the tests). It prints one short block per failing test (the failing line in the test and in
the project's code, paths relative to the project, and the exception's first line), then a count, and
last a line `<mark> <passed> <total>` for the env's reward. The mark is read from the variable, which is
cleared before any test file is imported, so that the project's code has to work to forge the line. The
output holds no timing and no absolute path: the same files always print the same text (envs replay).

A test file that cannot be imported (a syntax error in the code it imports, say) counts as one failing
test. Only the standard library is imported here; the project's code may import what the interpreter has.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
import unittest

ROOT = os.getcwd()
MARK_VARIABLE = "RLCLI_TEST_COUNTS_MARK"
MESSAGE_CHARS = 300  # of an exception's first line: enough for "[1, 2] != [1, 2, 3]", not a whole diff


def relative(path: str) -> str | None:
    """A path inside the project, relative to it; None for one outside (the standard library, this runner,
    the import system's frozen modules)."""
    if path.startswith("<"):
        return None
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else None


def is_test_file(path: str) -> bool:
    return os.path.basename(path).startswith("test_") and path.endswith(".py")


def test_files() -> list[str]:
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "__")))
        found += [os.path.join(folder, name) for name in files if is_test_file(name)]
    return sorted(found)


def first_line(exc: BaseException) -> str:
    # A SyntaxError's str() ends with its file's absolute path: its place is said apart (describe).
    text = (exc.msg if isinstance(exc, SyntaxError) else str(exc)).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line[:MESSAGE_CHARS]


def describe(exc: BaseException) -> list[str]:
    """Where `exc` happened in the project (its last frame in a test file, then its last frame in the
    project's other code), and what it was."""
    named = [(relative(f.filename), f) for f in traceback.extract_tb(exc.__traceback__)]
    frames = [(path, f) for path, f in named if path is not None]
    lines = []
    test = [(path, f) for path, f in frames if is_test_file(path)]
    code = [(path, f) for path, f in frames if not is_test_file(path)]
    for path, frame in [*test[-1:], *code[-1:]]:
        lines += [f"  {path}, line {frame.lineno}, in {frame.name}", f"    {(frame.line or '').strip()}"]
    if isinstance(exc, SyntaxError) and exc.filename and relative(exc.filename):
        lines += [f"  {relative(exc.filename)}, line {exc.lineno}", f"    {(exc.text or '').strip()}"]
    return [*lines, first_line(exc)]


class Result(unittest.TestResult):
    """Counts the tests and keeps each failure's report."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[list[str]] = []
        self.unimportable = 0  # test files that could not be imported, each counted as one failing test

    def _report(self, kind: str, test: unittest.TestCase, err: tuple) -> None:
        if isinstance(test, unittest.FunctionTestCase):
            name = test._testFunc.__name__  # type: ignore[attr-defined]
        else:
            name = getattr(test, "_testMethodName", str(test))
        self.reports.append([f"{kind} {name}", *describe(err[1])])

    def addFailure(self, test: unittest.TestCase, err: tuple) -> None:  # noqa: N802  (unittest's names)
        super().addFailure(test, err)
        self._report("FAIL", test, err)

    def addError(self, test: unittest.TestCase, err: tuple) -> None:  # noqa: N802
        super().addError(test, err)
        self._report("ERROR", test, err)


def load(path: str, result: Result) -> unittest.TestSuite | None:
    """The tests of one file: its TestCase classes and its plain test_* functions; None (and a failure
    reported) when the file cannot be imported."""
    name = "_".join(relative(path).removesuffix(".py").split(os.sep))  # type: ignore[union-attr]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:  # the file's, or the code it imports: one failing "test" in its place
        result.unimportable += 1
        result.reports.append([f"ERROR importing {relative(path)}", *describe(exc)])
        return None
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    for attribute, value in vars(module).items():
        if attribute.startswith("test_") and callable(value) and not isinstance(value, type):
            suite.addTest(unittest.FunctionTestCase(value))
    return suite


def main() -> None:
    mark = os.environ.pop(MARK_VARIABLE, "")
    sys.dont_write_bytecode = True
    sys.path.insert(0, ROOT)
    result = Result()
    for path in test_files():
        suite = load(path, result)
        if suite is not None:
            suite.run(result)
    failed = len(result.failures) + len(result.errors) + result.unimportable
    total = result.testsRun + result.unimportable
    for report in result.reports:
        print("\n".join(report))
    if total == 0:
        print("No tests found (test_*.py files with unittest test cases or test_* functions).")
    elif failed:
        print(f"{total - failed} of {total} tests pass.")
    else:
        print(f"All {total} tests pass.")
    print(f"{mark} {total - failed} {total}", flush=True)


if __name__ == "__main__":  # run with -c, as coding.py does
    main()
