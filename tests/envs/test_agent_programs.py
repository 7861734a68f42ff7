"""Agent programs as environments (env.name agent:file.py:function and agent-cmd): agents written only
against the `openai` package, run by `rlcli rollout` on the tiny model through rlcli's endpoint; their
calls are stored token-exact as the episode's turns (engine/agent_runner.py)."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
import textwrap
import time

import pytest

from helpers import alive, cli, make_ctx, run_in_process, write_recipe
from rlcli.engine.grpo.batch import episode_sequences
from rlcli.engine.rollout import run_rollout_stage
from rlcli.store.blobs import unpack_floats, unpack_ids
from rlcli.store.records import Turn

# Each agent writes what the endpoint answered it to a file of its own in task["out"], for the test to
# compare with what rlcli stored.
AGENTS = '''
import asyncio, json, os, time, uuid

from openai import AsyncOpenAI, OpenAI


def _save(task, replies):
    with open(os.path.join(task["out"], f"{task['seed']}-{uuid.uuid4().hex}.json"), "w") as f:
        json.dump(replies, f)


def _reply(response):
    choice = response.choices[0]
    return {"content": choice.message.content, "logprobs": [t.logprob for t in choice.logprobs.content]}


def one_call(client, task):
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    response = api.chat.completions.create(
        model=client["model"], messages=[{"role": "user", "content": f"Task {task['seed']}."}], logprobs=True
    )
    _save(task, [_reply(response)])
    return {"reward": 1.0 if task["seed"] == 0 else 0.25, "success": task["seed"] == 0}


async def two_calls(client, task):
    """The second call carries the first reply back and goes on: one multi-turn sequence."""
    api = AsyncOpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "Count."}]
    first = await api.chat.completions.create(model=client["model"], messages=messages, logprobs=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}]
    second = await api.chat.completions.create(model=client["model"], messages=messages, logprobs=True)
    _save(task, [_reply(first), _reply(second)])
    return None  # the recipe's reward functions score the transcript


def rewrites_history(client, task):
    """The second call replaces the conversation by a summary: a new segment."""
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    first = api.chat.completions.create(model=client["model"], messages=[{"role": "user", "content": "Plan."}])
    summary = [{"role": "system", "content": "Summary so far."}, {"role": "user", "content": "Act."}]
    second = api.chat.completions.create(model=client["model"], messages=summary)
    return 0.5


def graded(client, task):
    """A reward that differs within a group: how unlikely the reply was."""
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    response = api.chat.completions.create(
        model=client["model"], messages=[{"role": "user", "content": "Go."}], logprobs=True
    )
    return -sum(t.logprob for t in response.choices[0].logprobs.content) / 10


def leaves_a_process(client, task):
    """Starts a process that would call the endpoint (and leave a mark) after the agent has returned."""
    import subprocess, sys

    mark = os.path.join(task["out"], f"late-{task['seed']}")
    late = (
        f"import time; from openai import OpenAI; time.sleep(3); open({mark!r}, 'w').close(); "
        "OpenAI(max_retries=0).chat.completions.create(model='m', messages=[{'role': 'user', 'content': 'Late.'}])"
    )
    subprocess.Popen([sys.executable, "-c", late])
    one_call(client, task)
    return 1.0


def keeps_calling(client, task):
    """Five calls, past env.max_turns; task 1 catches the refusal and returns a reward anyway."""
    import openai

    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    for n in range(5):
        try:
            api.chat.completions.create(model=client["model"], messages=[{"role": "user", "content": f"Call {n}."}])
        except openai.BadRequestError as exc:
            if task["seed"] == 1:
                assert "env.max_turns allows 2" in str(exc)
                return 0.75
            raise
    return 1.0


def snoops(client, task):
    """Calls the endpoint, then reads a file outside the folder rlcli runs in and connects to a port of this
    machine: 1 for the file, 10 for the port."""
    import socket

    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    api.chat.completions.create(model=client["model"], messages=[{"role": "user", "content": "Hi."}])
    seen = 0.0
    try:
        open(task["secret"]).read()
        seen += 1
    except OSError:
        pass
    try:
        socket.create_connection(("127.0.0.1", task["port"]), timeout=5).close()
        seen += 10
    except OSError:
        pass
    return seen


def scored_by_its_row(client, task):
    """Asks the row's question; its reward is the row's value plus env.kwargs' bonus."""
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    api.chat.completions.create(model=client["model"], messages=[{"role": "user", "content": task["question"]}])
    return task["value"] + task["bonus"]


