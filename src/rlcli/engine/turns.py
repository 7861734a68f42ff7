"""A live episode and its turns: the records a runner plays (EpisodeSpec, LiveEpisode, Action) and
TurnPlayer, which turns one episode's env replies into its conversation, its prompts and its recorded
turns, for engine/episode_runner.py's EpisodeRunner and engine/games.py's GameRunner alike.

Token exactness: each turn's prompt is the previous turn's prompt plus the tokens sampled
plus the tokenised *suffix* that the chat template adds (end of turn, env feedback, next
generation prompt). Sampled tokens are never re-tokenised, so training sees exactly what was
sampled. When a chat template rewrites earlier text (so the rendered conversation no longer
extends what the model saw), the whole prompt is re-rendered and the episode is flagged
`template_consistent = 0`; every turn's prompt ids are still stored exactly as seen.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from rlcli.envs.protocol import EnvFailure, EnvTimeout, as_messages
from rlcli.envs.workers import EnvLost, EnvReply
from rlcli.generation.sampler import Sampler
from rlcli.models import vision
from rlcli.store.db import now
from rlcli.store.records import EndReason, Episode, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class EpisodeSpec:
    task_index: int
    sample_index: int
    env_seed: int  # the task: shared by the samples of a group
    sample_seed: int  # the sampling randomness: differs per sample
    attempt: int = 1  # 2 and up: played again after a lost env or a timeout


@dataclass
class LiveEpisode:
    """An episode being played: the env, the transcript so far, and the tokens the model has seen."""

    spec: EpisodeSpec
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    task: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token the model has seen so far
    text: str = ""  # the text those tokens decode to, for extending the prompt by a suffix
    status: str = "ok"
    end_reason: EndReason | None = None
    error: str | None = None
    transient: bool = False  # failed in a way that need not recur (a timeout, a lost env)
    env_lost: bool = False  # its env was lost with a worker killed during another episode's call
    lost: int = 0  # earlier attempts whose env was lost so
    earlier_errors: list[str] = field(default_factory=list)  # how each earlier attempt ended
    env_return: float = 0.0
    success: bool | None = None
    template_consistent: bool = True
    images: list[vision.ImageRef] = field(default_factory=list)  # the images in `ids`, in order
    pngs: dict[str, bytes] = field(default_factory=dict)  # every image the env showed, by sha256

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    def finish(self, reason: EndReason, error: str | None = None) -> None:
        self.end_reason = reason
        if error is not None:
            self.status, self.error = "failed", error

    def env_failed(self, what: str, exc: EnvFailure) -> None:
        reason = EndReason.ENV_TIMEOUT if isinstance(exc, EnvTimeout) else EndReason.ERROR
        self.finish(reason, f"{what} failed: {exc}")
        # A timeout, or an env lost with a worker that another episode's call killed, need not recur.
        self.transient = isinstance(exc, (EnvTimeout, EnvLost))
        self.env_lost = isinstance(exc, EnvLost)

    def plays_again(self, timeout_retries: int) -> bool:
        """Whether this attempt is played again: its env was lost, or it timed out and env.timeout_retries
        allows another try."""
        if self.env_lost:
            return True
        timeouts = self.spec.attempt - self.lost  # this attempt's included
        return self.end_reason == EndReason.ENV_TIMEOUT and timeouts <= timeout_retries

    def again(self) -> LiveEpisode:
        """The next attempt at this episode: played from its start with the same seeds."""
        return LiveEpisode(
            replace(self.spec, attempt=self.spec.attempt + 1),
            lost=self.lost + self.env_lost,
            earlier_errors=[*self.earlier_errors, f"attempt {self.spec.attempt}: {self.error}"],
        )

    def to_record(self, run: str, stage: str, iteration: int | None, split: str, policy: str) -> Episode:
        success = self.success if self.success is not None else self.env_return > 0
        return Episode(
            id=None,
            run=run,
            stage=stage,
            iteration=iteration,
            split=split,
            task_index=self.spec.task_index,
            sample_index=self.spec.sample_index,
            seed=self.spec.env_seed,
            policy=policy,
            status=self.status,
            end_reason=self.end_reason,
            env_return=self.env_return,
            success=bool(success) and self.status == "ok",
            num_turns=len(self.turns),
            num_tokens=sum(len(t.completion_ids) for t in self.turns),
            task=self.task,
            messages=_jsonable_messages(self.messages),
            template_consistent=self.template_consistent,
            error=self.error,
            created_at=now(),
            attempts=self.spec.attempt,
            transient=self.transient,
            lost=self.lost,
            earlier_errors="\n".join(self.earlier_errors) or None,
            turns=self.turns,
            images=self.pngs,
        )


@dataclass
class Action:
    """What the policy did on one turn of one episode."""

    text: str
    ids: list[int] = field(default_factory=list)  # sampled token ids (none for the expert)
    logprobs: list[float] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    gen_time_s: float = 0.0
    finished: bool = True  # False when the reply was cut by the token cap
    images: list[str] = field(default_factory=list)  # sha256 of the images in prompt_ids


def _jsonable_messages(messages: list[dict]) -> list[dict]:
    """Images are not stored in the transcript; a placeholder says where they were, with the sha256
    of the stored image when the model read it (the images table)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                p
                if p.get("type") != "image"
                else {"type": "image", **({"sha256": p["sha256"]} if "sha256" in p else {})}
                for p in content
            ]
        out.append({**m, "content": content})
    return out


