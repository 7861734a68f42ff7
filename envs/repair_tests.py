"""repair_tests: coding - fix a planted bug in a small Python project until its tests pass, with file and test tools.

Each seed generates a project: one or two modules (`modules`) of two or three (`functions`) small functions,
drawn from themes (stats, text, prices, grades, lists, shapes) with constants of their own (a shipping
rate, a grade boundary), and one test file. One line of one function carries a planted bug, drawn from
families of mutations: a wrong operator, an off-by-one (a constant one away, a missing `+ 1`), a wrong
constant, swapped operands, swapped arguments, `and` for `or`, `min` for `max`. Every test (up to
`tests`, at least two, with inputs drawn from the seed) fails because of it: the generator keeps only
mutations that change the function's result (or make it raise) on at least two inputs, and only those
inputs as tests, so a policy that edits nothing earns nothing.

The episode (rlcli.envs.coding.RepairTests): the model gets the instruction, the files' names and the
failing tests' output, and calls `read_file(path)`, `str_replace(path, old, new)` and `run_tests()`;
a reply without a tool call ends it, with reward = the share of the tests that pass, success = all pass.
The expert knows the planted fix: it reads the file, replaces the buggy line's text with the right one,
runs the tests, and finishes.

Users' own tasks in the same shape load with `tasks_dir` (a folder with train/ and eval/ task folders,
each holding the files, the tests and an INSTRUCTION.md; see docs/environments.md) instead of generated ones.

kwargs: `modules` (2: at most this many modules a project), `functions` (3: at most this many functions
a module, at least 2), `tests` (3: at most this many tests, at least 2), `themes` (all six, or a list
of them), `tasks_dir` (none: generated projects), `code_sandbox` (where the tests run; a recipe's run gets
env.code_sandbox's answer: bwrap, in bubblewrap; none, with their limits alone; auto, the default for
`rlcli envs try`, bubblewrap where it runs).
"""

from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.envs.coding import CodingTask, Edit, RepairTests, folder_tasks
from rlcli.envs.sandbox import SandboxSetting, use_bwrap

INSTRUCTION = "Some tests of this project fail. Find the bug in the code and fix it."
CANDIDATE_INPUTS = 40  # inputs tried per function, among which the tests are those the bug breaks


@dataclass(frozen=True)
class Function:
    """A function template: its source with {constant} fields, the choices of each constant, and a
    draw of arguments (given the rng and the constants chosen)."""

    source: str
    inputs: Callable[[random.Random, dict[str, Any]], tuple]
    constants: tuple[tuple[str, tuple], ...] = ()
    needs: str = ""  # another function of the theme that this one calls (included before it)

    @property
    def name(self) -> str:
        return self.source.split("def ", 1)[1].split("(", 1)[0]


def ints(rng: random.Random, low: int, high: int, least: int = 1, most: int = 6) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(least, most))]


WORDS = ["apple", "river", "stone", "cloud", "garden", "lamp", "orbit", "maple", "violet", "anchor", "ember", "quiet"]


def words(rng: random.Random, least: int = 1, most: int = 3) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(least, most)))


