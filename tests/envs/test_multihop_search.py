"""The multihop_search env: its corpus, BM25, questions whose chains can be looked up, the expert, the
reward, and the same tools served over MCP by rlcli.envs.search_server."""

from __future__ import annotations

import asyncio
import random
import sys

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from rlcli.builtin_envs.multihop_search import BM25, MultihopSearch, corpus, make_env
from transformers.utils import get_json_schema

from helpers import REPO
from rlcli.envs.parsing import parse_answer_tag, parse_tool_call


def run_expert(env: MultihopSearch, seed: int) -> tuple[dict, list[str], tuple]:
    """Play the expert's plan, its tool calls executed against the env's Python tools (as rlcli
    does, without step); returns (the task, the tool results, the last step's result)."""
    _, info = env.reset(seed)
    tools = {fn.__name__: fn for fn in env.tools}
    results = []
    for _ in range(2 * info["task"]["hops"] + 1):
        action = env.expert_action()
        call = parse_tool_call(action) if parse_answer_tag(action) is None else None
        if call is None:
            return info["task"], results, env.step(action)
        results.append(tools[call["name"]](**call["arguments"]))
    raise AssertionError(f"seed {seed}: the expert did not answer after {len(results)} tool calls")


def test_the_corpus_is_deterministic_for_a_seed():
    build = corpus.__wrapped__  # past the cache: two builds from scratch
    first, again, other = build(5, 200), build(5, 200), build(6, 200)
    assert first.documents == again.documents
    assert len(first.documents) == 200 and len({doc.title for doc in first.documents}) == 200
    assert [doc.title for doc in other.documents] != [doc.title for doc in first.documents]
    with pytest.raises(ValueError, match="corpus_size"):
        build(0, 5)


@pytest.mark.parametrize("hops", [1, 2, 3, 4])
def test_every_question_can_be_looked_up_and_the_expert_answers_it(hops):
    """For many seeds: searching each hop's entity by name finds its document first, that document
    names the next entity, and the expert's plan ends with the right answer and reward 1.0."""
    env = make_env(hops=hops)
    seen_hops = set()
    for seed in range(60):
        task, results, (feedback, reward, terminated, truncated, info) = run_expert(env, seed)
        chain = [env.encyclopedia.by_id[doc_id] for doc_id in task["chain"]]
        assert len(chain) == task["hops"] + 1 and len({doc.doc_id for doc in chain}) == len(chain)
        assert chain[-1].title == task["answer"]
        for hop, doc in enumerate(chain[:-1]):
            found, opened = results[2 * hop], results[2 * hop + 1]
            assert found.splitlines()[0].startswith(f"{doc.doc_id}: {doc.title}: ")
            assert opened.startswith(f"{doc.doc_id}: {doc.title}\n") and chain[hop + 1].title in opened
        assert (reward, terminated, truncated, info) == (1.0, True, False, {"success": True}), feedback
        seen_hops.add(task["hops"])
    assert seen_hops == set(range(1, hops + 1))


def test_questions_follow_the_task_seed():
    env = make_env()
    questions = [env.reset(seed)[1]["task"]["question"] for seed in range(50)]
    assert questions == [env.reset(seed)[1]["task"]["question"] for seed in range(50)]
    assert len(set(questions)) >= 45


def test_bm25_ranks_an_entitys_own_document_first_for_its_title():
    for seed, size in [(0, 300), (1, 20), (2, 1000)]:
        encyclopedia = corpus(seed, size)
        for doc in encyclopedia.documents:
            assert encyclopedia.search(doc.title)[0] is doc, doc.title


def test_bm25_scores():
    index = BM25(["red fox", "red red red dog", "blue whale"])
    assert index.top("red", 3) == [1, 0]  # a document without the word is not a match
    assert index.top("fox red", 1) == [0]  # the rarer word weighs more
    assert index.top("green", 3) == [] and index.top("", 3) == []


def test_search_and_open_results():
    env = make_env()
    doc = env.encyclopedia.documents[42]
    assert env.open("d0042") == env.open(" D0042 ") == f"d0042: {doc.title}\n" + " ".join(doc.sentences)
    assert len(env.search(doc.title).splitlines()) == 3
    assert env.search("qwxyz") == "No document matches 'qwxyz'."
    for unknown in ["d9999", "42", ""]:
        assert env.open(unknown).startswith("Error: there is no document")


def test_answers_end_the_episode_and_other_replies_do_not():
    env = make_env()
    _, info = env.reset(7)
    answer = info["task"]["answer"]
    assert env.step("I think it is <answer>Nobody Known</answer>")[1:] == (0.0, True, False, {"success": False})
    env.reset(7)
    assert env.step(f"<answer>  {answer.upper()} </answer>")[1:] == (1.0, True, False, {"success": True})
    env.reset(7)
    feedback, reward, terminated, truncated, _ = env.step("Let me think.")
    assert "<answer>NAME</answer>" in feedback and (reward, terminated, truncated) == (0.0, False, False)


def test_kwargs():
    assert [fn.__name__ for fn in make_env().tools] == ["search", "open"]
    assert make_env(python_tools=False).tools == []
    with pytest.raises(ValueError, match="hops"):
        make_env(hops=0)


def test_the_mcp_server_serves_the_same_tools_with_the_same_results():
    """The server started as a process and used through the mcp SDK's client: the tools it lists
    are the Python tools' schemas, and its results are theirs, for the same calls."""
    env = make_env(corpus_seed=3, corpus_size=120)
    rng = random.Random(0)
    titles = [doc.title for doc in env.encyclopedia.documents]
    words = [word for title in titles for word in title.split()]
    queries = titles[:30] + [" ".join(rng.sample(words, 3)) for _ in range(30)] + ["founded by", "qwxyz", ""]
    doc_ids = [doc.doc_id for doc in env.encyclopedia.documents[:40]] + ["d9999", " D0007 ", "nothing"]
    calls = [("search", {"query": q}) for q in queries] + [("open", {"doc_id": d}) for d in doc_ids]

    async def serve() -> tuple[list, list[str]]:
        server = StdioServerParameters(
            command=sys.executable,
            args=["-m", "rlcli.envs.search_server", "--corpus-seed", "3", "--corpus-size", "120"],
            cwd=REPO,
        )
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            listed = (await session.list_tools()).tools
            texts = []
            for name, arguments in calls:
                result = await session.call_tool(name, arguments)
                assert not result.is_error and len(result.content) == 1, result
                texts.append(result.content[0].text)
            return listed, texts

    listed, texts = asyncio.run(asyncio.wait_for(serve(), timeout=60))
    python_specs = [get_json_schema(fn)["function"] for fn in env.tools]
    assert [{"name": t.name, "description": t.description, "parameters": t.input_schema} for t in listed] == [
        {key: spec[key] for key in ("name", "description", "parameters")} for spec in python_specs
    ]
    tools = {fn.__name__: fn for fn in env.tools}
    assert texts == [tools[name](**arguments) for name, arguments in calls]
