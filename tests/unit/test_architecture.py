"""The import graph of src/rlcli: no module cycles, and every import goes downhill between packages.

Every import counts, at any depth: at module level, inside functions (the lazy imports that keep
start-up fast) and under `if TYPE_CHECKING:`. A "package" is a subpackage of rlcli (rlcli.engine) or
a top-level module (rlcli.recipe). docs/architecture.md describes the layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Highest first: a package may import packages of lower layers only, never one of its own layer or above.
LAYERS: list[set[str]] = [
    {"__main__"},  # `python -m rlcli`
    {"cli"},  # the Typer commands: parse, open the run, call the engine or report, render
    {"engine", "report"},  # the stages (rollout, train, eval...); the tables, plots and exports of a run
    {"rewards"},  # reward functions, scoring, the LLM judge (which samples through generation)
    {"generation"},  # the samplers (HF, vLLM), engine choice, sampling config, seeds
    {"store", "envs", "models"},  # the run database; env protocol, loading and workers; the model cache and loading
    # the recipe schema; the export folder check; loading user files; a recipe's secrets redacted for sharing
    {"recipe", "export_folder", "usercode", "redaction"},
    {"errors", "console", "rlcli"},  # the error types; the stderr console; rlcli/__init__: import nothing from rlcli
]

# Inside rlcli.engine.grpo, one module per step of an iteration (its __init__ says which is which),
# highest first: a module may import modules of lower layers only. The rollout side (sources, worker,
# staleness, selection) thus never reaches the learner, and the pure maths import no other step.
GRPO_LAYERS: list[set[str]] = [
    {"loop"},  # the iteration, and GRPO's phases
    {"retention"},  # grpo.keep_checkpoints: which checkpoints keep their weights
    {"evals", "metrics"},  # held-out evals during training; an iteration's metrics and live view
    {"learner", "sources", "teacher"},  # torch state (setup, update, save); where rollouts come from; distill's teacher
    {"batch", "worker", "resume"},  # advantages and sequences; the asynchronous worker; where a phase goes on
    {"selection", "update", "schedule", "branches"},  # which groups train; clipped steps; learning rate; branch/i
    {"advantages", "loss", "staleness", "checkpoints"},  # pure maths; policy versions; where checkpoints go
]

# Packages that must never reach the stages, even through an import that ruff or the layers would miss.
BELOW_ENGINE = {"generation", "rewards", "store", "envs", "models"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. rlcli.engine.rollout
    target: str  # the imported rlcli module
    where: str  # file:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rlcli_imports(src: Path = SRC) -> list[Import]:
    """Every import of an rlcli module by an rlcli module under src, at any depth."""
    files = {module_name(p, src): p for p in sorted((src / "rlcli").rglob("*.py"))}
    found = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from rlcli.engine import train` imports the module rlcli.engine.train
                names = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(src.parent)}:{node.lineno}"
            targets = []
            for name in names:
                if name != "rlcli" and not name.startswith("rlcli."):
                    continue
                while name and name not in files:  # rlcli.x.y.SomeClass -> rlcli.x.y
                    name = name.rpartition(".")[0]
                if name and name != module and name not in targets:
                    targets.append(name)
            found += [Import(module, target, where) for target in targets]
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlcli"


def layer_of(package: str) -> int:
    for depth, layer in enumerate(LAYERS):
        if package in layer:
            return depth
    raise AssertionError(f"rlcli.{package} is in no layer of tests/unit/test_architecture.py: add it to LAYERS")


def cycles(imports: list[Import]) -> list[list[Import]]:
    """One cycle (as the imports that make it) per strongly connected group of modules."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports:
        graph[imp.source].setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for group in groups:
        # Walk from the group's first module until a module repeats: the imports on that walk form a cycle.
        path = [min(group)]
        while True:
            step = next(t for t in sorted(graph[path[-1]]) if t in group)
            if step in path:
                path = path[path.index(step) :] + [step]
                break
            path.append(step)
        found.append([graph[a][b] for a, b in zip(path, path[1:])])
    return found


