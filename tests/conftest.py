import os

# No test may reach a model hub: fail at once instead of retrying.
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(var, "1")

import pytest  # noqa: E402 (the variables above must be set before any HF import)


@pytest.fixture(scope="session")
def session_models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


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
def quiet_machine(monkeypatch):
    """In-process commands see an idle machine: whether other work keeps the cores busy is not what
    a test checks (tests/test_env_workers.py tests the warning), and it would add a line to stderr."""
    from rlcli.engine import threads

    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)


@pytest.fixture
def smollm2_cache(session_models):
    """The embedded SmolLM2-135M, pulled (about 30 s) on first use in the session."""
    from rlcli.models.cache import pull_model

    pull_model("smollm2-135m")
    return session_models
