"""The OpenAI-compatible endpoint (generation/endpoint.py) over the HF sampler, driven by the real `openai`
client: replies, streams, tool calls, token-exact records, batching of concurrent clients, bad requests.

The tool-call tests use the tiny random model after it was taught (a few dozen Adam steps, about a
second on a CPU) one tool call and the answer after its result: a real model whose greedy replies are
known, so that a plain SDK agent loop runs to its end.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from rlcli.generation.endpoint import Endpoint
from rlcli.generation.hf_sampler import HfSampler
from rlcli.generation.sampler import Sample, SamplingConfig

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."


def load_tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.models.cache import tiny_random_path

    path = tiny_random_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def serve(model, tokenizer, **defaults) -> Endpoint:
    config = SamplingConfig(**{"temperature": 1.0, "max_new_tokens": 8, **defaults})
    return Endpoint(HfSampler(model, tokenizer, config), tokenizer, "tiny", defaults=config, max_length=512)


def client(endpoint: Endpoint, session: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url(session), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def tool_model():
    """The tiny model taught, on the conversations an SDK agent sends, to call add and then answer."""
    model, tokenizer = load_tiny()
    after_call = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "5"},
    ]
    from rlcli.generation.endpoint import _template_message

    rows, labels = [], []
    for messages, reply in ((QUESTION, CALL), (after_call, ANSWER)):
        rendered = tokenizer.apply_chat_template(
            [_template_message(m) for m in messages], tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        target = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    targets = torch.tensor([t + [-100] * (width - len(t)) for t in labels])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(400):
        loss = model(input_ids=ids, attention_mask=mask, labels=targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    model.eval()
    return model, tokenizer


def test_developer_messages_and_text_parts_render_as_system_and_text(tiny):
    model, tokenizer = tiny
    sent = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]},
    ]
    with serve(model, tokenizer) as endpoint:
        client(endpoint).chat.completions.create(model="tiny", messages=sent, presence_penalty=0, logit_bias={})
    [record] = endpoint.calls()
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    rendered = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert record.prompt_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_models_and_a_reply_record_the_tokens_sampled(tiny):
    model, tokenizer = tiny
    with serve(model, tokenizer) as endpoint:
        api = client(endpoint)
        assert [m.id for m in api.models.list().data] == ["tiny"]
        reply = api.chat.completions.create(model="tiny", messages=QUESTION, logprobs=True, seed=3, max_tokens=6)
    [record] = endpoint.calls()
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert record.prompt_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert record.id == reply.id and record.extends is None and record.follows is None and not record.retokenised
    assert 1 <= len(record.completion_ids) <= 6
    assert reply.choices[0].message.content == tokenizer.decode(record.completion_ids, skip_special_tokens=True)
    assert [t.logprob for t in reply.choices[0].logprobs.content] == record.logprobs
    assert reply.usage.prompt_tokens == len(record.prompt_ids)
    assert reply.usage.completion_tokens == len(record.completion_ids)
    assert reply.choices[0].finish_reason == ("length" if len(record.completion_ids) == 6 else "stop")


def test_a_stream_carries_the_reply_a_plain_call_gets(tiny):
    model, tokenizer = tiny
    with serve(model, tokenizer) as endpoint:
        api = client(endpoint)
        plain = api.chat.completions.create(model="tiny", messages=QUESTION, seed=11)
        chunks = list(
            api.chat.completions.create(
                model="tiny", messages=QUESTION, seed=11, stream=True, stream_options={"include_usage": True}
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    first, second = endpoint.calls()
    assert first.completion_ids == second.completion_ids  # same seed, same tokens


def test_a_continued_conversation_keeps_the_sampled_tokens_and_records_the_mismatch(tiny):
    """A client that sends the reply back and goes on extends the earlier call token for token; where
    tokenising its messages afresh gives other tokens, the record says so (random tokens often re-merge)."""
    model, tokenizer = tiny
    mismatches = 0
    with serve(model, tokenizer) as endpoint:
        for seed in range(6):
            api = client(endpoint, f"episode-{seed}")
            first = api.chat.completions.create(model="tiny", messages=QUESTION, seed=seed)
            sent = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content}]
            sent.append({"role": "user", "content": "Are you sure?"})
            api.chat.completions.create(model="tiny", messages=sent, seed=seed)
            a, b = endpoint.calls(f"episode-{seed}")
            assert b.extends == a.id and b.follows == a.id
            assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
            rendered = tokenizer.apply_chat_template(sent, add_generation_prompt=True, tokenize=False)
            fresh = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            seen = a.prompt_ids + a.completion_ids
            assert b.retokenised == (fresh[: len(seen)] != seen)
            mismatches += b.retokenised
        # Sessions are apart: the same messages sent to another session's URL extend nothing there.
        client(endpoint, "elsewhere").chat.completions.create(model="tiny", messages=sent, seed=0)
    assert mismatches > 0  # the case the record exists for does happen
    [elsewhere] = endpoint.calls("elsewhere")
    assert elsewhere.extends is None and elsewhere.follows is None


def test_an_sdk_agent_loop_gets_structured_tool_calls(tool_model):
    """A plain openai-SDK agent: call the model with tools, run the calls it makes, send the results back,
    until it answers. The second call carries the first reply back as OpenAI's tool_calls, which the chat
    template would write otherwise than the model did (tojson's spacing): the endpoint writes it as sampled,
    so the second call extends the first."""
    model, tokenizer = tool_model
    with serve(model, tokenizer, temperature=0.0, max_new_tokens=40) as endpoint:
        api = client(endpoint, "agent")
        messages: list[dict] = list(QUESTION)
        tools_run = []
        for _ in range(3):
            reply = api.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                tools_run.append((call.function.name, arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(sum(arguments.values()))})
        streamed = list(api.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], stream=True))
    assert tools_run == [("add", {"a": 2, "b": 3})]
    assert messages[-1]["content"] == ANSWER
    first, second, _ = endpoint.calls("agent")
    assert tokenizer.decode(first.completion_ids, skip_special_tokens=True) == CALL
    assert second.follows == first.id and second.extends == first.id
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == [
        *first.prompt_ids,
        *first.completion_ids,
    ]
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("add", {"a": 2, "b": 3})]


class RepliesSampler:
    """The Sampler seam replying with fixed texts, one per request in order, then the end-of-turn token:
    what a model trained on Hermes calls writes (SmolLM2 untrained writes no call)."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.config = SamplingConfig(max_new_tokens=64)

    def start(self, seeds):
        pass

    def sample(self, rows, prompts, budgets, images=None):
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return [Sample(ids, [0.0] * len(ids), True) for _ in rows]


def test_a_template_without_tool_calls_gets_them_as_blocks_and_the_calls_stay_one_sequence(smollm2_cache):
    """SmolLM2's template writes only an assistant message's content: the calls the client sends back are
    written as the <tool_call> blocks they were read from, so the model sees its own calls and the call
    after a tool result extends the first, token for token."""
    from transformers import AutoTokenizer

    from rlcli.models.cache import pull_model

    tokenizer = AutoTokenizer.from_pretrained(pull_model("smollm2-135m"))
    sampler = RepliesSampler(tokenizer, [CALL, ANSWER])
    endpoint = Endpoint(sampler, tokenizer, "smol", defaults=SamplingConfig(max_new_tokens=64))
    assert endpoint.calls_in_content
    with endpoint:
        api = client(endpoint, "agent")
        messages = list(QUESTION)
        message = api.chat.completions.create(model="smol", messages=messages, tools=[ADD_TOOL]).choices[0].message
        assert message.content is None and [c.function.name for c in message.tool_calls] == ["add"]
        messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "x", "content": "5"}]
        final = api.chat.completions.create(model="smol", messages=messages, tools=[ADD_TOOL]).choices[0].message
    assert final.content == ANSWER
    first, second = endpoint.calls("agent")
    assert second.extends == first.id and second.follows == first.id and not second.retokenised
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == [
        *first.prompt_ids,
        *first.completion_ids,
    ]


