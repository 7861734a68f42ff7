"""Native tool calls (issue 34): reading calls in each family's format, running them beside the env
(its own tools, recipe functions, real MCP server processes), token-exact `tool` messages, records of
every call, bad input, and kill -9 of a tool rollout."""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from helpers import REPO, kill_at_event, run_in_process, write_env_file, write_recipe
from rlcli.engine.episode_runner import EpisodeRunner
from rlcli.engine.turns import EpisodeSpec, RolloutLimits
from rlcli.envs.loading import load_env
from rlcli.envs.tool_calls import MAX_NESTING, parse_tool_calls
from rlcli.envs.tool_use import ToolUseSpec
from rlcli.envs.tools import McpServerSpec, ToolsSpec, close_toolboxes
from rlcli.envs.workers import InProcessEnvs
from rlcli.generation.sampler import Sample, SamplingConfig

# --- reading calls ------------------------------------------------------------------------------


def test_calls_are_read_in_the_formats_chat_templates_teach():
    hermes = (
        '<tool_call>\n{"name": "search", "arguments": {"query": "Quellmar"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "open", "arguments": "{\\"doc_id\\": \\"d7\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(hermes).calls == [
        {"name": "search", "arguments": {"query": "Quellmar"}},
        {"name": "open", "arguments": {"doc_id": "d7"}},
    ]
    # Llama 3.x: bare JSON with "parameters" (its <|python_tag|> is a special token, dropped in decoding).
    llama = '{"name": "search", "parameters": {"query": "a"}}; {"name": "open", "parameters": {"doc_id": "d1"}}'
    assert [c["name"] for c in parse_tool_calls(llama).calls] == ["search", "open"]
    # Mistral: a JSON list after [TOOL_CALLS] (special, dropped).
    mistral = '[{"name": "open", "arguments": {"doc_id": "d2"}}]'
    assert parse_tool_calls(mistral).calls == [{"name": "open", "arguments": {"doc_id": "d2"}}]
    # A block cut by the token cap still counts when its JSON is whole.
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}').calls == [{"name": "f", "arguments": {}}]


def test_text_that_is_not_a_call_is_not_one_and_a_broken_block_is_malformed():
    for text in ("The answer is {1, 2}.", 'As JSON: {"answer": 5}', "<answer>42</answer>", "[1, 2, 3]"):
        assert not parse_tool_calls(text), text
    found = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"</tool_call>')
    assert found.calls == [{"name": "a", "arguments": {}}]
    [problem] = found.malformed
    assert problem.startswith("malformed <tool_call> block") and "not JSON" in problem
    [problem] = parse_tool_calls('<tool_call>{"arguments": {"x": 1}}</tool_call>').malformed
    assert "no tool name" in problem


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_reply_too_deep_or_too_long_to_read_is_text_or_a_malformed_call_never_a_raise():
    # Past Python's recursion limit: text where bare, a malformed call in a <tool_call> block.
    assert not parse_tool_calls(nested(1000))
    assert not parse_tool_calls("[" * 30_000)
    [problem] = parse_tool_calls(f"<tool_call>{nested(1000)}</tool_call>").malformed
    assert "nested too deeply" in problem
    # Readable, but arguments nested deeper than MAX_NESTING: a malformed call where tagged, text where bare.
    deep_call = '{"name": "f", "arguments": {"a": ' + nested(MAX_NESTING + 1) + "}}"
    assert not parse_tool_calls(deep_call)
    [problem] = parse_tool_calls(f"<tool_call>{deep_call}</tool_call>").malformed
    assert f"the arguments nest deeper than {MAX_NESTING} levels" in problem
    assert parse_tool_calls('{"name": "f", "arguments": {"a": ' + nested(MAX_NESTING - 1) + "}}").calls
    # A number of more digits than Python converts.
    [problem] = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"n": %s}}</tool_call>' % ("1" * 5000)
    ).malformed
    assert "not JSON that can be read" in problem
    # A call after unreadable nesting is still read.
    assert parse_tool_calls(nested(1000) + '{"name": "f", "arguments": {}}').calls == [{"name": "f", "arguments": {}}]


