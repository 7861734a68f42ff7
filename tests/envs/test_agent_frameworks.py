"""An agent framework from PyPI (smolagents, the `agents` extra) run unchanged as an `agent:` env: its
ToolCallingAgent talks to rlcli's endpoint through its own OpenAI client, with its own system prompt,
tool schemas and `tool_choice: required`, and every call it makes is stored token-exact as a turn."""

from __future__ import annotations

import json
import textwrap

from helpers import make_ctx, write_recipe
from rlcli.engine.rollout import run_rollout_stage
from rlcli.store.blobs import unpack_floats, unpack_ids

# The agent file a smolagents user writes: nothing of rlcli's. It saves the text of each model output
# its framework received, for the test to compare with what rlcli stored.
AGENT = '''
import json, os, uuid

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def solve(client, task):
    model = OpenAIServerModel(model_id=client["model"], api_base=client["base_url"], api_key=client["api_key"])
    agent = ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
    agent.run(f"What is {task['seed']} + 2?")
    outputs = [step.model_output for step in agent.memory.steps if getattr(step, "model_output", None) is not None]
    with open(os.path.join(task["out"], f"{task['seed']}-{uuid.uuid4().hex}.json"), "w") as f:
        json.dump(outputs, f)
    return float(len(outputs))
'''


def test_a_smolagents_tool_calling_agent_runs_unchanged_and_its_calls_are_stored(tmp_path):
    (tmp_path / "smol_agent.py").write_text(textwrap.dedent(AGENT))
    out = tmp_path / "outputs"
    out.mkdir()
    recipe = write_recipe(
        tmp_path / "r.yaml",
        # smolagents' system prompt with one tool is about 2,700 tokens of the tiny byte-level tokenizer.
        model={"max_length": 4096},
        env={"name": f"agent:{tmp_path / 'smol_agent.py'}:solve", "kwargs": {"out": str(out)}, "step_timeout_s": 300},
        rollout={"tasks": 2, "group_size": 1, "max_new_tokens": 12, "batch_size": 2, "temperature": 1.0},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    assert run_rollout_stage(ctx, stage="rollout", policy="base", split="train").episodes == 2
    from transformers import AutoTokenizer

    from rlcli.models.cache import tiny_random_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_random_path())
    episodes = list(ctx.rundb.db.query("select * from episodes where run = ? order by id", [ctx.run]))
    assert [e["status"] for e in episodes] == ["ok", "ok"]
    received = sorted(o for f in out.iterdir() for o in json.loads(f.read_text()))
    stored = []
    for episode in episodes:
        turns = list(
            ctx.rundb.db.query("select * from turns where episode_id = ? order by turn_index", [episode["id"]])
        )
        # A call per step the agent took (its return), and the one that asks for a final answer after max_steps.
        assert len(turns) == episode["env_return"] + 1
        for turn in turns:
            assert len(unpack_floats(turn["logprobs"])) == len(unpack_ids(turn["completion_ids"]))
            info = json.loads(turn["info"])
            assert info["call"].startswith("chatcmpl-")
        stored += [tokenizer.decode(unpack_ids(t["completion_ids"]), skip_special_tokens=True) for t in turns]
    # What smolagents received is exactly what the model sampled (a random model's replies hold no tool call).
    assert all(stored.count(text) >= received.count(text) for text in received) and len(received) >= 4
