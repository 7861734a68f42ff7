"""Secrets never leave the machine: a recipe's secrets (an MCP server's env values, keys that name a
secret) are redacted in every artifact that copies the recipe (run.json, the hub card and
rlcli-recipe.yaml, report.html), while the run database keeps them for resuming."""

from __future__ import annotations

import copy
import sqlite3
import sys
from contextlib import closing

from helpers import REPO, run_in_process
from rlcli.redaction import REDACTED, shareable_recipe
from test_tool_use import tool_recipe

SECRET = "s3cr3t-value-of-the-server-key"
PASSWORD = "pa55w0rd-in-a-url"
TOKEN = "hf_" + "A1b2C3d4" * 5


def test_a_shareable_recipe_has_no_secret_and_keeps_everything_else():
    resolved = {
        "env": {
            "name": f"openenv:https://bob:{PASSWORD}@envs.example.org/echo",
            "kwargs": {"judge": {"api_key": SECRET, "model": "m"}, "HF_TOKEN": TOKEN, "size": 3},
            "mcp_servers": [
                {
                    "command": ["npx", "-y", "server", "--api-key", SECRET, f"--token={TOKEN}", "--port", "8000"],
                    "env": {"API_BASE": "http://localhost:8000", "SEARCH_KEY": SECRET},
                    "cwd": None,
                }
            ],
        },
        "rollout": {"max_new_tokens": 64, "tasks": 4},
        "run": {"description": f"uses {TOKEN} by mistake", "trackers": ["wandb"]},
    }
    before = copy.deepcopy(resolved)
    shared = shareable_recipe(resolved)
    assert resolved == before  # a copy: the caller's recipe (the database's) keeps its values
    text = repr(shared)
    assert SECRET not in text and PASSWORD not in text and TOKEN not in text
    [server] = shared["env"]["mcp_servers"]
    assert server["env"] == {"API_BASE": REDACTED, "SEARCH_KEY": REDACTED}  # every value; the names stay
    assert server["command"] == ["npx", "-y", "server", "--api-key", REDACTED, f"--token={REDACTED}", "--port", "8000"]
    assert shared["env"]["kwargs"] == {"judge": {"api_key": REDACTED, "model": "m"}, "HF_TOKEN": REDACTED, "size": 3}
    assert shared["env"]["name"] == f"openenv:https://bob:{REDACTED}@envs.example.org/echo"
    assert shared["rollout"] == {"max_new_tokens": 64, "tasks": 4}  # a count of tokens is no token
    assert shared["run"] == {"description": f"uses {REDACTED} by mistake", "trackers": ["wandb"]}


def test_no_shared_artifact_holds_a_servers_secret_and_the_run_still_resumes(tmp_path):
    runs = tmp_path / "runs"
    (tmp_path / "pids").mkdir()
    server = [sys.executable, str(tmp_path / "server.py"), str(tmp_path / "pids")]
    secrets = {"SEARCH_API_KEY": SECRET, "API_BASE": f"https://bob:{PASSWORD}@search.example.org"}
    recipe = tool_recipe(tmp_path, workers=0, tasks=2, mcp_servers=[{"command": server, "env": secrets}])
    rollout = ["rollout", "-r", str(recipe), "--policy", "expert"]
    assert (done := run_in_process(rollout, runs, cwd=REPO)).returncode == 0, done.stderr

    exported, report = tmp_path / "export", tmp_path / "report.html"
    for command in (
        ["runs", "export", "t", "--out", exported],
        ["runs", "export", "t", "--push-to-hub", "me/episodes", "--dry-run"],
        ["runs", "report", "t", "--html", report, "-n", "1"],
    ):
        assert (done := run_in_process(command, runs, cwd=REPO)).returncode == 0, (command, done.stderr)
    shared = [*exported.iterdir(), *(runs / "t" / "hub-dataset").iterdir(), report]
    assert {"run.json", "README.md", "rlcli-recipe.yaml", "report.html"} <= {path.name for path in shared}
    for path in shared:
        data = path.read_bytes()
        assert SECRET.encode() not in data and PASSWORD.encode() not in data, path
    assert "SEARCH_API_KEY: <redacted>" in (runs / "t" / "hub-dataset" / "rlcli-recipe.yaml").read_text()

    # The database keeps the recipe whole: a second call resumes the run, its server given its keys.
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        (stored,) = conn.execute("select recipe from runs where name = 't'").fetchone()
    assert SECRET in stored and PASSWORD in stored
    again = run_in_process(rollout, runs, cwd=REPO)
    assert again.returncode == 0 and "different recipe" not in again.stderr, again.stderr