# --- an env with tools of its own, played turn by turn ----------------------------------------------

LOOKUP_ENV = '''
import threading


class Lookup:
    """Answers after looking words up: its tools are two of its methods."""

    def __init__(self):
        self.tools = [self.define, self.count, self.wait_for_partner, self.partner]
        self.looked_up, self.met = [], threading.Event()

    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return [{"role": "user", "content": f"Define w{seed}."}], {"task": {"seed": seed}}

    def define(self, word: str) -> str:
        """Look a word up.

        Args:
            word: The word to define.
        """
        self.looked_up.append(word)
        return f"{word}: a test word"

    def count(self, text: str) -> int:
        """Count the characters of a text.

        Args:
            text: The text whose characters to count.
        """
        return len(text)

    def wait_for_partner(self) -> str:
        """Wait until partner() has run: it only returns when the calls of a turn run side by side."""
        if not self.met.wait(5):
            raise TimeoutError("no partner")
        return "met"

    def partner(self) -> str:
        """Let wait_for_partner() return."""
        self.met.set()
        return "here"

    def step(self, action):
        return "done", float("a test word" in action), True, False, {"success": bool(self.looked_up)}

    def expert_action(self):
        self.turn += 1
        if self.turn == 1:
            return (
                '<tool_call>{"name": "define", "arguments": {"word": "w%d"}}</tool_call>\\n'
                '<tool_call>{"name": "count", "arguments": {"text": "abc"}}</tool_call>' % self.seed
            )
        return "w%d is a test word" % self.seed
'''


