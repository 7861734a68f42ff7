"""Playing episodes of an agent program (envs/agents.py) through rlcli's OpenAI-compatible endpoint.

AgentRunner has EpisodeRunner's shape (`run(specs, on_turns) -> list[LiveEpisode]`), so the rollout
stage stores its episodes as it stores any others. For a chunk of episodes it serves the stage's
sampler as an Endpoint (generation/endpoint.py) and runs each episode's program at once, each in a
process of its own with its own base URL (`/s/<sample seed>-a<attempt>/v1`), so that every call is
attributed to its episode and the requests of all the chunk's agents are batched into the sampler.
A callable's processes are forked from one that imported it once (envs/agents.py AgentForks); in
bubblewrap, and for agent-cmd, each episode starts its program afresh.
A call is sampled with the stage's settings (rollout.request_sampling recipe; with request, its own
temperature, top_p, max_tokens, stop and seed replace them), and, without a `seed` of its own, with one
derived from run.seed, its session and its number in the session: a resumed stage replays an episode's
calls exactly.

Each call the endpoint recorded for an episode is one of its turns: the prompt ids the model saw, the
ids it sampled and their logprobs, never re-tokenised. The episode is template-consistent when every
call extends the one before it (its prompt is that call's prompt and reply, then more tokens): the
trainer then trains it as one sequence. Otherwise (a sub-agent, a rewritten history, a template that
writes a reply back otherwise) grpo/batch.py trains each call as a sequence of its own; every sequence
of an episode gets the episode's advantage, computed from its reward within its group.

An episode makes at most env.max_turns calls: the endpoint refuses those past it (a 400 saying so), and
the episode ends there as an env's does at max_turns, with the reward the agent returns anyway, or 0 if
the refusal made it fail. The episode's time limit is env.step_timeout_s, for the whole program; past it
the process group is killed and the episode stored as env_timeout (played again env.timeout_retries times first). An agent
that crashes, returns something other than a reward, or never calls the endpoint fails its episode
alone. The process group is killed when the episode ends, so no call of the agent's can arrive after.
Episodes whose process died with the one they were forked from (killed from outside, out of memory) are
lost, not failed: played again from their start in a new pass, as the episodes of a killed env worker are.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.engine.episode_runner import play_in_passes
from rlcli.engine.task_data import TaskRows, task_for
from rlcli.engine.turns import EpisodeSpec, LiveEpisode
from rlcli.envs.agents import AgentForks, AgentLimits, AgentOutcome, AgentProgram, AgentSandbox, run_agent
from rlcli.generation.endpoint import CallRecord, Endpoint
from rlcli.generation.sampler import Sampler
from rlcli.store.records import EndReason, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class AgentRunner:
    """program: what each episode runs; task_kwargs: env.kwargs and task_rows: env.task_data's rows, given to
    the agent in its task with the task's seed (engine/task_data.py); time_limit_s: env.step_timeout_s;
    limits: env.worker_memory_mb and env.worker_cpu_s; model_name: what OPENAI_MODEL says."""

    def __init__(
        self,
        program: AgentProgram,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_name: str,
        task_kwargs: dict[str, Any],
        task_rows: TaskRows | None,
        time_limit_s: float,
        limits: AgentLimits,
        max_length: int,
        run_seed: int,
        max_calls: int,
        request_sampling: bool = False,
        timeout_retries: int = 0,
        sandbox_root: Path | None = None,
    ) -> None:
        self.program, self.sampler, self.tokenizer = program, sampler, tokenizer
        self.model_name, self.task_kwargs, self.task_rows = model_name, task_kwargs, task_rows
        self.limits = limits
        self.time_limit_s, self.max_length, self.run_seed = time_limit_s, max_length, run_seed
        self.max_calls, self.timeout_retries = max_calls, timeout_retries
        self.request_sampling = request_sampling  # rollout.request_sampling request: a call's own settings apply
        self.sandbox_root = sandbox_root  # set: each agent runs in bubblewrap there (env.sandbox)

    def run(self, specs: list[EpisodeSpec], on_turns: Callable[[int], None] | None = None) -> list[LiveEpisode]:
        episodes = [LiveEpisode(spec) for spec in specs]
        return play_in_passes(episodes, lambda live: self._play(live, on_turns), lambda ep: [ep], self.timeout_retries)

    def _play(self, episodes: list[LiveEpisode], on_turns: Callable[[int], None] | None) -> None:
        if self.sandbox_root is not None:  # a sandbox per episode: each agent starts in bubblewrap
            # The endpoint's socket, in a folder of its own (a short path: a socket's is at most 108 bytes).
            with tempfile.TemporaryDirectory(prefix="rlcli-endpoint-", dir="/tmp") as folder:
                sandbox = AgentSandbox(os.path.join(folder, "endpoint.sock"), self.sandbox_root)
                return self._serve(episodes, on_turns, sandbox, None)
        if not self.program.callable:  # agent-cmd: a program of the user's, started for each episode
            return self._serve(episodes, on_turns, None, None)
        with AgentForks(self.program) as forks:  # the callable imported once, each episode forked from it
            self._serve(episodes, on_turns, None, forks)

    def _serve(
        self,
        episodes: list[LiveEpisode],
        on_turns: Callable[[int], None] | None,
        sandbox: AgentSandbox | None,
        forks: AgentForks | None,
    ) -> None:
        defaults = replace(self.sampler.config, stop=list(self.sampler.config.stop))
        endpoint = Endpoint(
            self.sampler,
            self.tokenizer,
            self.model_name,
            defaults=defaults,
            max_length=self.max_length,
            seed=self.run_seed,
            keep_calls=1024 * len(episodes),  # every call of the pass stays until its episode is stored
            unix_socket=None if sandbox is None else sandbox.unix_socket,
            request_sampling=self.request_sampling,
        )
        outcomes: dict[int, AgentOutcome] = {}
        endpoint.expect_clients(len(episodes))  # batches gather every running agent's call, as env turns do
        try:
            with endpoint:
                threads = [
                    threading.Thread(target=self._run_agent, args=(endpoint, ep, outcomes, i, sandbox, forks))
                    for i, ep in enumerate(episodes)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                # Taken once every agent's processes are gone, so no call can come after its episode ended.
                for i, episode in enumerate(episodes):
                    session = self._session(episode)
                    calls, capped = endpoint.calls(session), endpoint.refused.get(session, 0) > 0
                    self._settle(episode, outcomes[i], calls, endpoint.url(session), capped)
                    if on_turns is not None:
                        on_turns(sum(len(c.completion_ids) for c in calls))
        finally:
            self.sampler.config = defaults  # the endpoint sets it per batch

    @staticmethod
    def _session(episode: LiveEpisode) -> str:
        return f"{episode.spec.sample_seed}-a{episode.spec.attempt}"

    def _run_agent(
        self,
        endpoint: Endpoint,
        episode: LiveEpisode,
        outcomes: dict[int, AgentOutcome],
        i: int,
        sandbox: AgentSandbox | None,
        forks: AgentForks | None,
    ) -> None:
        episode.task = task_for(self.task_kwargs, self.task_rows, episode.spec.env_seed)
        endpoint.limit_calls(self._session(episode), self.max_calls)
        url = endpoint.url(self._session(episode))
        try:
            outcomes[i] = run_agent(
                self.program, url, self.model_name, episode.task, self.time_limit_s, sandbox, forks, self.limits
            )
        except OSError as exc:  # the program could not be started
            outcomes[i] = AgentOutcome(error=f"the agent could not be started: {exc}")
        finally:
            endpoint.client_left()

    def _settle(
        self, episode: LiveEpisode, outcome: AgentOutcome, calls: list[CallRecord], url: str, capped: bool
    ) -> None:
        self._record(episode, calls)
        if capped:
            # The agent called past env.max_turns: the episode is cut there, as an env's is, and trains with
            # the reward the agent returned anyway (0 when the refusal ended it with an error).
            episode.env_return = (outcome.reward or 0.0) if outcome.error is None else 0.0
            episode.success = outcome.success if outcome.error is None else False
            episode.finish(EndReason.MAX_TURNS)
        elif outcome.error is not None:
            episode.finish(EndReason.ENV_TIMEOUT if outcome.timed_out else EndReason.ERROR, outcome.error)
            episode.transient = outcome.timed_out or outcome.lost
            episode.env_lost = outcome.lost  # played again from its start, as an episode of a killed env worker
        elif not calls:
            episode.finish(EndReason.ERROR, f"the agent never called the endpoint ({url})")
        else:
            episode.env_return = outcome.reward or 0.0
            episode.success = outcome.success
            episode.finish(EndReason.LENGTH if calls[-1].finish_reason == "length" else EndReason.TERMINATED)

    def _record(self, episode: LiveEpisode, calls: list[CallRecord]) -> None:
        """The calls as the episode's turns, the last call's messages and reply as its transcript."""
        for i, call in enumerate(calls):
            info = {
                "call": call.id,
                "finish_reason": call.finish_reason,
                "extends": call.extends,
                "follows": call.follows,
                "retokenised": call.retokenised,
            }
            episode.turns.append(
                Turn(
                    turn_index=i,
                    prompt_ids=list(call.prompt_ids),
                    completion_ids=list(call.completion_ids),
                    logprobs=list(call.logprobs),
                    text=str(self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)),
                    terminated=i == len(calls) - 1,
                    info=json.dumps(info),
                )
            )
        episode.template_consistent = all(b.extends == a.id for a, b in zip(calls, calls[1:]))
        episode.messages = [dict(m) for m in calls[-1].messages] if calls else []
