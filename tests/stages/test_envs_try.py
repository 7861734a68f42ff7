"""`rlcli envs try --policy model`: one episode played by a model through the rollout code, shown turn by turn."""

from __future__ import annotations

import re

import torch
from typer.testing import CliRunner

from helpers import make_ctx, write_recipe
from rlcli.cli.envs import app
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe


def play(*args: str):
    return CliRunner().invoke(app, ["try", "guess_number", "--policy", "model", *args])


def episode(output: str) -> str:
    """The transcript, from the line naming the model (the first call also says it built tiny-random)."""
    return output[output.index("model tiny-random") :]


def agent_turns(output: str) -> list[str]:
    return re.findall(r"agent \(turn (\d+)\)", output)


def test_a_model_plays_an_episode_the_same_way_twice():
    args = ["--model", "tiny-random", "--seed", "3", "--max-turns", "3"]
    first, again = play(*args), play(*args)
    assert first.exit_code == 0, first.output
    assert agent_turns(first.output) == ["1", "2", "3"]  # a random model does not guess right: every turn
    assert "not solved in 3 turns, return 0 (ended: " in first.output
    assert "engine hf" in first.output  # vLLM's CPU attention refuses tiny-random's head size
    assert episode(first.output) == episode(again.output)  # the seeds fix the samples
    other_seed = play("--model", "tiny-random", "--seed", "4", "--max-turns", "3")
    assert other_seed.exit_code == 0 and episode(other_seed.output) != episode(first.output)


def test_a_checkpoint_of_a_run_plays_with_its_weights(tmp_path, monkeypatch):
    """-c takes a checkpoint folder, or a checkpoint of a run; its adapter, not the base model, writes the replies."""
    from rlcli.models.loading import load_policy, save_checkpoint
    from rlcli.store.checkpoints import add_checkpoint

    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "guess_number"}, rollout={"max_new_tokens": 12})
    cfg = load_recipe(recipe)
    model, tokenizer = load_policy(cfg.model, cfg.lora, cfg.quantization, trainable=True)  # a fresh LoRA
    with torch.no_grad():  # a trained adapter: B no longer zero
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p))
    folder = save_checkpoint(model, tokenizer, tmp_path / "ckpt")

    base = play("-r", str(recipe), "--seed", "1", "--max-turns", "2")
    trained = play("-r", str(recipe), "--seed", "1", "--max-turns", "2", "-c", str(folder))
    assert base.exit_code == 0 and trained.exit_code == 0, trained.output
    # The line may wrap anywhere, and a piped line keeps no trailing space: compare words.
    assert f"checkpoint {folder}" in " ".join(trained.output.split())
    assert base.output.split("agent (turn 1)")[1] != trained.output.split("agent (turn 1)")[1]

    # The same checkpoint named by its run: the run's recipe and the recorded folder.
    ctx = make_ctx(recipe, tmp_path / "runs")
    add_checkpoint(ctx.store, "train/0", 0, folder, "lora")
    ctx.rundb.close()
    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "runs"))
    by_run = play("--run", ctx.run, "-c", "latest", "--seed", "1", "--max-turns", "2")
    assert by_run.exit_code == 0, by_run.output
    assert by_run.output.split("agent (turn 1)")[1] == trained.output.split("agent (turn 1)")[1]


def test_model_options_need_the_model_policy_and_a_known_run(tmp_path, monkeypatch):
    # The sub-app raises; rlcli's main turns a UsageError into its sentence and exit code 2.
    out = CliRunner().invoke(app, ["try", "guess_number", "--model", "tiny-random"])
    assert isinstance(out.exception, UsageError) and "choose the model of --policy model" in str(out.exception)
    monkeypatch.setenv("RLCLI_HOME", str(tmp_path))
    out = play("--model", "tiny-random", "-c", "latest")
    assert isinstance(out.exception, UsageError) and "no run database" in str(out.exception)


AGENT = """
from openai import OpenAI


def solve(client, task):
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    # An assistant message with a tool call and no content, as SDK agents send them back.
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": f"Say {task['word']}."},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    for _ in range(2):  # the second call sends the first reply back and goes on
        reply = api.chat.completions.create(model=client["model"], messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Again."}]
    return {"reward": 0.5, "success": False}
"""


def test_an_agent_program_is_played_by_the_model_behind_the_endpoint(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    args = ["try", f"agent:{tmp_path / 'agent.py'}:solve", "--model", "tiny-random", "-k", "word=hello", "--seed", "2"]
    out = CliRunner().invoke(app, [*args, "--policy", "model"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "Say hello." in text and 'tool call: add({"a": 1})' in text and "not solved in 2 turns, return 0.5" in text
    assert re.search(r"call 1: \d+ prompt tokens, \d+ sampled \((stop|length)\); first call", text)
    assert re.search(r"call 2: \d+ prompt tokens, \d+ sampled \((stop|length)\); (extends call 1|a new segment)", text)
    # Played by a model only: the agent asks the endpoint, not the user or a script.
    refused = CliRunner().invoke(app, ["try", f"agent:{tmp_path / 'agent.py'}:solve"])
    assert isinstance(refused.exception, UsageError) and "use --policy model" in str(refused.exception)


TYPED = """
import json

from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "add_one", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def solve(client, task):
    api = OpenAI(base_url=client["base_url"], api_key=client["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "What is 41 plus one?"}]
    first = api.chat.completions.create(model=client["model"], messages=messages, tools=TOOLS).choices[0].message
    [call] = first.tool_calls
    result = str(json.loads(call.function.arguments)["a"] + 1)
    messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = api.chat.completions.create(model=client["model"], messages=messages, tools=TOOLS).choices[0].message
    return {"reward": float(final.content == "42"), "success": final.content == "42"}
"""


def test_a_person_can_play_behind_an_agent_programs_endpoint(tmp_path):
    (tmp_path / "agent.py").write_text(TYPED)
    args = ["try", f"agent:{tmp_path / 'agent.py'}:solve", "--policy", "human", "--model", "tiny-random"]
    typed = '<tool_call>{"name": "add_one", "arguments": {"a": 41}}</tool_call>\n42\n'
    out = CliRunner().invoke(app, args, input=typed)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    # Each call shows what it adds: the question first, then the tool's result (the reply typed before is
    # not shown again); the typed call reached the agent as a structured tool call.
    shown = text.split("the agent's call")
    assert len(shown) == 3 and "What is 41 plus one?" in shown[1]
    second = shown[2].split("your reply>")[0]
    assert "42" in second and "What is 41 plus one?" not in second
    assert 'tool call: add_one({"a": 41})' in text and "solved in 2 turns, return 1" in text
    assert re.search(r"call 2: \d+ prompt tokens, \d+ sampled \(stop\); extends call 1", text)
