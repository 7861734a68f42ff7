"""An OpenAI-compatible chat endpoint served from a Sampler, on 127.0.0.1, recording every call's tokens.

An agent written against the `openai` package (or any OpenAI-compatible client) points its base URL
here: `POST /v1/chat/completions` and `GET /v1/models`. A request's messages (and tools) go through
the tokenizer's chat template; the prompt is sampled by the same Sampler that rollouts use; the reply's
tool calls are read by the rollout's reader (envs/tool_calls.py) and returned as structured
`tool_calls`. `stream: true` is answered as server-sent events, sent once the sample is complete:
the sampler returns whole samples, not tokens one by one.

Batching: requests from concurrent clients wait in one list, and the batcher thread takes the whole
list at once: all the requests with the same sampling settings are one `Sampler.sample` call (those
with other settings, one call per setting). Requests that arrive while a batch samples go together
in the next batch. `hold()` keeps requests waiting, e.g. while the policy's weights change.

Token-exact records: each call is a `CallRecord` with the prompt ids the model saw and the ids and
logprobs it sampled. A call's base URL may name a session (`/s/<name>/v1`: an episode). When the
rendered text of a call's messages begins with an earlier call's prompt text and sampled text (the
client sent back the reply and went on), the prompt is that earlier call's prompt ids and sampled ids,
unchanged, plus the tokens of the rest: sampled tokens are never re-tokenised, as in rollouts
(engine/turns.py). A reply the client sends back unchanged (as _canonical compares them: its text and
its tool calls' names and arguments) is written into the prompt as the model sampled it, not as the
chat template would write OpenAI's `tool_calls` (other spacing, key order or keys, such as
"parameters" read as "arguments"), so the next call extends it. A call that extends no earlier call
(a sub-agent, a rewritten history, an edited reply) starts a new sequence.

Each record also names the earlier call whose reply its messages carry back (`follows`, matched on
the messages, whatever the text), and says whether tokenising its messages afresh gives other tokens
than those that call's model saw and sampled (`retokenised`): the mismatch that silently biases
training when an agent's messages are re-tokenised. It is recorded, not hidden: a call that follows
another without extending it is the template rewriting the model's reply (tool calls, most often).
"""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