def test_a_reply_sent_back_unchanged_is_written_as_sampled_and_an_edited_one_starts_anew(tiny):
    """A call written otherwise than the template writes OpenAI's tool_calls ("parameters" for "arguments",
    its own spacing) comes back from the client as tool_calls: the next prompt holds the sampled tokens and
    extends the call. A client that edits the reply (other arguments) gets the template's rendering of
    its messages, a new sequence."""
    _, tokenizer = tiny
    odd = '<tool_call>\n{"name":"add",  "parameters": {"b": 3, "a": 2}}\n</tool_call>'
    sampler = RepliesSampler(tokenizer, [odd, ANSWER, odd, ANSWER])
    endpoint = Endpoint(sampler, tokenizer, "tiny", defaults=SamplingConfig(max_new_tokens=64))
    with endpoint:
        for session, edit in (("as-sent", False), ("edited", True)):
            api = client(endpoint, session)
            message = api.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL]).choices[0].message
            [call] = message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
            sent = message.model_dump(exclude_none=True)
            if edit:
                sent["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 4}'
            messages = [*QUESTION, sent, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            api.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL])
    first, second = endpoint.calls("as-sent")
    assert second.extends == first.id and second.follows == first.id
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == [
        *first.prompt_ids,
        *first.completion_ids,
    ]
    assert odd in tokenizer.decode(second.prompt_ids)
    first, second = endpoint.calls("edited")
    assert second.extends is None and second.follows is None
    assert odd not in tokenizer.decode(second.prompt_ids)