class ScriptedSampler:
    """rlcli's Sampler seam replying with fixed texts, one per turn (a tiny random model calls no
    tools): the tokens are the tokenizer's, then the end-of-turn token, as a model would write them."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, replies
        self.config = SamplingConfig(max_new_tokens=200)
        self.turn = 0

    def start(self, seeds):
        self.turn = 0

    def sample(self, rows, prompts, budgets, images=None):
        text = self.replies[self.turn]
        self.turn += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [Sample(list(ids), [0.0] * len(ids), True) for _ in rows]


@pytest.fixture(scope="module")
def tokenizer():
    from rlcli.models.loading import load_policy
    from rlcli.recipe import ModelSection, QuantizationSection

    _, tokenizer = load_policy(ModelSection(name="tiny-random", dtype="float32"), None, QuantizationSection())
    return tokenizer


def play(env_file: Path, replies: list[str] | None, tokenizer=None, spec: ToolUseSpec | None = None, seed: int = 7):
    """One episode of the env in env_file, by the scripted replies (None: its expert)."""
    envs = InProcessEnvs(load_env(str(env_file), {}, tools=spec), 10.0)
    sampler = ScriptedSampler(tokenizer, replies) if replies else None
    runner = EpisodeRunner(envs, RolloutLimits(max_turns=4, max_length=4096, step_timeout_s=10.0), sampler, tokenizer)
    [episode] = runner.run([EpisodeSpec(0, 0, seed, 1)])
    return episode


CALLS = (
    '<tool_call>\n{"name": "define", "arguments": {"word": "w7"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "count", "arguments": {"text": "abcd"}}\n</tool_call>'
)


def test_several_calls_in_a_turn_go_back_as_tool_messages_token_exact(tmp_path, tokenizer):
    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    ep = play(env_file, [CALLS, "w7 is a test word"], tokenizer)
    assert ep.status == "ok" and ep.success and ep.env_return == 1.0, ep.error
    assert ep.template_consistent and len(ep.turns) == 2
    first, second = ep.turns
    assert first.reward == 0.0 and not first.terminated  # a tool turn: the env's step was not called
    tool_messages = json.loads(first.observation)
    assert [(m["role"], m["name"], m["content"]) for m in tool_messages] == [
        ("tool", "define", "w7: a test word"),
        ("tool", "count", "4"),
    ]
    # Each call is recorded on its message: arguments, error, latency, characters cut.
    record = tool_messages[0]["call"]
    assert record["arguments"] == {"word": "w7"} and record["error"] is None and record["latency_s"] >= 0
    # The second turn's prompt is the first's, the sampled tokens, then the template's rendering of the
    # tool messages: what a fresh render of the transcript gives, token for token.
    seen = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[: len(seen)] == seen
    tools = load_env(str(env_file), {})().tools
    assert [t["function"]["name"] for t in tools] == ["define", "count", "wait_for_partner", "partner"]
    upto = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"][-1]
    rendered = tokenizer.apply_chat_template(
        ep.messages[:upto], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(second.prompt_ids, skip_special_tokens=False) == rendered
    assert "<tool_response>\nw7: a test word\n</tool_response>\n<tool_response>\n4\n</tool_response>" in rendered


def test_a_turns_calls_run_side_by_side_with_parallel_tools(tmp_path, tokenizer):
    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    both = (
        '<tool_call>{"name": "wait_for_partner", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "partner", "arguments": {}}</tool_call>'
    )
    parallel = ToolUseSpec(ToolsSpec(timeout_s=3.0), parallel=True)
    results = json.loads(play(env_file, [both, "no"], tokenizer, parallel).turns[0].observation)
    assert [(m["name"], m["content"], m["call"]["error"]) for m in results] == [
        ("wait_for_partner", "met", None),
        ("partner", "here", None),
    ]
    # In order, the first call waits for a partner that only comes after it: it times out, reported to the model.
    in_order = ToolUseSpec(ToolsSpec(timeout_s=0.5))
    waited, partner = json.loads(play(env_file, [both, "no"], tokenizer, in_order, seed=8).turns[0].observation)
    assert waited["call"]["error"] and "0.5" in waited["call"]["error"]
    assert partner["content"] == "here"


# A made-up output format that only a response template describes: the name in the tag, the arguments
# as the region's JSON. The default reader sees no call in it (the JSON has no name).
FN_TAGS = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {
            "open_pattern": "<fn=(?P<name>\\w+)>",
            "close": "</fn>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}


def test_a_tokenizer_that_declares_its_response_template_has_its_calls_read_with_it(tmp_path, tokenizer):
    pytest.importorskip("transformers.utils.chat_parsing", reason="response templates arrived in transformers 5.19")
    from rlcli.envs.tool_use import tool_use_spec
    from rlcli.recipe import EnvSection

    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    reply = 'Looking. <fn=define>{"word": "w7"}</fn><fn=count>{"text": "abcd"}</fn>'
    assert not parse_tool_calls(reply)  # without the template: no call
    declaring = copy.deepcopy(tokenizer)
    declaring.response_template = FN_TAGS
    spec = tool_use_spec(EnvSection(name=str(env_file)), tmp_path, declaring)
    ep = play(env_file, [reply, "w7 is a test word"], tokenizer, spec)
    assert [(m["name"], m["content"]) for m in json.loads(ep.turns[0].observation)] == [
        ("define", "w7: a test word"),
        ("count", "4"),
    ]
    [problem] = parse_tool_calls('<fn=define>{"word": </fn>', spec.response_template).malformed
    assert "does not read as the model's tool-call format" in problem


@pytest.mark.parametrize("policy", ["continue", "end"])
def test_a_malformed_call_is_reported_and_ends_the_episode_if_the_recipe_says_so(tmp_path, tokenizer, policy):
    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    spec = ToolUseSpec(malformed=policy)
    ep = play(
        env_file, ['<tool_call>{"name": "define", "arguments": </tool_call>', "w7 is a test word"], tokenizer, spec
    )
    [message] = json.loads(ep.turns[0].observation)
    assert message["role"] == "tool" and message["content"].startswith("Error: malformed <tool_call> block")
    if policy == "end":
        assert len(ep.turns) == 1 and ep.end_reason.value == "terminated" and not ep.success
    else:
        assert len(ep.turns) == 2 and ep.env_return == 1.0


def test_an_unknown_tool_and_a_raising_tool_are_reported_and_the_episode_goes_on(tmp_path, tokenizer):
    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    calls = (
        '<tool_call>{"name": "nosuch", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "count", "arguments": {"text": 5, "extra": 1}}</tool_call>'
    )
    ep = play(env_file, [calls, "w7 is a test word"], tokenizer)
    unknown, bad = json.loads(ep.turns[0].observation)
    assert unknown["call"]["error"] and "nosuch" in unknown["content"]
    assert bad["call"]["error"]
    assert ep.status == "ok" and len(ep.turns) == 2


def test_a_reply_nested_too_deep_to_read_is_the_models_answer_scored_not_an_env_failure(tmp_path, tokenizer):
    env_file = write_env_file(tmp_path / "lookup.py", LOOKUP_ENV)
    ep = play(env_file, [nested(1000)], tokenizer)
    assert ep.status == "ok" and ep.error is None
    assert len(ep.turns) == 1 and ep.env_return == 0.0 and ep.success is False  # the env judged it


# --- MCP servers and recipe tools, through the command line -----------------------------------------

MCP_SERVER = """
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