THEMES: dict[str, list[Function]] = {
    "stats": [
        Function(
            '''
            def total(values):
                """Return the sum of the values."""
                result = 0
                for value in values:
                    result += value
                return result
            ''',
            lambda rng, c: (ints(rng, 0, 20),),
        ),
        Function(
            '''
            def count_above(values, limit):
                """Return how many values are greater than limit."""
                count = 0
                for value in values:
                    if value > limit:
                        count += 1
                return count
            ''',
            lambda rng, c: (ints(rng, 0, 20, 2, 7), rng.randint(0, 20)),
        ),
        Function(
            '''
            def largest(values):
                """Return the largest of the values."""
                best = values[0]
                for value in values[1:]:
                    if value > best:
                        best = value
                return best
            ''',
            lambda rng, c: (ints(rng, -10, 30, 2, 6),),
        ),
        Function(
            '''
            def spread(values):
                """Return the largest value minus the smallest."""
                return max(values) - min(values)
            ''',
            lambda rng, c: (ints(rng, 0, 40, 2, 6),),
        ),
        Function(
            '''
            def average(values):
                """Return the mean of the values, rounded down."""
                return sum(values) // len(values)
            ''',
            lambda rng, c: (ints(rng, 0, 50, 1, 5),),
        ),
        Function(
            '''
            def running_totals(values):
                """Return the sums of the first 1, 2, 3, ... values."""
                totals = []
                current = 0
                for value in values:
                    current += value
                    totals.append(current)
                return totals
            ''',
            lambda rng, c: (ints(rng, 0, 9, 2, 5),),
        ),
    ],
    "text": [
        Function(
            '''
            def shout(text):
                """Return the text in capitals, followed by {mark!r}."""
                return text.upper() + {mark!r}
            ''',
            lambda rng, c: (words(rng),),
            (("mark", ("!", "!!", "?!")),),
        ),
        Function(
            '''
            def initials(name):
                """Return the first letter of each word of the name, in capitals."""
                return "".join(word[0].upper() for word in name.split())
            ''',
            lambda rng, c: (words(rng, 2, 3),),
        ),
        Function(
            '''
            def truncate(text, width):
                """Return the text if it has at most width characters, else its first width - {dots} characters and {dots} dots."""
                if len(text) <= width:
                    return text
                return text[:width - {dots}] + "{dot_text}"
            ''',
            lambda rng, c: (words(rng), rng.randint(6, 14)),
            (("dots", (2, 3)),),
        ),
        Function(
            '''
            def count_vowels(text):
                """Return how many vowels (a, e, i, o, u) the text holds."""
                return sum(1 for char in text.lower() if char in "aeiou")
            ''',
            lambda rng, c: (words(rng).capitalize(),),
        ),
        Function(
            '''
            def pad_left(text, width, fill):
                """Return the text with fill characters before it, up to width characters."""
                return fill * (width - len(text)) + text
            ''',
            lambda rng, c: (str(rng.randint(1, 999)), rng.randint(4, 7), rng.choice("0*.")),
        ),
        Function(
            '''
            def repeat(word, times):
                """Return the word repeated times times, separated by {sep!r}."""
                return {sep!r}.join([word] * times)
            ''',
            lambda rng, c: (rng.choice(WORDS), rng.randint(2, 4)),
            (("sep", ("-", ", ", " ")),),
        ),
    ],
    "prices": [
        Function(
            '''
            def discount(price, percent):
                """Return the price less percent per cent of it, rounded down."""
                return price - price * percent // 100
            ''',
            lambda rng, c: (rng.randint(2, 60) * 5, rng.choice([5, 10, 15, 20, 25, 50])),
        ),
        Function(
            '''
            def shipping(weight):
                """Return the cost of shipping: {base} up to {limit} kg, plus {extra} for each kg above."""
                if weight <= {limit}:
                    return {base}
                return {base} + (weight - {limit}) * {extra}
            ''',
            lambda rng, c: (rng.randint(c["limit"] - 6, c["limit"] + 12),),
            (("base", (4, 5, 6, 7, 8, 9)), ("limit", (10, 15, 20, 25)), ("extra", (2, 3, 4))),
        ),
        Function(
            '''
            def with_tax(price):
                """Return the price plus {rate} per cent tax, rounded down."""
                return price + price * {rate} // 100
            ''',
            lambda rng, c: (rng.randint(2, 80) * 5,),
            (("rate", (5, 8, 10, 12, 15, 20, 25)),),
        ),
        Function(
            '''
            def bulk_cost(price, quantity):
                """Return the cost of quantity items at price each, {percent} per cent off from {bulk} items on."""
                cost = price * quantity
                if quantity >= {bulk}:
                    return discount(cost, {percent})
                return cost
            ''',
            lambda rng, c: (rng.randint(2, 30) * 2, rng.randint(c["bulk"] - 4, c["bulk"] + 4)),
            (("percent", (10, 20, 25)), ("bulk", (5, 6, 8, 10))),
            needs="discount",
        ),
    ],
    "grades": [
        Function(
            '''
            def grade(score):
                """Return "A" for a score of {top} or more, "B" for {middle} or more, else "C"."""
                if score >= {top}:
                    return "A"
                if score >= {middle}:
                    return "B"
                return "C"
            ''',
            lambda rng, c: (rng.randint(c["middle"] - 10, min(100, c["top"] + 6)),),
            (("top", (85, 88, 90, 92)), ("middle", (60, 65, 70, 75))),
        ),
        Function(
            '''
            def passed(score, pass_mark):
                """Return whether the score reaches the pass mark."""
                return score >= pass_mark
            ''',
            lambda rng, c: (rng.randint(30, 70), rng.randint(40, 60)),
        ),
        Function(
            '''
            def percentage(points, out_of):
                """Return points as a percentage of out_of, rounded down."""
                return points * 100 // out_of
            ''',
            lambda rng, c: (rng.randint(0, 40), rng.randint(20, 50)),
        ),
        Function(
            '''
            def top_scores(scores, count):
                """Return the count highest scores, highest first."""
                return sorted(scores, reverse=True)[:count]
            ''',
            lambda rng, c: (ints(rng, 0, 100, 3, 6), rng.randint(1, 3)),
        ),
        Function(
            '''
            def bonus_points(score):
                """Return the score plus {bonus}, at most 100."""
                return min(score + {bonus}, 100)
            ''',
            lambda rng, c: (rng.randint(60, 100),),
            (("bonus", (3, 5, 10)),),
        ),
    ],
    "lists": [
        Function(
            '''
            def last_items(items, count):
                """Return the last count items."""
                return items[len(items) - count:]
            ''',
            lambda rng, c: (ints(rng, 0, 9, 3, 6), rng.randint(1, 3)),
        ),
        Function(
            '''
            def every_other(items):
                """Return the first, third, fifth... items."""
                return items[::2]
            ''',
            lambda rng, c: (ints(rng, 0, 9, 3, 7),),
        ),
        Function(
            '''
            def chunks(items, size):
                """Split the items into lists of size items; the last may be shorter."""
                return [items[i:i + size] for i in range(0, len(items), size)]
            ''',
            lambda rng, c: (ints(rng, 0, 9, 3, 7), rng.randint(2, 3)),
        ),
        Function(
            '''
            def index_of(items, target):
                """Return the position of the first target in items, or -1 if there is none."""
                for i in range(len(items)):
                    if items[i] == target:
                        return i
                return -1
            ''',
            lambda rng, c: (ints(rng, 0, 6, 3, 6), rng.randint(0, 6)),
        ),
        Function(
            '''
            def rotate(items, steps):
                """Return the items moved steps places to the left, the first ones going to the end."""
                steps = steps % len(items)
                return items[steps:] + items[:steps]
            ''',
            lambda rng, c: (ints(rng, 0, 9, 3, 6), rng.randint(1, 7)),
        ),
        Function(
            '''
            def pairs(items):
                """Return each item with the one after it, as tuples."""
                return [(items[i], items[i + 1]) for i in range(len(items) - 1)]
            ''',
            lambda rng, c: (ints(rng, 0, 9, 2, 5),),
        ),
    ],
    "shapes": [
        Function(
            '''
            def area(width, height):
                """Return the area of a width by height rectangle."""
                return width * height
            ''',
            lambda rng, c: (rng.randint(1, 12), rng.randint(1, 12)),
        ),
        Function(
            '''
            def perimeter(width, height):
                """Return the perimeter of a width by height rectangle."""
                return 2 * (width + height)
            ''',
            lambda rng, c: (rng.randint(1, 12), rng.randint(1, 12)),
        ),
        Function(
            '''
            def distance(x1, y1, x2, y2):
                """Return the number of grid steps from (x1, y1) to (x2, y2)."""
                return abs(x1 - x2) + abs(y1 - y2)
            ''',
            lambda rng, c: tuple(rng.randint(-5, 9) for _ in range(4)),
        ),
        Function(
            '''
            def tiles(width, height, side):
                """Return how many side by side tiles fit whole in a width by height floor."""
                return (width // side) * (height // side)
            ''',
            lambda rng, c: (rng.randint(3, 20), rng.randint(3, 20), rng.randint(2, 4)),
        ),
        Function(
            '''
            def inside(x, y, width, height):
                """Return whether the point (x, y) lies on a width by height grid whose corner is (0, 0)."""
                return 0 <= x < width and 0 <= y < height
            ''',
            lambda rng, c: (rng.randint(-2, 8), rng.randint(-2, 8), rng.randint(3, 7), rng.randint(3, 7)),
        ),
    ],
}