def test_tool_choice_none_returns_the_call_as_text(tool_model):
    model, tokenizer = tool_model
    with serve(model, tokenizer, temperature=0.0, max_new_tokens=40) as endpoint:
        reply = client(endpoint).chat.completions.create(
            model="tiny", messages=QUESTION, tools=[ADD_TOOL], tool_choice="none"
        )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == CALL


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_required_is_served_as_auto(tool_model, choice):
    """Frameworks send tool_choice required (smolagents' ToolCallingAgent does): the reply is sampled freely, as
    for auto, and its call comes back structured."""
    model, tokenizer = tool_model
    with serve(model, tokenizer, temperature=0.0, max_new_tokens=40) as endpoint:
        reply = client(endpoint).chat.completions.create(
            model="tiny", messages=QUESTION, tools=[ADD_TOOL], tool_choice=choice
        )
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["add"]


def test_concurrent_clients_are_served_by_one_sampling_call(tiny):
    """Requests that wait together go to the sampler as one batch, and each gets the tokens it gets alone."""
    model, tokenizer = tiny
    prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in range(4)]
    with serve(model, tokenizer) as endpoint:
        api = client(endpoint)
        alone = [api.chat.completions.create(model="tiny", messages=p, seed=n) for n, p in enumerate(prompts)]
        batches_before = endpoint.batches
        together: dict[int, str] = {}

        def ask(n: int) -> None:
            reply = api.chat.completions.create(model="tiny", messages=prompts[n], seed=n)
            together[n] = reply.choices[0].message.content

        with endpoint.hold():
            threads = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            while endpoint.waiting() < 4:  # the four requests have reached the endpoint
                time.sleep(0.01)
        for thread in threads:
            thread.join()
    assert endpoint.batches - batches_before == 1 and endpoint.requests == 8
    assert [together[n] for n in range(4)] == [r.choices[0].message.content for r in alone]


def test_expected_clients_are_gathered_into_one_batch_and_one_that_left_is_not_waited_for(tiny, monkeypatch):
    """Agents started at different moments sample together: a batch waits for every expected client's
    request; one that ends (client_left) is not waited for. GATHER_S is made long, so that a batch that
    went early would show as a second batch, and one that waited for the client that left would hang."""
    from rlcli.generation import endpoint as module

    monkeypatch.setattr(module, "GATHER_S", 600.0)
    model, tokenizer = tiny
    with serve(model, tokenizer) as endpoint:
        endpoint.expect_clients(4)
        replies: dict[int, str] = {}

        def ask(n: int) -> None:
            reply = client(endpoint, f"s{n}").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Count to {n}."}]
            )
            replies[n] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
            while endpoint.waiting() < len(replies) + threads.index(thread) + 1:  # one by one, in order
                time.sleep(0.01)
        endpoint.client_left()  # the fourth agent ended without calling
        for thread in threads:
            thread.join()
    assert endpoint.batches == 1 and endpoint.requests == 3 and sorted(replies) == [0, 1, 2]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"n": 2}, "n must be 1"),
        ({"tool_choice": "any", "tools": [ADD_TOOL]}, "tool_choice must be auto, none, required or a function"),
        ({"temperature": -1}, "temperature must be a number of at least 0"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "only text content parts",
        ),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": ["add"]}]}, "tool_calls must be a list"),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, "the context holds 512"),
    ],
)
def test_bad_requests_get_a_400_that_says_why(tiny, extra, says):
    model, tokenizer = tiny
    with serve(model, tokenizer) as endpoint:
        with pytest.raises(openai.BadRequestError, match=says):
            client(endpoint).chat.completions.create(**{"model": "tiny", "messages": QUESTION, **extra})
        assert endpoint.calls() == []


def test_a_sessions_calls_sample_the_same_however_other_sessions_interleave(tiny):
    """Without a request seed, a session's n-th call draws with the seed of (run seed, session, n)."""
    model, tokenizer = tiny
    asked = []
    for order in (["a", "b", "a", "b"], ["b", "b", "a", "a"]):
        with serve(model, tokenizer) as endpoint:
            replies: dict[str, list[str]] = {"a": [], "b": []}
            for session in order:
                reply = client(endpoint, session).chat.completions.create(model="tiny", messages=QUESTION)
                replies[session].append(reply.choices[0].message.content)
        asked.append(replies)
    assert asked[0] == asked[1]
    assert asked[0]["a"][0] != asked[0]["a"][1]  # the second call draws anew


def test_a_body_that_is_not_json_and_an_unknown_route_are_answered_in_openai_error_form(tiny):
    model, tokenizer = tiny
    with serve(model, tokenizer) as endpoint:
        answers = []
        for method, path, data in (("POST", "/chat/completions", b"{not json"), ("GET", "/completions", None)):
            request = urllib.request.Request(endpoint.url() + path, data=data, method=method)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request)
            answers.append((caught.value.code, json.loads(caught.value.read())["error"]["message"]))
    assert answers[0][0] == 400 and "Expecting property name" in answers[0][1]
    assert answers[1] == (404, "no such route: GET /v1/completions")