@dataclass
class RolloutLimits:
    max_turns: int
    max_length: int
    step_timeout_s: float
    keep_images: int | None = None  # a vision-language model sees the last k images of an episode; None: all
    timeout_retries: int = 0  # env.timeout_retries: plays again, in the stage, of an episode that timed out


# --- the turn loop both runners share ---------------------------------------------------------------


class TurnPlayer:
    """One episode's side of a turn, for whichever runner plays it: the reset's reply read into the
    conversation (`begin`), the prompt built and the reply sampled (`act`), the env's answer recorded
    as a turn (`record`), an observation's images named (`observe`).

    `expert`: the env's expert plays, in text: no tokens are kept, and its actions come with the
    env's replies.
    """

    def __init__(
        self, limits: RolloutLimits, tokenizer: PreTrainedTokenizerBase | None = None, expert: bool = False
    ) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.expert = expert
        self.processor = vision.processor_of(tokenizer)  # None for a text model

    def begin(self, ep: LiveEpisode, reply: EnvReply) -> None:
        """The reset's reply: the first observation, the task and the tools, or how the env failed."""
        if reply.failure is not None:
            if reply.failed_in == "create":
                ep.finish(EndReason.ERROR, f"env could not be created: {reply.failure}")
            else:
                ep.env_failed("env reset", reply.failure)
            return
        try:
            (obs, info), tools = reply.value
            ep.messages = self.observe(ep, as_messages(obs))
            ep.task = dict((info or {}).get("task", {}))
            ep.tools = tools or None
        except EnvFailure as exc:
            ep.env_failed("env reset", exc)
        except Exception as exc:  # reset returned something that is not (observation, info)
            ep.finish(EndReason.ERROR, f"env could not be created: {type(exc).__name__}: {exc}")

    # --- acting ---------------------------------------------------------------

    def act(self, live: list[LiveEpisode], rows: list[int], sampler: Sampler) -> list[Action]:
        """One turn of these episodes from `sampler`, episode k in its row rows[k]. An episode whose
        prompt leaves no room under model.max_length ends here (its action is empty)."""
        prompts, budgets, asking, rows_asked = [], [], [], []
        for ep, row in zip(live, rows):
            prompt = self._prompt_ids(ep)
            budget = min(sampler.config.max_new_tokens, self.limits.max_length - len(prompt))
            if budget <= 0:
                if ep.turns:
                    ep.finish(EndReason.CONTEXT)
                else:
                    ep.finish(
                        EndReason.ERROR,
                        f"the first observation needs {len(prompt)} tokens, over the context "
                        f"budget model.max_length={self.limits.max_length}",
                    )
                continue
            prompts.append(prompt)
            budgets.append(budget)
            asking.append(ep)
            rows_asked.append(row)
        results: dict[int, Action] = {}
        if asking:
            start = time.perf_counter()
            if self.processor is not None:
                images = [list(ep.images) for ep in asking]
                samples = sampler.sample(rows_asked, prompts, budgets, images=images)
            else:
                samples = sampler.sample(rows_asked, prompts, budgets)
            elapsed = (time.perf_counter() - start) / len(asking)
            for ep, prompt, sample in zip(asking, prompts, samples):
                text = self._decode(sample.ids, skip_special_tokens=True)
                hashes = [ref.sha256 for ref in ep.images]
                results[id(ep)] = Action(text, sample.ids, sample.logprobs, prompt, elapsed, sample.finished, hashes)
        return [results.get(id(ep), Action("")) for ep in live]

    def observe(self, ep: LiveEpisode, messages: list[dict]) -> list[dict]:
        """A vision-language model's observation: each image as a PIL image named by its hash (its PNG
        kept for the database). The expert's screenshots are kept the same way, so that SFT on its demos
        can show them to a vision model. A text model's messages stay as they are (images unseen)."""
        if self.processor is None and not self.expert:
            return messages
        try:
            return vision.name_images(messages, ep.pngs)
        except (ValueError, OSError) as exc:
            raise EnvFailure(f"an image in the observation cannot be read: {exc}") from None

    def _policy_tokenizer(self) -> PreTrainedTokenizerBase:
        """The policy's tokenizer: a model's turns have one (the expert's plays text)."""
        assert self.tokenizer is not None
        return self.tokenizer

    def _decode(self, ids: list[int], **options: bool) -> str:
        # transformers types decode str | list[str]: a list of ids decodes to one string.
        return cast(str, self._policy_tokenizer().decode(ids, **options))

    def _render(self, ep: LiveEpisode) -> str:
        text = self._policy_tokenizer().apply_chat_template(
            ep.messages,
            # transformers types tools as an (invariant) list of dicts or callables: a list of dicts is one.
            tools=ep.tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=False,
        )
        return cast(str, text)  # tokenize=False: the text

    def _vision_prompt_ids(self, ep: LiveEpisode) -> list[int]:
        """_prompt_ids through the processor: image placeholders expanded into the image tokens; the
        suffix carries the images that the tokens so far do not."""
        messages = vision.keep_last_images(ep.messages, self.limits.keep_images)
        rendered = vision.render(self.processor, messages)
        images = vision.message_images(messages)
        seen = [ref.sha256 for ref in ep.images]
        if ep.ids and rendered.startswith(ep.text) and [r.sha256 for r in images[: len(seen)]] == seen:
            ids = ep.ids + vision.tokenize(self.processor, rendered[len(ep.text) :], images[len(seen) :])
        else:
            # keep_images dropped an earlier screenshot (or the template rewrote the past): the whole
            # prompt again, and the episode's turns train one by one.
            if ep.ids:
                ep.template_consistent = False
            ids = vision.tokenize(self.processor, rendered, images)
        ep.ids, ep.text, ep.images = ids, rendered, images
        return ids

    def _prompt_ids(self, ep: LiveEpisode) -> list[int]:
        """The episode's next prompt: the tokens seen so far plus the template's suffix (the module
        docstring says why), or the whole conversation again when the template rewrote the past."""
        if self.processor is not None:
            return self._vision_prompt_ids(ep)
        rendered = self._render(ep)
        if ep.ids and rendered.startswith(ep.text):
            suffix = rendered[len(ep.text) :]
            ids = ep.ids + self._policy_tokenizer()(suffix, add_special_tokens=False)["input_ids"]
        else:
            if ep.ids:
                ep.template_consistent = False
            ids = self._policy_tokenizer()(rendered, add_special_tokens=False)["input_ids"]
        ep.ids, ep.text = ids, rendered
        return ids

    # --- the env's answer to a step ---------------------------------------------

    def record(self, ep: LiveEpisode, action: Action | None, reply: EnvReply) -> None:
        """Record one turn: the action taken (the expert's comes with the reply) and the env's answer;
        end the episode when the env, env.max_turns or the token cap says so."""
        if reply.op == "expert_step":
            if reply.failed_in == "expert":
                ep.finish(EndReason.ERROR, f"expert_action failed: {reply.failure}")
                return
            action = Action(reply.action, gen_time_s=reply.expert_time_s)
        assert action is not None  # a sampled turn's action, or the expert's (above)
        ep.messages.append({"role": "assistant", "content": action.text})
        if not self.expert:
            ep.ids = ep.ids + action.ids
            ep.text = ep.text + self._decode(action.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        feedback, reward, terminated, truncated, info = self._outcome(ep, reply)
        ep.turns.append(
            Turn(
                turn_index=len(ep.turns),
                prompt_ids=action.prompt_ids,
                completion_ids=action.ids,
                logprobs=action.logprobs,
                text=action.text,
                observation=json.dumps(_jsonable_messages(feedback), default=str),
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                info=json.dumps(info, default=str),
                gen_time_s=action.gen_time_s,
                env_time_s=reply.env_time_s,
                images=action.images,
            )
        )
        ep.env_return += reward
        if "success" in info:
            ep.success = bool(info["success"])
        ep.messages.extend(feedback)
        if ep.done:
            return
        if terminated or truncated or len(ep.turns) >= self.limits.max_turns:
            # A last reply cut by the token cap tells more about the episode than how the env took it.
            if not action.finished:
                ep.finish(EndReason.LENGTH)
            elif terminated:
                ep.finish(EndReason.TERMINATED)
            elif truncated:
                ep.finish(EndReason.TRUNCATED)
            else:
                ep.finish(EndReason.MAX_TURNS)

    def _outcome(self, ep: LiveEpisode, reply: EnvReply) -> tuple[list[dict], float, bool, bool, dict]:
        """A step's reply as (feedback, reward, terminated, truncated, info); a failed or malformed one
        fails the episode and reads as nothing."""
        try:
            if reply.failure is not None:
                raise reply.failure
            obs, reward, terminated, truncated, info = reply.value
            feedback = self.observe(ep, as_messages(obs)) if obs else []
            reward = float(reward)
            if not math.isfinite(reward):
                # SQLite would store NaN as NULL, later read as a reward of 0: fail the episode instead.
                raise ValueError(f"reward {reward} is not a finite number")
        except EnvFailure as exc:
            ep.env_failed("env step", exc)
            return [], 0.0, False, False, {}
        except (TypeError, ValueError) as exc:
            ep.finish(
                EndReason.ERROR,
                f"env step returned {type(exc).__name__}: {exc}; expected "
                "(observation, reward, terminated, truncated, info)",
            )
            return [], 0.0, False, False, {}
        return feedback, reward, bool(terminated), bool(truncated), info or {}


# --- single-agent episodes --------------------------------------------------------------------------