@dataclass(frozen=True)
class Mutation:
    kind: str  # the family: wrong operator, off by one, ...
    line: int  # 0-based line of the module's source
    text: str  # the line as mutated


OPERATORS = {  # what a wrong operator becomes: the ast class name -> (symbol, the symbol put instead)
    "Add": ("+", "-"),
    "Sub": ("-", "+"),
    "Mult": ("*", "+"),
    "FloorDiv": ("//", "*"),
    "Mod": ("%", "//"),
    "Lt": ("<", "<="),
    "LtE": ("<=", "<"),
    "Gt": (">", ">="),
    "GtE": (">=", ">"),
    "Eq": ("==", "!="),
    "NotEq": ("!=", "=="),
}
NON_COMMUTATIVE = {"Sub", "FloorDiv", "Mod", "Lt", "LtE", "Gt", "GtE"}


def _segment(line: str, node: ast.AST) -> str:
    return line[node.col_offset : node.end_col_offset]  # type: ignore[attr-defined]


def _with_operator(line: str, before: ast.AST, after: ast.AST, op: ast.AST) -> str | None:
    """The line with the operator between two nodes replaced as OPERATORS says."""
    symbol, instead = OPERATORS.get(type(op).__name__, (None, None))
    if symbol is None or instead is None:
        return None
    start, end = before.end_col_offset, after.col_offset  # type: ignore[attr-defined]
    gap = line[start:end]
    at = gap.find(symbol)
    if at < 0:
        return None
    return line[:start] + gap[:at] + instead + gap[at + len(symbol) :] + line[end:]


