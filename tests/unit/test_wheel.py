"""A built wheel, installed away from the source tree, still has its built-in environments and its
shipped recipes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILTINS = ["arithmetic", "calculator", "guess_number", "maze"]


def run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def modules(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*.py")}


def test_an_installed_wheel_lists_and_plays_the_builtin_envs(tmp_path):
    # Build from a copy, so the build leaves nothing behind in the repository (build/, egg-info).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("src", "envs", "recipes"):
        shutil.copytree(REPO / folder, source / folder, ignore=skip)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", source, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("rlcli-*.whl")
    site = tmp_path / "site"
    run(*pip, "install", "--no-deps", "--no-index", "--target", site, wheel, cwd=tmp_path)

    # The installed copy comes first on the path; the cwd is outside the repository, so nothing in
    # it can be picked up by accident.
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run(sys.executable, "-c", "import rlcli; print(rlcli.__file__)", cwd=tmp_path, env=env)
    assert Path(where.strip()).is_relative_to(site)

    # pyproject.toml lists the packages by hand: a subpackage missing there would be missing here.
    expected = modules(source / "src" / "rlcli") | {Path("builtin_envs", m) for m in modules(source / "envs")}
    assert modules(site / "rlcli") == expected | {Path("recipes", "__init__.py")}
    shipped = sorted(p.name for p in (source / "recipes").glob("*.yaml"))
    assert sorted(p.name for p in (site / "rlcli" / "recipes").glob("*.yaml")) == shipped

    rlcli = site / "bin" / "rlcli"
    listed = run(rlcli, "envs", "list", "--json", cwd=tmp_path, env=env)
    assert all(f'"name": "{name}"' in listed for name in BUILTINS), listed
    played = run(rlcli, "envs", "try", "guess_number", "--policy", "expert", cwd=tmp_path, env=env)
    assert "solved in" in played and "not solved" not in played, played
    recipes = run(rlcli, "recipes", "list", "--json", cwd=tmp_path, env=env)
    assert '"name": "quickstart"' in recipes and str(site) in recipes, recipes
    assert "quickstart" in run(rlcli, "recipes", "validate", "quickstart", cwd=tmp_path, env=env)
