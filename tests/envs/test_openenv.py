"""openenv:<url-or-module> (issue 39): OpenEnv environment servers as rlcli envs, through real servers.

The servers are real: rlcli.envs.openenv_guess (the shipped example) and the apps of
tests/openenv_test_envs.py, each served by the adapter with uvicorn in a subprocess. A server's start
costs seconds (importing openenv imports gradio), so this process's servers are kept between the
tests and stopped at the end of the module.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from helpers import REPO, cli, kill_at_event, run_in_process, write_recipe
from rlcli.envs.adapters import openenv as adapter
from rlcli.envs.loading import load_env
from rlcli.envs.protocol import EnvTimeout
from rlcli.envs.workers import InProcessEnvs

GUESS = "openenv:rlcli.envs.openenv_guess"


@pytest.fixture(autouse=True, scope="module")
def _stop_the_servers():
    yield
    adapter.close_servers()


def guess_recipe(folder: Path, **env) -> Path:
    return write_recipe(
        folder / "r.yaml",
        env={"name": GUESS, "kwargs": {"high": 8}, "max_turns": 3, **env},
        rollout={"tasks": 3, "group_size": 2, "batch_size": 2, "max_new_tokens": 8},
        eval={"tasks": 3},
    )


def episodes(runs: Path) -> list[tuple]:
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        rows = conn.execute(
            "select stage, task_index, sample_index, status, env_return, messages from episodes order by 1, 2, 3"
        ).fetchall()
    return [(*key, json.loads(messages)) for *key, messages in rows]


def servers_of(runs: Path) -> list[int]:
    """The OpenEnv servers alive that an rlcli with RLCLI_HOME=runs started (the adapter marks their
    command line; a server has its rlcli's environment)."""
    mine = f"RLCLI_HOME={runs}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            server = proc.name.isdigit() and b"rlcli-openenv-server" in (proc / "cmdline").read_bytes()
            if server and mine in (proc / "environ").read_bytes() + b"\0":
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def wait_for_no_servers(runs: Path, timeout: float = 10.0) -> list[int]:
    deadline = time.time() + timeout
    while (alive := servers_of(runs)) and time.time() < deadline:
        time.sleep(0.1)
    return alive


def test_a_killed_rollout_leaves_no_server_and_resumes_to_the_uninterrupted_episodes(tmp_path):
    adapter.close_servers()  # the clean run starts its own server: the look for servers must see it
    clean = tmp_path / "clean"
    clean.mkdir()
    args = ["rollout", "-r", str(guess_recipe(clean)), "--policy", "base"]
    assert run_in_process(args, clean / "runs", cwd=REPO).returncode == 0
    assert servers_of(clean / "runs"), "the clean run's server is not seen, so no leftover would be"
    played = episodes(clean / "runs")
    assert len(played) == 6 and all(status == "ok" for _, _, _, status, _, _ in played)
    first = played[0][5]
    assert first[0] == {"role": "user", "content": first[0]["content"]} and "from 1 to 8" in first[0]["content"]
    assert len(first) == 1 + 2 * 3  # three turns: a reply and the server's answer each

    killed = tmp_path / "killed"
    killed.mkdir()
    args = ["rollout", "-r", str(guess_recipe(killed)), "--policy", "base"]
    kill_at_event(args, killed / "runs", {"sql": "select count(*) from episodes", "at_least": 2}, cwd=REPO)
    assert wait_for_no_servers(killed / "runs") == [], "an OpenEnv server outlived rlcli's kill -9"
    assert 2 <= len(episodes(killed / "runs")) < 6
    assert run_in_process(args, killed / "runs", cwd=REPO).returncode == 0
    assert episodes(killed / "runs") == played  # complete, none twice, as if never killed


def test_envs_try_plays_the_example_with_random_replies(capsys):
    code, out, err = cli(capsys, "envs", "try", GUESS, "--policy", "random", "--seed", "2")
    assert code == 0, err
    assert "Guess it in at most 4 guesses" in out and "No guesses left: it was" in out
    assert "not solved in 4 turns, return 0" in out


def test_eval_through_an_openenv_server(tmp_path):
    runs = tmp_path / "runs"
    out = run_in_process(["eval", "-r", str(guess_recipe(tmp_path)), "-c", "base", "--json"], runs, cwd=REPO)
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    assert row["checkpoint"] == "base" and row["tasks"] == 3
    played = episodes(runs)
    assert len(played) == 3 and {stage for stage, *_ in played} == {"eval/base"}
    assert all(status == "ok" for _, _, _, status, _, _ in played)


def closed_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("URL", {}, "no OpenEnv server answers at http://127.0.0.1:"),
        ("openenv:no_such_openenv_env.server.app", {}, "pip install openenv-no-such-openenv-env"),
        ("openenv:openenv_test_envs:counter", {}, "CountAction requires count (integer) besides word"),
        ("openenv:rlcli.envs.nosuch", {}, "cannot load rlcli.envs.nosuch:app: ModuleNotFoundError"),
        (GUESS, {"low": 9, "high": 3}, "its reset with env.kwargs {'high': 3, 'low': 9} failed: expected low < high"),
        (GUESS, {"seed": 3}, "env.kwargs.seed: rlcli sends each episode's own"),
    ],
)
def test_bad_input_exits_2_before_any_stage_in_one_sentence(tmp_path, name, kwargs, expected):
    from rlcli.store.db import RunDB

    if name == "URL":
        name = f"openenv:http://127.0.0.1:{closed_port()}"
    runs = tmp_path / "runs"
    RunDB.open(runs).close()
    before = hashlib.sha256((runs / "rlcli.db").read_bytes()).hexdigest()
    recipe = guess_recipe(tmp_path, name=name, kwargs=kwargs)
    result = run_in_process(["rollout", "-r", str(recipe)], runs, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and result.stderr.strip().endswith(".")  # one sentence
    assert hashlib.sha256((runs / "rlcli.db").read_bytes()).hexdigest() == before
    if "openenv_test_envs" in name:
        assert not any((p.target or "").startswith("openenv_test_envs:") for p in adapter._pools.values())


def test_sessions_failures_and_time_outs_of_a_server_holding_one_session():
    """Each episode has a session of its own: a server that holds one (create_app's default) gets
    company for the second. A time-out or a server's death fails only that episode, with its reason;
    a reply the action refuses gets feedback; the next episode gets a fresh server."""
    factory = load_env("openenv:openenv_test_envs:trouble")
    pool = next(p for p in adapter._pools.values() if p.target == "openenv_test_envs:trouble")
    a, b = factory(), factory()
    assert a.reset(0) == (
        "ready 0",
        {"task": {"env": "openenv:openenv_test_envs:trouble", "seed": 0, "observation": {"echoed": "ready 0"}}},
    )
    assert b.reset(1)[0] == "ready 1"
    first, second = pool.servers
    assert (first.sessions, second.sessions, first.capacity) == (1, 1, 1)  # a second server for b
    assert a.step("hello")[:4] == ("hello", 1.0, False, False)
    assert b.step("world")[:4] == ("world", 1.0, False, False)
    text, reward, terminated, _, info = b.step("x" * 50)
    assert text.startswith("Invalid action (message: String should have at most 40 characters")
    assert (reward, terminated, info["valid"]) == (-1.0, False, False)

    with InProcessEnvs(lambda: a, 1.0) as envs:  # a's step outlasts env.step_timeout_s
        envs.envs[0] = a
        envs.step(0, "sleep")
        [reply] = envs.replies()
    assert isinstance(reply.failure, EnvTimeout)
    with InProcessEnvs(lambda: b, 30.0) as envs:  # b's server dies mid-step
        envs.envs[0] = b
        envs.step(0, "die")
        [reply] = envs.replies()
    assert "the OpenEnv server for openenv_test_envs:trouble" in str(reply.failure)
    assert f"(pid {second.proc.pid}) ended: it exited with status 3" in str(reply.failure)

    c = factory()  # the dead server is dropped; the first is busy with a's sleeping step: a third
    assert c.reset(2)[0] == "ready 2"
    assert c.step("stop")[:5] == (
        "stop",
        1.0,
        True,
        False,
        {"valid": True, "observation": {"echoed": "stop"}, "success": True},
    )
    assert len(pool.servers) == 2 and pool.servers[0] is first and not second.alive()
    with pytest.raises(RuntimeError, match="step without a session"):
        c.step("again")  # a done episode's session is closed