def mutations(source: str) -> list[Mutation]:
    """Every single-line mutation of a module's functions (their docstrings left alone)."""
    lines = source.splitlines()
    found = []
    tree = ast.parse(source)
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef):
            continue
        body = function.body[1:]  # past the docstring
        for node in (n for statement in body for n in ast.walk(statement)):
            if not hasattr(node, "lineno") or node.lineno != node.end_lineno:
                continue
            i = node.lineno - 1
            line = lines[i]

            def add(kind: str, text: str | None, i: int = i, line: str = line) -> None:
                if text is not None and text != line:
                    found.append(Mutation(kind, i, text))

            def swap(a: ast.AST, b: ast.AST, line: str = line) -> str:
                return (
                    line[: a.col_offset]  # type: ignore[attr-defined]
                    + _segment(line, b)
                    + line[a.end_col_offset : b.col_offset]  # type: ignore[attr-defined]
                    + _segment(line, a)
                    + line[b.end_col_offset :]  # type: ignore[attr-defined]
                )

            if isinstance(node, ast.BinOp):
                add("wrong operator", _with_operator(line, node.left, node.right, node.op))
                if type(node.op).__name__ in NON_COMMUTATIVE:
                    add("swapped operands", swap(node.left, node.right))
                right = node.right
                if isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(right, ast.Constant) and right.value == 1:
                    whole = line[: node.col_offset] + _segment(line, node.left) + line[node.end_col_offset :]
                    add("off by one", whole)  # the + 1 (or - 1) left out
            elif isinstance(node, ast.AugAssign):
                add("wrong operator", _with_operator(line, node.target, node.value, node.op))
            elif isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op, before, after in zip(node.ops, operands, operands[1:]):
                    add("wrong operator", _with_operator(line, before, after, op))
                    if len(node.ops) == 1 and type(op).__name__ in NON_COMMUTATIVE:
                        add("swapped operands", swap(before, after))
            elif isinstance(node, ast.BoolOp):
                symbol, instead = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
                start, end = node.values[0].end_col_offset, node.values[1].col_offset  # type: ignore[attr-defined]
                add(f"{instead} for {symbol}", line[:start] + line[start:end].replace(symbol, instead) + line[end:])
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and not node.keywords:
                add("swapped arguments", swap(node.args[0], node.args[1]))
            elif isinstance(node, ast.Name) and node.id in ("min", "max"):
                other = "max" if node.id == "min" else "min"
                add(f"{other} for {node.id}", line[: node.col_offset] + other + line[node.end_col_offset :])
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                kind = "off by one" if node.value <= 2 else "wrong constant"
                for value in (node.value + 1, node.value - 1):
                    add(kind, line[: node.col_offset] + str(value) + line[node.end_col_offset :])
            elif isinstance(node, ast.Constant) and type(node.value) is bool:
                add("wrong constant", line[: node.col_offset] + str(not node.value) + line[node.end_col_offset :])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                others = {
                    c.value for c in ast.walk(function) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
                others -= {node.value, ast.get_docstring(function)}
                for other in sorted(others):
                    add("wrong constant", line[: node.col_offset] + repr(other) + line[node.end_col_offset :])
    return found


def _namespace(source: str) -> dict[str, Any] | None:
    """The module's functions, or None if its source does not run (a mutation that breaks it)."""
    namespace: dict[str, Any] = {}
    try:
        exec(compile(source, "<generated>", "exec"), namespace)  # the generator's own templates, never model text
    except Exception:
        return None
    return namespace


def _outcome(fn: Callable[..., Any], args: tuple) -> tuple[str, Any]:
    try:
        return "value", fn(*args)
    except Exception as exc:
        return "raised", type(exc).__name__


@dataclass(frozen=True)
class Module:
    name: str
    functions: list[Function]
    constants: list[dict[str, Any]]
    source: str


def _module(theme: str, rng: random.Random, most: int) -> Module:
    """A module of the theme: two to `most` of its functions, in the theme's order, constants drawn."""
    templates = THEMES[theme]
    by_name = {f.name: i for i, f in enumerate(templates)}
    size = rng.randint(2, most)
    chosen: set[int] = set()
    for i in rng.sample(range(len(templates)), len(templates)):
        with_needed = {i, *([by_name[templates[i].needs]] if templates[i].needs else [])}
        if len(chosen | with_needed) <= size:
            chosen |= with_needed
    functions = [templates[i] for i in sorted(chosen)]
    constants = [{name: rng.choice(choices) for name, choices in f.constants} for f in functions]
    parts = []
    for function, values in zip(functions, constants):
        if "dots" in values:
            values["dot_text"] = "." * values["dots"]
        parts.append(textwrap.dedent(function.source).strip().format(**values))
    return Module(theme, functions, constants, "\n\n\n".join(parts) + "\n")


def _tests(module: Module, mutation: Mutation, rng: random.Random, most: int) -> tuple[str, list[str]] | None:
    """The test file for `mutation` (the function it is in, on inputs where it changes the outcome), and
    its test calls; None when fewer than two inputs tell the mutated function from the right one."""
    lines = module.source.splitlines()
    mutated = "\n".join(lines[: mutation.line] + [mutation.text] + lines[mutation.line + 1 :]) + "\n"
    right, wrong = _namespace(module.source), _namespace(mutated)
    if right is None or wrong is None:
        return None
    owner = [
        (f, c)
        for f, c in zip(module.functions, module.constants)
        if _defines_line(module.source, f.name, mutation.line)
    ]
    if not owner:
        return None
    function, constants = owner[0]
    cases: dict[str, Any] = {}
    for _ in range(CANDIDATE_INPUTS):
        args = function.inputs(rng, constants)
        call = f"{function.name}({', '.join(repr(a) for a in args)})"
        expected = _outcome(right[function.name], args)
        got = _outcome(wrong[function.name], args)
        if call in cases or expected[0] != "value":
            continue
        if got[0] != "value" or got[1] != expected[1]:
            cases[call] = expected[1]
        if len(cases) == most:
            break
    if len(cases) < 2:
        return None
    name = "".join(part.capitalize() for part in function.name.split("_"))
    body = [f"import unittest\n\nfrom {module.name} import {function.name}\n\n\nclass Test{name}(unittest.TestCase):"]
    for n, (call, expected) in enumerate(cases.items(), 1):
        body.append(f"    def test_{function.name}_{n}(self):\n        self.assertEqual({call}, {expected!r})\n")
    return "\n".join(body), list(cases)


def _defines_line(source: str, name: str, line: int) -> bool:
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.lineno - 1 <= line <= node.end_lineno - 1  # type: ignore[operator]
    return False


def generate(
    seed: int, modules: int = 2, functions: int = 3, tests: int = 3, themes: tuple[str, ...] = tuple(THEMES)
) -> CodingTask:
    """The project of `seed`: its modules (of `themes`), the planted bug and the tests that catch it."""
    rng = random.Random(seed)
    drawn = rng.sample(sorted(themes), rng.randint(1, min(modules, len(themes))))
    made = [_module(theme, rng, functions) for theme in drawn]
    buggy = rng.choice(made)
    by_kind: dict[str, list[Mutation]] = {}
    for mutation in mutations(buggy.source):
        by_kind.setdefault(mutation.kind, []).append(mutation)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)  # a family first, then a place: each family as likely as the others where it fits
    for kind in kinds:
        places = by_kind[kind]
        rng.shuffle(places)
        for mutation in places:
            old, new = mutation.text.strip(), buggy.source.splitlines()[mutation.line].strip()
            lines = buggy.source.splitlines()
            source = "\n".join(lines[: mutation.line] + [mutation.text] + lines[mutation.line + 1 :]) + "\n"
            if source.count(old) != 1:
                continue  # the fix's old text must name one place
            made_tests = _tests(buggy, mutation, rng, tests)
            if made_tests is None:
                continue
            test_file, _ = made_tests
            files = {m.name + ".py": (source if m is buggy else m.source) for m in made}
            files[f"test_{buggy.name}.py"] = test_file
            function = next(f.name for f in buggy.functions if _defines_line(buggy.source, f.name, mutation.line))
            fix = (Edit(f"{buggy.name}.py", old, new),)
            return CodingTask(f"{'+'.join(drawn)}-{seed}", INSTRUCTION, files, fix, f"{kind} in {function}")
    raise ValueError(f"seed {seed}: no mutation of {buggy.name}.py is caught by two inputs")  # never seen in tests


def make_env(
    tasks_dir: str | None = None,
    modules: int = 2,
    functions: int = 3,
    tests: int = 3,
    themes: list[str] | None = None,
    code_sandbox: SandboxSetting = "auto",
) -> RepairTests:
    if modules < 1 or functions < 2 or tests < 2:
        raise ValueError(
            f"modules must be at least 1, functions and tests at least 2; got {modules}, {functions} and {tests}"
        )
    unknown = sorted(set(themes or ()) - set(THEMES))
    if themes == [] or unknown:
        raise ValueError(f"themes must be a list of some of {', '.join(THEMES)}; got {themes}")
    if code_sandbox not in ("none", "bwrap", "auto"):
        raise ValueError(f"code_sandbox must be none, bwrap or auto, got {code_sandbox!r}")
    bwrap = use_bwrap(code_sandbox, "env.code_sandbox")
    if tasks_dir is not None:
        return RepairTests(folder_tasks(Path(tasks_dir)), bwrap)
    chosen = tuple(themes or THEMES)
    return RepairTests(lambda seed: generate(seed, modules, functions, tests, chosen), bwrap)