def overreaches(client, task):
    """Task 0 plays; 1 maps more memory than env.worker_memory_mb, 2 spins past env.worker_cpu_s."""
    if task["seed"] == 1:
        blob = bytearray(4 << 30)
    if task["seed"] == 2:
        while True:
            pass
    return one_call(client, task)


def kills_its_server(client, task):
    """Each episode calls once and notes its pid; the first to finish kills the process the episodes are
    forked from once the others have ended (reaped: gone from /proc), then waits to be killed with it."""
    reply = one_call(client, task)
    open(os.path.join(task["out"], f"pid-{os.getpid()}"), "w").close()
    try:
        mark = os.open(os.path.join(task["out"], "killer"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return reply
    os.write(mark, str(os.getpid()).encode())
    os.close(mark)
    for _ in range(600):
        others = [int(n[4:]) for n in os.listdir(task["out"]) if n.startswith("pid-") and n != f"pid-{os.getpid()}"]
        if len(others) == 3 and not any(os.path.exists(f"/proc/{pid}") for pid in others):
            break
        time.sleep(0.05)
    time.sleep(0.5)  # the server reports an episode's end just after reaping it
    os.kill(os.getppid(), 9)
    time.sleep(120)


def sets_its_own_sampling(client, task):
    """Asks for two tokens, greedy."""
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    api.chat.completions.create(
        model=client["model"], messages=[{"role": "user", "content": "Go."}], max_tokens=2, temperature=0, seed=7
    )
    return 1.0


def misbehaves(client, task):
    """Task 0 plays; 1 crashes, 2 hangs, 3 never calls the endpoint."""
    if task["seed"] == 1:
        raise RuntimeError("the agent broke")
    if task["seed"] == 2:
        time.sleep(120)
    if task["seed"] == 3:
        return 1.0
    return one_call(client, task)
'''

COMMAND = """
import json, os, sys

from openai import OpenAI

task = json.loads(sys.stdin.read())
api = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
api.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "Hi."}])
print("some output of the agent's own")
print(json.dumps({"reward": task["seed"] + 0.5, "success": False}))
"""


def _agents(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(textwrap.dedent(AGENTS))
    out = tmp_path / "replies"
    out.mkdir()
    return path, out


def _recipe(tmp_path, env, **rollout):
    return write_recipe(
        tmp_path / "r.yaml",
        env=env,
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4, "temperature": 1.0, **rollout},
    )


def _stored(ctx, stage="rollout"):
    episodes = list(
        ctx.rundb.db.query("select * from episodes where run = ? and stage = ? order by id", [ctx.run, stage])
    )
    turns = {
        e["id"]: list(ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [e["id"]]))
        for e in episodes
    }
    return episodes, turns


def _played(tmp_path, env, **rollout):
    """A train rollout of env with _recipe's settings (rollout replacing them): its episodes and turns."""
    ctx = make_ctx(_recipe(tmp_path, env, **rollout), tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    return _stored(ctx)


def _turn(row) -> Turn:
    return Turn(
        turn_index=row["turn_index"],
        prompt_ids=unpack_ids(row["prompt_ids"]),
        completion_ids=unpack_ids(row["completion_ids"]),
        logprobs=unpack_floats(row["logprobs"]),
    )


def test_an_openai_agents_turns_are_what_the_endpoint_returned(tmp_path):
    path, out = _agents(tmp_path)
    ctx = make_ctx(
        _recipe(tmp_path, {"name": f"agent:{path}:one_call", "kwargs": {"out": str(out)}}), tmp_path / "runs"
    )
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert summary.episodes == 4
    episodes, turns = _stored(ctx)
    tokenizer = _tokenizer()
    returned = sorted((r["content"], tuple(r["logprobs"])) for f in out.iterdir() for r in json.loads(f.read_text()))
    stored = sorted(
        (
            tokenizer.decode(unpack_ids(t["completion_ids"]), skip_special_tokens=True),
            tuple(unpack_floats(t["logprobs"])),
        )
        for e in episodes
        for t in turns[e["id"]]
    )
    assert len(returned) == 4 and stored == returned
    assert all(e["status"] == "ok" and e["num_turns"] == 1 and e["template_consistent"] for e in episodes)
    by_task = {e["task_index"]: (e["env_return"], e["success"]) for e in episodes}
    assert by_task == {0: (1.0, 1), 1: (0.25, 0)}
    assert {json.loads(e["task"])["seed"] for e in episodes} == {0, 1}
    # The transcript: the request's messages, then the reply.
    messages = json.loads(episodes[0]["messages"])
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == tokenizer.decode(
        unpack_ids(turns[episodes[0]["id"]][0]["completion_ids"]), skip_special_tokens=True
    )


def test_calls_that_extend_each_other_are_one_sequence_and_a_rewritten_history_is_segments(tmp_path, capsys):
    path, out = _agents(tmp_path)
    ctx = make_ctx(
        _recipe(tmp_path, {"name": f"agent:{path}:two_calls", "kwargs": {"out": str(out)}}), tmp_path / "runs"
    )
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    episodes, turns = _stored(ctx)
    assert len(episodes) == 4
    for e in episodes:
        rows = turns[e["id"]]
        assert e["status"] == "ok" and len(rows) == 2
        first, second = (_turn(r) for r in rows)
        # The client sends the reply back as text without special tokens (the random model samples some in
        # its middle); the endpoint writes the reply back as sampled, so the second call extends the first.
        assert e["template_consistent"]
        info = [json.loads(r["info"]) for r in rows]
        assert info[1]["follows"] == info[0]["call"] and info[1]["extends"] == info[0]["call"]
        assert [m["role"] for m in json.loads(e["messages"])] == ["user", "assistant", "user", "assistant"]
        # The second prompt is the first prompt and reply, token for token, then the new message.
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        [sequence] = episode_sequences(e["id"], 0, [first, second])
        assert sum(sequence.mask) == len(first.completion_ids) + len(second.completion_ids)

    ctx = make_ctx(_recipe(tmp_path, {"name": f"agent:{path}:rewrites_history"}), tmp_path / "runs2")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    # `runs episodes` says how many calls an episode made and how they train.
    code, out, err = cli(capsys, "--runs-dir", tmp_path / "runs2", "runs", "episodes", ctx.run, "-n", "1")
    text = " ".join(out.replace("│", " ").split())  # the panel's lines, wrapped at the terminal's width
    assert code == 0 and "endpoint calls 2 (prompt+sampled tokens: " in text, err
    assert "2 training sequences, one a call · call 2 starts anew" in text
    episodes, turns = _stored(ctx)
    for e in episodes:
        assert e["status"] == "ok" and e["template_consistent"] == 0 and e["env_return"] == 0.5
        segments = episode_sequences(e["id"], 0, [_turn(r) for r in turns[e["id"]]])
        assert len(segments) == 2
        assert [s.ids for s in segments] == [
            unpack_ids(r["prompt_ids"]) + unpack_ids(r["completion_ids"]) for r in turns[e["id"]]
        ]


def test_an_agent_that_returns_none_is_scored_by_the_recipes_reward_functions(tmp_path):
    from rlcli.engine.labelling import label_stage_episodes

    path, out = _agents(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def reply_length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": f"agent:{path}:two_calls", "kwargs": {"out": str(out)}},
        rollout={"tasks": 1, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
        rewards=[{"fn": f"{tmp_path / 'my_rewards.py'}:reply_length", "name": "reply_length"}],
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    label_stage_episodes(ctx, "rollout", "default")
    episodes, _ = _stored(ctx)
    # The transcript scored: the last call's messages and its reply, whose text is the agent's last reply.
    last_replies = {json.dumps(r[1]["content"]) for f in out.iterdir() for r in [json.loads(f.read_text())]}
    for e in episodes:
        assert e["env_return"] == 0.0
        messages = json.loads(e["messages"])
        assert json.dumps(messages[-1]["content"]) in last_replies
        rows = list(ctx.rundb.db.query("select component, value from rewards where episode_id = ?", [e["id"]]))
        assert {r["component"]: r["value"] for r in rows} == {
            "reply_length": len(messages[-1]["content"]),
            "total": len(messages[-1]["content"]),
        }


def test_an_agent_that_crashes_hangs_or_never_calls_fails_only_its_episode(tmp_path):
    path, out = _agents(tmp_path)
    recipe = _recipe(
        tmp_path,
        # The hanging agent is stopped at 6 s: the others are forked from a process that has imported them,
        # so they start at once, and the one that calls is answered within the batch's 2 s wait.
        {"name": f"agent:{path}:misbehaves", "kwargs": {"out": str(out)}, "step_timeout_s": 6},
        tasks=4,
        group_size=1,
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    episodes, turns = _stored(ctx)
    by_task = {e["task_index"]: e for e in episodes}
    assert by_task[0]["status"] == "ok" and len(turns[by_task[0]["id"]]) == 1, by_task[0]["error"]
    assert by_task[1]["status"] == "failed" and "RuntimeError: the agent broke" in by_task[1]["error"]
    assert by_task[2]["end_reason"] == "env_timeout" and "env.step_timeout_s (6 s)" in by_task[2]["error"]
    assert by_task[3]["status"] == "failed" and "never called the endpoint" in by_task[3]["error"]


def test_what_an_agent_started_ends_with_its_episode(tmp_path):
    path, out = _agents(tmp_path)
    episodes, turns = _played(
        tmp_path, {"name": f"agent:{path}:leaves_a_process", "kwargs": {"out": str(out)}}, group_size=1
    )
    assert [(e["status"], len(turns[e["id"]])) for e in episodes] == [("ok", 1), ("ok", 1)]
    time.sleep(4)  # past the moment the processes the agents started would have called
    assert not list(out.glob("late-*"))


def test_episodes_lost_with_the_process_they_are_forked_from_are_played_again(tmp_path):
    path, out = _agents(tmp_path)
    episodes, turns = _played(
        tmp_path, {"name": f"agent:{path}:kills_its_server", "kwargs": {"out": str(out)}}, group_size=2
    )
    assert [(e["status"], len(turns[e["id"]])) for e in episodes] == [("ok", 1)] * 4, [e["error"] for e in episodes]
    [lost] = [e for e in episodes if e["lost"]]  # the killer's episode, played again
    assert lost["attempts"] == 2 and "forked from ended (exit code -9" in lost["earlier_errors"]
    killer = int((out / "killer").read_text())
    assert not alive(killer), "the lost episode's process is killed with its server"


# An agent whose module notes each process that imports it, and each episode's process.
COUNTED = """
import os

from openai import OpenAI

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "imports"), "a") as f:
    f.write(f"{os.getpid()}\\n")


def solve(client, task):
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    api.chat.completions.create(model=client["model"], messages=[{"role": "user", "content": "Hi."}])
    with open(os.path.join(HERE, "episodes"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return 1.0
"""


def test_a_callable_agent_is_imported_once_and_each_episode_forked_from_it(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "counted.py").write_text(COUNTED)
    episodes, turns = _played(
        tmp_path, {"name": f"agent:{folder / 'counted.py'}:solve"}, tasks=3, group_size=2, batch_size=6
    )
    assert [(e["status"], len(turns[e["id"]])) for e in episodes] == [("ok", 1)] * 6
    # Imported by rlcli's own check of the recipe (this process) and once by the process the episodes are
    # forked from; each episode still ran in a process of its own.
    imports = (folder / "imports").read_text().split()
    servers = [pid for pid in imports if pid != str(os.getpid())]
    players = (folder / "episodes").read_text().split()
    assert len(servers) == 1
    assert len(set(players)) == 6 and not set(players) & {*imports}


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_an_agent_command_gets_the_endpoint_in_its_environment(tmp_path, sandbox):
    from rlcli.envs.sandbox import bwrap_problem

    if sandbox == "bwrap" and (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    script = tmp_path / "agent_cmd.py"
    script.write_text(textwrap.dedent(COMMAND))
    env = {"name": "agent-cmd", "command": [sys.executable, str(script)], "sandbox": sandbox}
    episodes, turns = _played(tmp_path, env, group_size=1)
    assert [(e["status"], e["env_return"], e["success"]) for e in episodes] == [("ok", 0.5, 0), ("ok", 1.5, 0)]
    assert all(len(turns[e["id"]]) == 1 for e in episodes)


def test_a_missing_callable_or_program_is_refused_before_any_stage(tmp_path, capsys):
    path, _ = _agents(tmp_path)
    rows, bad = tmp_path / "rows.jsonl", tmp_path / "bad.jsonl"
    rows.write_text('{"question": "Q?"}\n')
    bad.write_text('{"question": "Q?"}\n[1, 2]\n')
    for env, expected in [
        ({"name": f"agent:{path}:no_such_function"}, "defines no function 'no_such_function'"),
        ({"name": f"agent:{tmp_path}/nowhere.py:solve"}, "no file"),
        ({"name": "agent-cmd", "command": ["rlcli-no-such-program"]}, "no program 'rlcli-no-such-program'"),
        ({"name": "agent-cmd"}, "env.command, which is empty"),
        ({"name": f"agent:{path}:one_call", "command": ["python"]}, "expected env.name agent-cmd to run it"),
        ({"name": f"agent:{path}:one_call", "tools": ["python_exec"]}, "which passes its own tools"),
        ({"name": f"agent:{path}:one_call", "task_data": {"train": str(path)}}, "has an unknown suffix"),
        ({"name": f"agent:{path}:one_call", "task_data": {"train": str(rows)}}, "which has no held-out split"),
        ({"name": f"agent:{path}:one_call", "task_data": {"train": str(rows), "eval": str(bad)}}, "row 2 is list"),
        ({"name": f"agent:{path}:one_call", "workers": 2}, "expected env.workers 0"),
        ({"name": "guess_number", "task_data": {"train": str(rows)}}, "expected env.task_data null"),
    ]:
        recipe = _recipe(tmp_path, env)
        code, _, err = cli(capsys, "rollout", "-r", recipe)
        line = " ".join(err.split())
        assert code == 2 and expected in line and "Traceback" not in err, err


def test_an_agents_tasks_come_from_data_files_with_held_out_rows_apart(tmp_path):
    path, _ = _agents(tmp_path)
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text("".join(json.dumps({"question": f"Q{v}?", "value": v}) + "\n" for v in (0, 1)))
    held_out.write_text(json.dumps({"question": "Held out?", "value": 7}) + "\n")
    env = {
        "name": f"agent:{path}:scored_by_its_row",
        "kwargs": {"bonus": 0.5},
        "task_data": {"train": str(train), "eval": str(held_out)},
    }
    ctx = make_ctx(_recipe(tmp_path, env, tasks=3, group_size=1), tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    run_rollout_stage(ctx, stage="held", policy="base", split="eval")
    # Training seeds 0, 1, 2 play rows 0, 1, 0; held-out seeds play the held-out file's rows.
    assert [(e["status"], e["env_return"]) for e in _stored(ctx)[0]] == [("ok", 0.5), ("ok", 1.5), ("ok", 0.5)]
    assert {(e["status"], e["env_return"]) for e in _stored(ctx, "held")[0]} == {("ok", 7.5)}


def test_a_run_resumed_on_changed_task_files_says_so(tmp_path):
    """Task files are watched as env and reward files are: the same seeds would now play other rows."""
    path, _ = _agents(tmp_path)
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text(json.dumps({"question": "Q?", "value": 1}) + "\n")
    held_out.write_text(json.dumps({"question": "Held out?", "value": 7}) + "\n")
    env = {"name": f"agent:{path}:scored_by_its_row", "kwargs": {"bonus": 0.0}}
    recipe = _recipe(
        tmp_path, {**env, "task_data": {"train": str(train), "eval": str(held_out)}}, tasks=1, group_size=1
    )
    first = run_in_process(["rollout", "-r", recipe, "--policy", "base", "--stage", "a"], tmp_path / "runs")
    assert first.returncode == 0, first.stderr
    train.write_text(json.dumps({"question": "Q?", "value": 2}) + "\n")
    second = run_in_process(["rollout", "-r", recipe, "--policy", "base", "--stage", "b"], tmp_path / "runs")
    assert second.returncode == 0, second.stderr
    assert f"warning: {train} changed since run" in " ".join(second.stderr.split())
    assert "held_out.jsonl changed" not in second.stderr


def test_an_agents_tasks_come_from_a_cached_hub_dataset(tmp_path, monkeypatch):
    import datasets

    from helpers import cache_hub_dataset

    cache = tmp_path / "hf-datasets"
    cache.mkdir()
    cache_hub_dataset(cache, "rlcli-test/tiny_tasks", {"question": ["A?", "B?", "C?"], "value": [1.0, 2.0, 3.0]})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    path, _ = _agents(tmp_path)
    env = {
        "name": f"agent:{path}:scored_by_its_row",
        "kwargs": {"bonus": 0.0},
        "task_data": {"train": "hub:rlcli-test/tiny_tasks", "train_split": "train[:2]", "eval_split": "train[2:]"},
    }
    ctx = make_ctx(_recipe(tmp_path, env, tasks=2, group_size=1), tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    run_rollout_stage(ctx, stage="held", policy="base", split="eval")
    assert [e["env_return"] for e in _stored(ctx)[0]] == [1.0, 2.0]
    assert {e["env_return"] for e in _stored(ctx, "held")[0]} == {3.0}


@pytest.mark.parametrize("form", ["callable", "command"])
def test_an_agent_past_its_memory_or_cpu_limit_fails_only_its_episode(tmp_path, form):
    path, out = _agents(tmp_path)
    limits = {"worker_memory_mb": 1024, "worker_cpu_s": 1, "step_timeout_s": 60}
    if form == "callable":
        env = {"name": f"agent:{path}:overreaches", "kwargs": {"out": str(out)}, **limits}
    else:  # a program that spins: stopped by the CPU limit, not the time limit
        env = {"name": "agent-cmd", "command": [sys.executable, "-c", "while True: pass"], **limits}
    ctx = make_ctx(_recipe(tmp_path, env, tasks=3 if form == "callable" else 1, group_size=1), tmp_path / "runs")
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    by_task = {e["task_index"]: e for e in _stored(ctx)[0]}
    spinner = by_task[2 if form == "callable" else 0]
    assert spinner["status"] == "failed" and "more than env.worker_cpu_s=1 CPU seconds" in spinner["error"]
    if form == "callable":
        assert by_task[0]["status"] == "ok", by_task[0]["error"]
        assert by_task[1]["status"] == "failed" and "MemoryError (env.worker_memory_mb=1024" in by_task[1]["error"]


@pytest.mark.parametrize("request_sampling", ["recipe", "request"])
def test_a_calls_own_sampling_settings_apply_only_where_the_recipe_lets_them(tmp_path, request_sampling):
    path, _ = _agents(tmp_path)
    env = {"name": f"agent:{path}:sets_its_own_sampling"}
    episodes, turns = _played(tmp_path, env, group_size=4, request_sampling=request_sampling)
    replies = [unpack_ids(turns[e["id"]][0]["completion_ids"]) for e in episodes if e["task_index"] == 0]
    if request_sampling == "request":  # two tokens, greedy and seeded: the group's four replies alike
        assert len({tuple(r) for r in replies}) == 1 and all(len(r) <= 2 for r in replies)
    else:  # the recipe's temperature 1 and 6 tokens: the group's replies differ
        assert len({tuple(r) for r in replies}) > 1 and max(len(r) for r in replies) > 2


def _tokenizer():
    from transformers import AutoTokenizer

    from rlcli.models.cache import tiny_random_path

    return AutoTokenizer.from_pretrained(tiny_random_path())


def test_an_agents_episodes_do_not_depend_on_how_they_are_batched(tmp_path):
    """Each call's seed comes from run.seed, the episode's sample seed and the call's number in it: a
    resumed stage (which replays a chunk) or another batch size samples the same tokens."""
    path, out = _agents(tmp_path)
    env = {"name": f"agent:{path}:one_call", "kwargs": {"out": str(out)}}
    tokens = []
    for size in (4, 1):
        ctx = make_ctx(_recipe(tmp_path, env, batch_size=size), tmp_path / f"runs{size}")
        run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
        episodes, turns = _stored(ctx)
        tokens.append({(e["task_index"], e["sample_index"]): turns[e["id"]][0]["completion_ids"] for e in episodes})
    assert tokens[0] == tokens[1] and len(set(tokens[0].values())) == 4


def test_a_grpo_iteration_trains_on_an_agents_episodes(tmp_path, capsys, rlcli_home):
    path, _ = _agents(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": f"agent:{path}:graded"},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4, "temperature": 1.0},
        grpo={"iterations": 1},
    )
    code, _, err = cli(capsys, "train", "grpo", "-r", recipe)
    assert code == 0, err
    [db_file] = rlcli_home.glob("*.db")
    with sqlite3.connect(db_file) as db:
        returns = [r for (r,) in db.execute("select env_return from episodes where status = 'ok'")]
        metrics = dict(db.execute("select key, value from metrics where stage = 'grpo'").fetchall())
    assert len(returns) == 4 and len(set(returns)) == 4
    assert metrics["train/groups"] == 2 and metrics["train/zero_var_groups"] == 0
    assert metrics["rollout/reward_mean"] == pytest.approx(sum(returns) / 4)
    assert math.isfinite(metrics["train/loss"])
    # Held-out tasks: the eval seeds, as for every env.
    code, _, err = cli(capsys, "eval", "-r", recipe)
    assert code == 0, err
    with sqlite3.connect(db_file) as db:
        tasks = [json.loads(t) for (t,) in db.execute("select task from episodes where split = 'eval'")]
    assert tasks and all(t["seed"] >= 1_000_000 for t in tasks)


def test_the_agents_file_is_hashed_with_the_run_like_an_env_file():
    from rlcli.usercode import code_files

    assert code_files("agent:agents/my_agent.py:solve", ["rewards.py:fn"]) == ["agents/my_agent.py", "rewards.py"]
    assert code_files("agent-cmd", []) == []


def test_the_shipped_multihop_agent_shows_the_policy_what_the_env_form_shows(tmp_path):
    """recipes/multihop_search_agent.yaml's agent, given as a module: its first call's prompt is, token for
    token, the first turn's prompt of the multihop_search env for the same task; it stops after max_calls."""
    kwargs = {"corpus_seed": 0, "corpus_size": 60, "hops": 1}
    rollout = {"tasks": 2, "group_size": 1, "max_new_tokens": 6, "batch_size": 2, "temperature": 1.0}
    model = {"max_length": 1024}  # the tiny byte-level tokenizer takes ~620 tokens for the system prompt and question
    agent = write_recipe(
        tmp_path / "agent.yaml",
        env={"name": "agent:rlcli.builtin_envs.agents.multihop_search:solve", "kwargs": {**kwargs, "max_calls": 2}},
        rollout=rollout,
        model=model,
    )
    env = write_recipe(
        tmp_path / "env.yaml",
        env={"name": "multihop_search", "kwargs": kwargs, "max_turns": 2},
        rollout=rollout,
        model=model,
    )
    first_prompts = []
    for recipe, runs in ((agent, "agent"), (env, "env")):
        ctx = make_ctx(recipe, tmp_path / runs)
        run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
        episodes, turns = _stored(ctx)
        assert [e["status"] for e in episodes] == ["ok", "ok"], [e["error"] for e in episodes]
        assert all(len(turns[e["id"]]) == 2 for e in episodes)  # the random model neither answers nor calls
        first_prompts.append({e["task_index"]: turns[e["id"]][0]["prompt_ids"] for e in episodes})
    assert first_prompts[0] == first_prompts[1]


def test_an_agents_calls_past_max_turns_are_refused_and_the_episode_ends_there(tmp_path):
    path, _ = _agents(tmp_path)
    ctx = make_ctx(
        _recipe(tmp_path, {"name": f"agent:{path}:keeps_calling", "max_turns": 2}, group_size=1, batch_size=2),
        tmp_path / "runs",
    )
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    episodes, turns = _stored(ctx)
    assert [(e["status"], e["end_reason"], len(turns[e["id"]])) for e in episodes] == [("ok", "max_turns", 2)] * 2
    # Task 0's agent failed on the refusal: it trains as a failure; task 1's returned a reward anyway.
    assert {e["task_index"]: e["env_return"] for e in episodes} == {0: 0.0, 1: 0.75}


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_an_agent_in_bubblewrap_reaches_the_endpoint_and_nothing_else(tmp_path, sandbox):
    """env.sandbox bwrap: the agent's calls reach the endpoint (through its Unix socket), while a file outside
    the folder rlcli runs in and a port of this machine's 127.0.0.1 do not; with none, both do."""
    import socket

    from rlcli.envs.sandbox import bwrap_problem

    if sandbox == "bwrap" and (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    (tmp_path / "agent").mkdir()
    path, _ = _agents(tmp_path / "agent")  # the sandbox shows the agent's folder, and not the one beside it
    secret = tmp_path / "home" / "secret"
    secret.parent.mkdir()
    secret.write_text("key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        kwargs = {"secret": str(secret), "port": listener.getsockname()[1]}
        recipe = _recipe(
            tmp_path, {"name": f"agent:{path}:snoops", "kwargs": kwargs, "sandbox": sandbox}, group_size=1, batch_size=2
        )
        ctx = make_ctx(recipe, tmp_path / "runs")
        run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    episodes, turns = _stored(ctx)
    assert [(e["status"], len(turns[e["id"]])) for e in episodes] == [("ok", 1)] * 2, [e["error"] for e in episodes]
    assert {e["env_return"] for e in episodes} == ({0.0} if sandbox == "bwrap" else {11.0})


def test_the_shipped_multihop_agent_words_its_tools_results_as_the_env_form_does(tmp_path):
    """The agent runs its tools itself: a call the tools cannot take (a missing or unknown argument, a tool
    that does not exist) and a good one give the model the text the env form's tool runner gives it."""
    from types import SimpleNamespace

    from rlcli.builtin_envs.agents import multihop_search as agent
    from rlcli.builtin_envs.multihop_search import MultihopSearch

    from rlcli.envs.loading import load_env
    from rlcli.envs.tool_calls import hermes_tool_call
    from rlcli.envs.tool_use import tool_use_spec
    from rlcli.recipe import EnvSection

    kwargs = {"corpus_seed": 0, "corpus_size": 60, "hops": 1}
    env = load_env("multihop_search", kwargs, tools=tool_use_spec(EnvSection(name="multihop_search"), tmp_path))()
    env.reset(3)
    world = MultihopSearch(**kwargs)
    world.reset(3)
    calls = [
        ("search", {}),
        ("search", {"query": "river", "limit": 2}),
        ("open", {"doc_id": "d0001"}),
        ("find", {"query": "river"}),
        ("search", {"query": "river"}),
    ]
    for name, arguments in calls:
        [message] = env.step(hermes_tool_call(name, arguments))[0]
        function = SimpleNamespace(name=name, arguments=json.dumps(arguments))
        assert agent._run(world, function) == message["content"], name