from rlcli.envs.tool_calls import TAGGED, hermes_tool_call, parse_tool_calls
from rlcli.generation.sampler import Sample, Sampler, SamplingConfig
from rlcli.generation.seeds import derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How long a batch waits for the requests of expected clients that have not sent theirs (an agent starting,
# or running a tool between calls): longer would stall on a slow agent, shorter would split the batch.
GATHER_S = 2.0
SESSION_PREFIX = "/s/"  # /s/<name>/v1/...: the base URL of one session (an episode's calls)


@dataclass(frozen=True)
class CallRecord:
    """One chat completion as the model saw and produced it."""

    id: str  # the reply's id (chatcmpl-...)
    session: str  # the name in the base URL (/s/<name>/v1); "" for /v1
    prompt_ids: list[int]  # the tokens the model was given
    completion_ids: list[int]  # the tokens it sampled, the final eos included when it ended on one
    logprobs: list[float]  # of each sampled token, as the sampler recorded it
    finish_reason: str  # stop, length or tool_calls, as the reply says
    extends: str | None  # the earlier call of the session whose prompt and sampled ids begin prompt_ids
    follows: str | None  # the earlier call of the session whose reply the messages carry back
    retokenised: bool  # the messages tokenised afresh differ from what the `follows` call saw and sampled
    messages: list[dict[str, Any]] = field(default_factory=list)  # the request's messages, then the reply's


class RequestError(ValueError):
    """A request the endpoint refuses: answered 400 with this message, as OpenAI's invalid_request_error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Pending:
    """A request between its handler thread and the batcher: what to sample, and the outcome."""

    session: str
    prompt_ids: list[int]
    text: str  # the rendered prompt
    conversation: list[tuple]  # the messages, as _canonical writes them
    messages: list[dict[str, Any]]  # as the request sent them
    extends: str | None
    follows: str | None
    retokenised: bool
    config: SamplingConfig
    budget: int
    seed: int
    tools: list[dict] | None  # None: the reply's tool calls are not read (no tools, or tool_choice none)
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    record: CallRecord | None = None
    error: str | None = None


@dataclass
class _Turn:
    """What a later call of the session may extend: an earlier call's text and ids, prompt and sample,
    and its messages with its reply (as _canonical writes them), which a later call may carry back."""

    call_id: str
    text: str
    ids: list[int]
    conversation: list[tuple]
    reply: tuple  # the reply as _canonical writes it, to know it when a client sends it back
    sampled: str  # the reply as the model sampled it, less a final end-of-turn token


class Endpoint:
    """The chat endpoint over `sampler` (whose config is set per batch from the request's settings).

    defaults: the sampling settings a request does not set (the recipe's); max_length: the most tokens
    a prompt and its reply may take (None: no limit); seed: what the seed of a request without its own
    `seed` derives from, with its session and its number in the session; port: 0 for a free one; keep_calls: how many records (and, per session,
    earlier calls to extend) are kept; unix_socket: a path where the endpoint is served as well, over a Unix
    socket; request_sampling: whether a request's own temperature, top_p, max_tokens, stop and seed replace
    the defaults (else they are checked and set aside: rollout.request_sampling recipe). The sockets are bound
    here: a port taken raises OSError.
    """

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        *,
        defaults: SamplingConfig,
        max_length: int | None = None,
        seed: int = 0,
        port: int = 0,
        keep_calls: int = 1024,
        unix_socket: str | None = None,
        request_sampling: bool = True,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(f"{model_name} has no chat template, so chat messages cannot be rendered for it.")
        self.sampler, self.tokenizer, self.model_name = sampler, tokenizer, model_name
        self.defaults, self.max_length, self.seed = defaults, max_length, seed
        self.request_sampling = request_sampling
        # The tokenizer's own description of its tool-call format, where it has one (envs/tool_use.py).
        self.response_template: str | None = getattr(tokenizer, "response_template", None)
        self.calls_in_content = not _template_writes_tool_calls(tokenizer)
        self.batches = 0  # sampling calls made
        self.requests = 0  # requests sampled
        self.records: deque[CallRecord] = deque(maxlen=keep_calls)
        self._sessions: dict[str, deque[_Turn]] = {}
        self._keep = keep_calls
        self._pending: list[_Pending] = []
        self._holds = 0
        self._closing = False
        # Requests received per session, for the seeds of those that set none: a session's n-th call
        # gets the same seed however other sessions' calls interleave with it.
        self._session_calls: dict[str, int] = {}
        # Sessions whose calls are capped (an agent episode's env.max_turns), and the calls refused past it.
        self._call_limits: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        # How many clients may call at once (agent programs running: expect_clients/client_left); None:
        # unknown, and each batch takes what waits.
        self._clients: int | None = None
        self._cond = threading.Condition()
        # Rust tokenizers refuse concurrent use of one instance ("Already borrowed"): handlers render
        # prompts while the batcher decodes replies.
        self._tokenizer_lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._server.daemon_threads = True
        self._servers: list[socketserver.BaseServer] = [self._server]
        if unix_socket is not None:  # for agents in bubblewrap, which have no network but what is bound in
            self._servers.append(_UnixHTTPServer(unix_socket, _handler_for(self)))
        self._threads = [
            *(threading.Thread(target=s.serve_forever, name="endpoint-http", daemon=True) for s in self._servers),
            threading.Thread(target=self._serve_batches, name="endpoint-batcher", daemon=True),
        ]

    # --- life cycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, session: str | None = None) -> str:
        """The base URL an OpenAI client takes (…/v1), of a named session if given."""
        root = f"http://127.0.0.1:{self.port}"
        return f"{root}{SESSION_PREFIX}{session}/v1" if session else f"{root}/v1"

    def start(self) -> Endpoint:
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop serving; requests still waiting are answered with an error."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Requests wait (and gather into one batch) until the block ends."""
        with self._cond:
            self._holds += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def expect_clients(self, clients: int) -> None:
        """`clients` programs are about to call: a batch waits (up to GATHER_S) until each has a request in,
        so that they sample together as an env's episodes do, turn by turn."""
        with self._cond:
            self._clients = clients

    def client_left(self) -> None:
        """One of the expected clients has ended: the others no longer wait for it."""
        with self._cond:
            if self._clients is not None:
                self._clients -= 1
            self._cond.notify_all()

    def waiting(self) -> int:
        """How many requests wait for the next batch."""
        with self._cond:
            return len(self._pending)

    def calls(self, session: str | None = None) -> list[CallRecord]:
        """The records kept, oldest first; of one session if named."""
        with self._cond:
            return [r for r in self.records if session is None or r.session == session]

    # --- a request --------------------------------------------------------------

    def complete(self, body: dict[str, Any], session: str) -> _Pending:
        """Sample a reply to a chat completion request (blocking until its batch is done)."""
        pending = self._prepare(body, session)
        with self._cond:
            if self._closing:
                raise RuntimeError("the endpoint is closing")
            self._pending.append(pending)
            self._cond.notify_all()
        pending.done.wait()
        return pending

    def limit_calls(self, session: str, calls: int) -> None:
        """Refuse the session's calls after the first `calls` (each refusal counted in `refused`)."""
        with self._cond:
            self._call_limits[session] = calls

    def _prepare(self, body: dict[str, Any], session: str) -> _Pending:
        """What to sample for a request: its prompt ids (extending an earlier call's where its text does),
        settings and seed. Raises RequestError for a request the endpoint refuses."""
        with self._cond:
            limit = self._call_limits.get(session)
            if limit is not None and self._session_calls.get(session, 0) >= limit:
                self.refused[session] = self.refused.get(session, 0) + 1
                raise RequestError(f"this episode's calls are spent: env.max_turns allows {limit}.")
        messages, tools = _check_request(body)
        tool_choice = body.get("tool_choice", "auto")
        config = self._sampling(body)
        conversation = [_canonical(m) for m in messages]
        with self._cond:
            earlier = list(self._sessions.get(session, ()))
        # A reply of this session's sent back unchanged is written as the model sampled it (its tool calls
        # as it wrote them, not as the template would write OpenAI's tool_calls): the next prompt then
        # extends the call token for token, as an env's next turn does.
        sampled = {t.reply: t.sampled for t in earlier}
        shown = [
            {"role": "assistant", "content": sampled[said]}
            if m.get("role") == "assistant" and said in sampled
            else _template_message(m, self.calls_in_content)
            for m, said in zip(messages, conversation)
        ]
        with self._tokenizer_lock:
            try:
                rendered = self.tokenizer.apply_chat_template(
                    shown,
                    # transformers types tools as an (invariant) list of dicts or callables: a list of dicts is one.
                    tools=tools,  # type: ignore[arg-type]
                    add_generation_prompt=True,
                    tokenize=False,
                )
            except Exception as exc:  # jinja's errors, or a template's raise_exception: the request's fault
                raise RequestError(f"the chat template cannot render these messages: {exc}", "messages") from None
            text = cast(str, rendered)  # tokenize=False: the text
            fresh = self._encode(text)
            # The longest: a sub-agent's call may extend the session's first call as well.
            turn = max((t for t in earlier if text.startswith(t.text)), key=lambda t: len(t.text), default=None)
            ids = fresh if turn is None else turn.ids + self._encode(text[len(turn.text) :])
        followed = max(
            (t for t in earlier if conversation[: len(t.conversation)] == t.conversation),
            key=lambda t: len(t.conversation),
            default=None,
        )
        room = None if self.max_length is None else self.max_length - len(ids)
        if room is not None and room < 1:
            raise RequestError(f"the prompt takes {len(ids)} tokens, and the context holds {self.max_length}.")
        budget = config.max_new_tokens if room is None else min(config.max_new_tokens, room)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError("seed must be an integer.", "seed")
        with self._cond:
            number = self._session_calls[session] = self._session_calls.get(session, 0) + 1
        return _Pending(
            session=session,
            prompt_ids=ids,
            text=text,
            conversation=conversation,
            messages=messages,
            extends=None if turn is None else turn.call_id,
            follows=None if followed is None else followed.call_id,
            retokenised=followed is not None and fresh[: len(followed.ids)] != followed.ids,
            config=config,
            budget=budget,
            seed=seed
            if seed is not None and self.request_sampling
            else derive_seed(self.seed, "endpoint", session, number),
            tools=None if tool_choice == "none" else tools,
        )

    def _sampling(self, body: dict[str, Any]) -> SamplingConfig:
        """The request's settings over the defaults (OpenAI's names; max_completion_tokens before max_tokens)."""
        config = replace(self.defaults, stop=list(self.defaults.stop))
        for name, attribute in (("temperature", "temperature"), ("top_p", "top_p")):
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise RequestError(f"{name} must be a number of at least 0.", name)
            setattr(config, attribute, float(value))
        if not 0 < config.top_p <= 1:
            raise RequestError("top_p must be in (0, 1].", "top_p")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise RequestError("max_tokens must be a positive integer.", "max_tokens")
            config.max_new_tokens = limit
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise RequestError("stop must be a string or a list of strings.", "stop")
            config.stop = stops
        return config if self.request_sampling else replace(self.defaults, stop=list(self.defaults.stop))

    def _encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # --- the batcher ------------------------------------------------------------

    def _serve_batches(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (self._pending and not self._holds))
                if self._clients is not None:  # the rest of the expected clients' requests, briefly
                    self._cond.wait_for(lambda: self._closing or len(self._pending) >= (self._clients or 0), GATHER_S)
                if self._closing:
                    for pending in self._pending:
                        pending.error = "the endpoint closed before this request was sampled"
                        pending.done.set()
                    self._pending = []
                    return
                batch, self._pending = self._pending, []
            groups: dict[tuple, list[_Pending]] = {}
            for pending in batch:
                c = pending.config
                groups.setdefault((c.temperature, c.top_p, c.top_k, tuple(c.stop)), []).append(pending)
            for group in groups.values():
                self._sample(group)

    def _sample(self, group: list[_Pending]) -> None:
        """One sampling call for requests that share their sampling settings; each gets its reply."""
        try:
            self.sampler.config = replace(group[0].config, max_new_tokens=max(p.budget for p in group))
            self.sampler.start([p.seed for p in group])
            samples = self.sampler.sample(
                list(range(len(group))), [p.prompt_ids for p in group], [p.budget for p in group]
            )
        except Exception as exc:  # the sampler's failure fails the batch's requests, not the server
            for pending in group:
                pending.error = f"sampling failed: {type(exc).__name__}: {exc}"
                pending.done.set()
            return
        with self._cond:
            self.batches += 1
            self.requests += len(group)
        for pending, sample in zip(group, samples):
            try:
                self._finish(pending, sample)
            except Exception as exc:  # a reply that cannot be built fails its request alone
                pending.error = f"the reply could not be built: {type(exc).__name__}: {exc}"
            pending.done.set()

    def _message(self, pending: _Pending, text: str, finish: str, call_id: str) -> tuple[dict[str, Any], str]:
        """The reply's assistant message in OpenAI's form, and its finish reason."""
        for stop in pending.config.stop:  # OpenAI's replies leave the stop string out; the record keeps it
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
        found = parse_tool_calls(text, self.response_template, pending.tools) if pending.tools is not None else None
        if found is None or not found.calls:
            return {"role": "assistant", "content": text}, finish
        content = TAGGED.sub("", text).strip() if TAGGED.search(text) else ""
        tool_calls = [
            {
                "id": f"call_{call_id[-12:]}_{i}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
            for i, call in enumerate(found.calls)
        ]
        # OpenAI's form: no text beside the calls is null
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"

    def _finish(self, pending: _Pending, sample: Sample) -> None:
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        # transformers types decode str | list[str]: a list of ids decodes to one string.
        with self._tokenizer_lock:
            text = cast(str, self.tokenizer.decode(sample.ids, skip_special_tokens=True))
            sampled_text = cast(
                str, self.tokenizer.decode(sample.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            )
            # The template closes an assistant message with its own end-of-turn token.
            body = sample.ids[:-1] if sample.ids and sample.ids[-1] in self.tokenizer.all_special_ids else sample.ids
            reply_text = cast(
                str, self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            )
            pieces = [cast(str, self.tokenizer.decode([i], skip_special_tokens=False)) for i in sample.ids]
        message, finish = self._message(pending, text, "stop" if sample.finished else "length", call_id)
        logprobs = [
            {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}
            for piece, logprob in zip(pieces, sample.logprobs)
        ]
        pending.reply = {
            "id": call_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": {"content": logprobs}}],
            "usage": {
                "prompt_tokens": len(pending.prompt_ids),
                "completion_tokens": len(sample.ids),
                "total_tokens": len(pending.prompt_ids) + len(sample.ids),
            },
        }
        record = CallRecord(
            call_id,
            pending.session,
            pending.prompt_ids,
            sample.ids,
            sample.logprobs,
            finish,
            pending.extends,
            pending.follows,
            pending.retokenised,
            [*pending.messages, message],
        )
        pending.record = record
        reply = _canonical(message)
        conversation = [*pending.conversation, reply]
        with self._cond:
            self.records.append(record)
            turns = self._sessions.setdefault(pending.session, deque(maxlen=self._keep))
            turns.append(
                _Turn(
                    call_id,
                    pending.text + sampled_text,
                    pending.prompt_ids + sample.ids,
                    conversation,
                    reply,
                    reply_text,
                )
            )


def _check_request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The request's messages and tools; a RequestError for what the endpoint cannot do. Settings that
    would change the reply are refused rather than ignored; their neutral values (0, {}, text) pass."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of message objects.", "messages")
    for message in messages:
        parts, calls = message.get("content"), message.get("tool_calls") or []
        if isinstance(parts, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
            raise RequestError("only text content parts are supported (no images, audio or files).", "messages")
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise RequestError("a message's tool_calls must be a list of tool call objects.", "messages")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of tool objects.", "tools")
    # required and a named function are served as auto: forcing a call would take the sampled tokens off
    # the policy's distribution, so their logprobs would no longer be what training needs. A reply without
    # a call comes back as text, and the agent's reward teaches the policy to call.
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", "required") and not (
        isinstance(choice, dict) and choice.get("type") == "function"
    ):
        raise RequestError("tool_choice must be auto, none, required or a function object.", "tool_choice")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: the endpoint samples one choice per request.", "n")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported: the sampler records each sampled token's only.")
    for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
        if body.get(name):
            raise RequestError(f"{name} is not supported: the sampler applies none.", name)
    if (body.get("response_format") or {}).get("type", "text") != "text":
        raise RequestError("response_format is not supported: replies are free text.", "response_format")
    return messages, tools


def _template_writes_tool_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template writes an assistant message's tool calls (SmolLM2's, for one, writes only
    the content, so a model behind it would never see the calls it made)."""
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "rlcli_probe", "arguments": {}}}],
        },
    ]
    try:
        return "rlcli_probe" in cast(str, tokenizer.apply_chat_template(probe, tokenize=False))
    except Exception:  # a template that refuses tool calls outright has no place for them either
        return False


def _template_message(message: dict[str, Any], calls_in_content: bool = False) -> dict[str, Any]:
    """An OpenAI message as chat templates read it: OpenAI's `developer` role as `system` (templates know
    only the latter), content parts joined into text, and each tool call's arguments (a JSON string in
    OpenAI's format) as the object most templates write with tojson. calls_in_content: for a template
    that does not write tool calls, they are written after the content as `<tool_call>` blocks, the form
    the endpoint read them in, so the text is what the model sampled when it wrote them that way."""
    out = dict(message)
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif content is None:
        out["content"] = ""
    calls = []
    for call in out.get("tool_calls") or []:
        function = dict(call.get("function", {})) if isinstance(call, dict) else {}
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    if calls and calls_in_content:
        blocks = [hermes_tool_call(c["function"].get("name"), c["function"].get("arguments")) for c in calls]
        out["content"] = "\n".join([out["content"], *blocks] if out["content"] else blocks)
        del out["tool_calls"]
    elif calls:
        out["tool_calls"] = calls
    return out


def _canonical(message: dict[str, Any]) -> tuple:
    """What a message says, for matching a reply that a client sends back: its role, text, tool calls
    and the call a tool message answers. Clients add fields of their own (refusal, annotations...)."""
    m = _template_message(message)
    calls = tuple(
        (c["function"].get("name"), json.dumps(c["function"].get("arguments"), sort_keys=True))
        for c in m.get("tool_calls") or []
    )
    return (m.get("role"), m["content"] or "", calls, m.get("tool_call_id") if m.get("role") == "tool" else None)


def _stream_chunks(reply: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """A finished reply as the chunks of a stream: the role, the content, the tool calls, the end."""
    choice, base = reply["choices"][0], {k: reply[k] for k in ("id", "created", "model")}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]
        return {**base, "object": "chat.completion.chunk", "choices": choices}

    message = choice["message"]
    yield chunk({"role": "assistant", "content": ""})
    if message["content"]:
        yield chunk({"content": message["content"]}, logprobs=choice["logprobs"])
    if message.get("tool_calls"):
        yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield {**base, "object": "chat.completion.chunk", "choices": [], "usage": reply["usage"]}


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    """The endpoint's HTTP on a Unix socket file (the handler never reads the client's address)."""

    daemon_threads = True


def _handler_for(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: SDK clients reuse their connection

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the endpoint's caller prints what it wants."""

        def _route(self) -> tuple[str, str] | None:
            """(session, path after /v1) of the request, or None."""
            path = self.path.split("?", 1)[0]
            session = ""
            if path.startswith(SESSION_PREFIX):
                session, _, path = path[len(SESSION_PREFIX) :].partition("/")
                path = "/" + path
            return (session, path[3:]) if path.startswith("/v1/") else None

        def do_GET(self) -> None:
            route = self._route()
            if route is None or route[1] != "/models":
                return self._error(HTTPStatus.NOT_FOUND, f"no such route: GET {self.path}")
            model = {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "rlcli"}
            self._json({"object": "list", "data": [model]})

        def do_POST(self) -> None:
            route = self._route()
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if route is None or route[1] != "/chat/completions":
                return self._error(HTTPStatus.NOT_FOUND, f"no such route: POST {self.path}")
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object.")
                pending = endpoint.complete(body, route[0])
            except ValueError as exc:  # RequestError, or a body that is not JSON
                return self._error(HTTPStatus.BAD_REQUEST, str(exc), getattr(exc, "param", None))
            except RuntimeError as exc:
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
            if pending.error is not None or pending.reply is None:
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, pending.error or "no reply")
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return self._stream(_stream_chunks(pending.reply, usage))
            self._json(pending.reply)

        def _json(self, value: dict[str, Any], status: HTTPStatus = HTTPStatus.OK) -> None:
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the stream ends when the connection does
            self.end_headers()
            for item in chunks:
                self.wfile.write(f"data: {json.dumps(item)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

        def _error(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    return Handler