Path(sys.argv[1], str(os.getpid())).write_text("")  # the test checks that every server ends
server = MCPServer("shouter")


@server.tool()
def shout(text: str) -> str:
    \"\"\"Say a text louder.

    Args:
        text: What to say.
    \"\"\"
    return text.upper() + "!"


server.run(transport="stdio")
"""

EXPERT_ENV = '''
class Shouting:
    """Calls the MCP server's shout and its own tool in one turn, then answers."""

    def __init__(self):
        self.tools = [self.whisper]

    def whisper(self, text: str) -> str:
        """Say a text softly.

        Args:
            text: What to say.
        """
        return text.lower()

    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return f"Shout {seed}.", {"task": {"seed": seed}}

    def step(self, action):
        return "ok", 1.0, True, False, {"success": True}

    def expert_action(self):
        self.turn += 1
        if self.turn == 1:
            return (
                '<tool_call>{"name": "shout", "arguments": {"text": "task %d"}}</tool_call>'
                '<tool_call>{"name": "whisper", "arguments": {"text": "QUIET"}}</tool_call>' % self.seed
            )
        return "done"
'''


def tool_recipe(tmp_path: Path, workers: int = 2, tasks: int = 6, **env) -> Path:
    (tmp_path / "pids").mkdir(exist_ok=True)
    server = write_env_file(tmp_path / "server.py", MCP_SERVER)
    env_file = write_env_file(tmp_path / "shouting.py", EXPERT_ENV)
    return write_recipe(
        tmp_path / "r.yaml",
        env={
            "name": str(env_file),
            "workers": workers,
            "max_turns": 3,
            "mcp_servers": [{"command": [sys.executable, str(server), str(tmp_path / "pids")]}],
            **env,
        },
        rollout={"tasks": tasks, "group_size": 1, "batch_size": 2},
    )


def episodes(runs: Path) -> list[tuple]:
    """Each episode's key, outcome and transcript, without the calls' latencies (wall-clock)."""
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        rows = conn.execute(
            "select task_index, sample_index, status, env_return, messages from episodes order by 1, 2"
        ).fetchall()
    out = []
    for *key, messages in rows:
        messages = json.loads(messages)
        for m in messages:
            m.get("call", {}).pop("latency_s", None)
        out.append((*key, messages))
    return out


def servers_alive(tmp_path: Path) -> list[int]:
    alive = []
    for pid in (int(p.name) for p in (tmp_path / "pids").iterdir()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def wait_for_no_servers(tmp_path: Path, limit_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + limit_s
    while (alive := servers_alive(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_an_mcp_servers_tools_are_called_from_env_workers_and_shown(tmp_path):
    recipe = tool_recipe(tmp_path)
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    played = episodes(tmp_path / "runs")
    assert len(played) == 6
    for task, _, status, env_return, messages in played:
        assert status == "ok" and env_return == 1.0
        tool_messages = [m for m in messages if m["role"] == "tool"]
        assert [(m["name"], m["content"]) for m in tool_messages] == [("shout", f"TASK {task}!"), ("whisper", "quiet")]
    assert list((tmp_path / "pids").iterdir()), "no MCP server was started"
    assert wait_for_no_servers(tmp_path) == [], "an MCP server outlived its rollout"
    shown = run_in_process(["runs", "episodes", "t", "--limit", "1"], tmp_path / "runs", cwd=REPO)
    assert shown.returncode == 0 and "shout({" in shown.stdout and "whisper({" in shown.stdout
    page = tmp_path / "episodes.html"
    # Newest first, 5 by default: task 0's episode, the oldest of the 6, is on a page of 6.
    html = ["runs", "episodes", "t", "--limit", "6", "--html", str(page)]
    assert run_in_process(html, tmp_path / "runs", cwd=REPO).returncode == 0
    assert "shout({&quot;text&quot;: &quot;task 0&quot;})" in page.read_text()


def test_a_server_that_crashes_fails_that_episode_as_an_env_failure_and_serves_the_next_ones(tmp_path, capfd):
    recipe = tool_recipe(tmp_path, workers=1, tasks=4)
    crashing = MCP_SERVER.replace(
        '    return text.upper() + "!"', '    if text == "task 1":\n        os._exit(3)\n    return text.upper() + "!"'
    )
    assert crashing != MCP_SERVER
    (tmp_path / "server.py").write_text(crashing)
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    # Said by the env worker, on the stderr it shares with rlcli.
    assert "exited with code 3; starting it again (restart 1 of 3)." in capfd.readouterr().err
    played = {task: (status, messages) for task, _, status, _, messages in episodes(tmp_path / "runs")}
    status, messages = played.pop(1)
    assert status == "failed"  # an env failure: neither trained on nor in eval's success rate
    for task, (status, messages) in played.items():  # the server, started again, answers the later episodes
        assert status == "ok"
        assert [m["content"] for m in messages if m.get("name") == "shout"] == [f"TASK {task}!"]
    assert wait_for_no_servers(tmp_path) == [], "an MCP server outlived its rollout"


def test_a_killed_tool_rollout_leaves_no_server_and_resumes_to_the_uninterrupted_episodes(tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    recipe = tool_recipe(clean)
    assert (
        run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], clean / "runs", cwd=REPO).returncode == 0
    )
    killed = tmp_path / "killed"
    killed.mkdir()
    recipe = tool_recipe(killed)
    args = ["rollout", "-r", str(recipe), "--policy", "expert"]
    kill_at_event(args, killed / "runs", {"sql": "select count(*) from episodes", "at_least": 2}, cwd=REPO)
    assert wait_for_no_servers(killed) == [], "an MCP server outlived rlcli's kill -9"
    assert run_in_process(args, killed / "runs", cwd=REPO).returncode == 0
    assert episodes(killed / "runs") == episodes(clean / "runs")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"tools": ["nosuch_tool"]}, "nosuch_tool"),
        ({"mcp_servers": [{"command": ["no-such-mcp-server-command"]}]}, "no-such-mcp-server-command"),
        ({"tools": ["python_exec", "python_exec"]}, "python_exec"),
        ({"tool_timeout_s": 60}, "env.tool_timeout_s (60) must be below env.step_timeout_s (30)"),
    ],
)
def test_bad_tools_are_refused_in_one_sentence_before_anything_is_written(tmp_path, env, expected):
    recipe = tool_recipe(tmp_path, **env)
    if "mcp_servers" not in env:
        data = __import__("yaml").safe_load(recipe.read_text())
        del data["env"]["mcp_servers"]
        recipe.write_text(__import__("yaml").safe_dump(data))
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "rlcli.db").exists() or not _runs(tmp_path / "runs")


OWN_TOOL = '''
    def {name}(self, text: str) -> str:
        """Say a text.

        Args:
            text: What to say.
        """
        return text
