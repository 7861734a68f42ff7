import os

# No test may reach a model hub: fail at once instead of retrying.
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(var, "1")

import pytest


@pytest.fixture(autouse=True)
def rlcli_home(tmp_path, monkeypatch):
    """Point the runs directory and the model cache at a temp dir for every test."""
    home = tmp_path / "rlcli-home"
    monkeypatch.setenv("RLCLI_HOME", str(home))
    return home