def uphill(imports: list[Import]) -> list[Import]:
    """Imports from a package into one of its own layer or a higher one."""
    return [
        imp
        for imp in imports
        if package_of(imp.source) != package_of(imp.target)
        and layer_of(package_of(imp.target)) <= layer_of(package_of(imp.source))
    ]


def into_engine(imports: list[Import]) -> list[Import]:
    return [imp for imp in imports if package_of(imp.source) in BELOW_ENGINE and package_of(imp.target) == "engine"]


def test_no_module_import_cycles():
    found = cycles(rlcli_imports())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(map(str, cycle)) for cycle in found)


def test_packages_import_only_downhill():
    found = uphill(rlcli_imports())
    assert not found, "imports of a package of the same or a higher layer:\n" + "\n".join(f"  {imp}" for imp in found)


def test_nothing_below_engine_imports_engine():
    found = into_engine(rlcli_imports())
    assert not found, "imports of rlcli.engine from below it:\n" + "\n".join(f"  {imp}" for imp in found)


def grpo_uphill(imports: list[Import]) -> list[Import]:
    """Imports between modules of rlcli.engine.grpo into one of the same or a higher GRPO_LAYERS layer."""
    prefix = "rlcli.engine.grpo."

    def layer(module: str) -> int:
        step = module.removeprefix(prefix)
        found = [depth for depth, names in enumerate(GRPO_LAYERS) if step in names]
        assert found, f"{module} is in no layer of GRPO_LAYERS (tests/unit/test_architecture.py): add it"
        return found[0]

    inside = [imp for imp in imports if imp.source.startswith(prefix) and imp.target.startswith(prefix)]
    return [imp for imp in inside if layer(imp.target) <= layer(imp.source)]


def test_grpo_steps_import_only_downhill():
    found = grpo_uphill(rlcli_imports())
    assert not found, "GRPO modules importing a step of their own or a higher layer:\n" + "\n".join(
        f"  {imp}" for imp in found
    )
    steps = {path.stem for path in (SRC / "rlcli" / "engine" / "grpo").glob("*.py")} - {"__init__"}
    assert steps == set().union(*GRPO_LAYERS), "GRPO_LAYERS must list exactly the modules of rlcli/engine/grpo"


def test_every_package_has_a_layer():
    for path in (SRC / "rlcli").rglob("*.py"):
        layer_of(package_of(module_name(path, SRC)))


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checks on a small tree with a cycle, an uphill import inside a function, and one under
    TYPE_CHECKING: each is reported with its file and line."""
    root = tmp_path / "src" / "rlcli"
    for folder in ("engine", "generation", "store"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "engine" / "a.py").write_text("from rlcli.engine import b\n")
    (root / "engine" / "b.py").write_text("def f():\n    from .a import x\n")
    (root / "generation" / "g.py").write_text("def f():\n    from rlcli.engine.a import f\n")
    (root / "store" / "s.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlcli.generation import g\n"
    )
    imports = rlcli_imports(tmp_path / "src")
    [cycle] = cycles(imports)
    assert {str(imp) for imp in cycle} == {
        "src/rlcli/engine/a.py:1: rlcli.engine.a imports rlcli.engine.b",
        "src/rlcli/engine/b.py:2: rlcli.engine.b imports rlcli.engine.a",
    }
    assert {str(imp) for imp in uphill(imports)} == {
        "src/rlcli/generation/g.py:2: rlcli.generation.g imports rlcli.engine.a",
        "src/rlcli/store/s.py:3: rlcli.store.s imports rlcli.generation",  # the package's __init__ runs too
        "src/rlcli/store/s.py:3: rlcli.store.s imports rlcli.generation.g",
    }
    assert [str(imp) for imp in into_engine(imports)] == [
        "src/rlcli/generation/g.py:2: rlcli.generation.g imports rlcli.engine.a"
    ]