'''
DECLARED_SHOUT = {"type": "function", "function": {"name": "shout", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "own, env, expected",
    [
        ("shout", {}, "Two tools are named 'shout': the env's own tool "),
        (None, {}, "Two tools are named 'shout': the env's declared tool spec 'shout' and MCP server `"),
        # code_sandbox none: no line saying where python_exec runs beside the refusal
        (
            "python_exec",
            {"tools": ["python_exec"], "code_sandbox": "none"},
            "Two tools are named 'python_exec': the env's own tool ",
        ),
    ],
    ids=["own-and-mcp", "declared-and-mcp", "own-and-builtin"],
)
def test_a_tool_name_from_two_places_is_refused_before_anything_is_written(tmp_path, own, env, expected):
    recipe = tool_recipe(tmp_path, **env)
    tools = f"[self.whisper, self.{own}]" if own else f"[self.whisper, {DECLARED_SHOUT!r}]"
    source = EXPERT_ENV.replace("self.tools = [self.whisper]", f"self.tools = {tools}")
    write_env_file(tmp_path / "shouting.py", source + (OWN_TOOL.format(name=own) if own else ""))
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert expected in message and message.endswith("expected one tool per name (rename or drop one).")
    assert "\n" not in message and "Traceback" not in message
    assert not (tmp_path / "runs" / "rlcli.db").exists() or not _runs(tmp_path / "runs")


def _runs(runs: Path) -> list:
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        return conn.execute("select name from runs").fetchall()


@pytest.fixture(autouse=True)
def _no_toolboxes_left():
    yield
    close_toolboxes()


def test_recipe_functions_and_mcp_specs_travel_as_the_recipe_says(tmp_path):
    from rlcli.envs.tool_use import tool_use_spec
    from rlcli.recipe import load_recipe

    recipe = load_recipe(tool_recipe(tmp_path, tools=["python_exec"], parallel_tools=True))
    spec = tool_use_spec(recipe.env, tmp_path)
    assert spec.parallel and spec.tools.functions == ("python_exec",) and spec.tools.root == str(tmp_path)
    [server] = spec.tools.mcp_servers
    assert isinstance(server, McpServerSpec) and server.command[0] == sys.executable


def test_the_search_task_plays_the_same_episodes_with_python_tools_and_through_its_mcp_server(tmp_path):
    """multihop_search's search and open as the env's own methods, and as the shipped MCP server's tools:
    the same tool specs for the chat template, and the same episodes from the same seeds."""
    kwargs = {"corpus_seed": 3, "corpus_size": 60, "hops": 2}
    server = [sys.executable, "-m", "rlcli.envs.search_server", "--corpus-seed", "3", "--corpus-size", "60"]
    served = {"kwargs": {**kwargs, "python_tools": False}, "mcp_servers": [{"command": server}]}
    played, specs = [], []
    for name, env in (("python", {"kwargs": kwargs}), ("mcp", served)):
        recipe = write_recipe(
            tmp_path / f"{name}.yaml",
            env={"name": "multihop_search", "workers": 2, "max_turns": 8, **env},
            rollout={"tasks": 6, "group_size": 1, "batch_size": 3},
        )
        result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / name, cwd=REPO)
        assert result.returncode == 0, result.stderr
        played.append(episodes(tmp_path / name))
        from rlcli.envs.tool_use import tool_use_spec
        from rlcli.recipe import load_recipe

        env_cfg = load_recipe(recipe).env
        specs.append(load_env(env_cfg.name, env_cfg.kwargs, tools=tool_use_spec(env_cfg, REPO))().tools)
    assert specs[0] == specs[1] and [t["function"]["name"] for t in specs[0]] == ["search", "open"]
    assert played[0] == played[1]
    assert all(status == "ok" and env_return == 1.0 for _, _, status, env_return, _ in played[0])
    assert any(m.get("name") == "open" for *_, messages in played[0] for m in messages)
