"""`rlcli envs audit`: check an environment before training on it.

GRPO learns whatever earns reward, so an env with a loophole trains the loophole, and held-out tasks
that are also training tasks report memory as skill. The audit plays the env with policies that know
nothing (an empty reply, random words, the prompt repeated back, the longest reply the token cap
allows, one answer every time) and with the env's expert, and checks two properties the rest of rlcli
relies on:

- **Replay**: a seed and the same actions give the same observations, rewards and endings. Resume
  after a kill and branching from stored turns both rebuild an env's state this way.
- **Held-out tasks stay out of training**: a held-out task leaks when its first observation and its
  task (`info["task"]` from reset) are those of a training task. An observation that many tasks share
  (a guessing game's opening) tells the policy nothing, so it is not a leak.

Findings (each one sentence): an empty reply that succeeds at all; another knowing-nothing policy that
succeeds in more than `max_success` of its episodes (chance in a small answer space stays below it: a
maze walked at random, one number of sixteen) or earns at least half the expert's mean return; an env that raises on a reply, which would drop that episode from training and from eval's
success rate; replays that differ; held-out tasks that leak beyond `max_overlap`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from rlcli.engine.evaluate import wilson_interval
from rlcli.envs.protocol import EnvFactory, EnvFailure, as_messages, call_with_timeout, task_seed
from rlcli.envs.tool_use import without_call_records
from rlcli.store.records import Turn

if TYPE_CHECKING:
    from rlcli.recipe import Recipe

# Words for the random-text policy: common English plus the shapes answers take in the built-in envs,
# so that a grader that accepts anything containing a number or a tag is caught.
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "is",
    "it",
    "yes",
    "no",
    "maybe",
    "answer",
    "7",
    "42",
    "3",
    "left",
    "right",
    "up",
    "down",
    "click",
    "<answer>",
    "</answer>",
    "I",
    "think",
    "so",
]


@dataclass(frozen=True)
class AuditSettings:
    episodes: int = 32  # per policy; also the held-out tasks compared for leaks
    train_tasks: int = 256  # training seeds [0, train_tasks) compared with the held-out ones
    eval_seed_start: int = 1_000_000
    max_turns: int = 8
    step_timeout_s: float = 30.0
    reply_tokens: int = 64  # the token cap a rollout replies within (the longest-reply policy fills it)
    max_success: float = 0.25  # share of successes chance may give a knowing-nothing policy (not the empty reply)
    max_overlap: float = 0.05
    replays: int = 4  # seeds played twice for the replay check


TRAIN_TASKS_CAP = 2000  # training seeds compared by default: a large pool's leaks show in its first ones


def settings_for(recipe: Recipe, episodes: int, train_tasks: int | None) -> AuditSettings:
    """The audit of the env as `recipe` trains on it: its horizon (the longest of a schedule), token
    cap, step time limit, held-out seeds, and its training pool (env.tasks, else the tasks its GRPO
    iterations and expert demos take), capped at TRAIN_TASKS_CAP unless `train_tasks` is given."""
    env = recipe.env
    horizon = env.max_turns if isinstance(env.max_turns, int) else max(turns for _, turns in env.max_turns)
    if train_tasks is None:
        pool = env.tasks[1] if env.tasks else recipe.rollout.tasks * recipe.grpo.iterations
        demos = recipe.sft.demos if recipe.sft.source == "expert" else 0
        train_tasks = min(max(pool, demos), TRAIN_TASKS_CAP)
    return AuditSettings(
        episodes=episodes,
        train_tasks=train_tasks,
        eval_seed_start=env.eval_seed_start,
        max_turns=horizon,
        step_timeout_s=env.step_timeout_s,
        reply_tokens=recipe.rollout.max_new_tokens,
    )


# A policy sees the episode's messages so far and its own random stream, and replies.
Policy = Callable[[list[dict], random.Random], str]


@dataclass
class Played:
    """One episode as the audit saw it: what came back from each call, for scores and replays."""

    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # each observation as canonical JSON
    rewards: list[float] = field(default_factory=list)
    total: float = 0.0
    success: bool = False
    task: str = ""  # info["task"] from reset, as canonical JSON
    error: str | None = None  # what the env raised, if it did


@dataclass(frozen=True)
class PolicyScore:
    policy: str
    episodes: int
    successes: int
    success_interval: tuple[float, float]
    mean_return: float
    errors: int
    first_error: str | None

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0


@dataclass(frozen=True)
class AuditReport:
    env: str
    scores: list[PolicyScore]
    replays_checked: int
    replay_mismatch: str | None  # the first difference between two plays of one seed, if any
    held_out: int
    leaked: list[tuple[int, int]]  # (held-out seed, training seed) pairs that are the same task
    findings: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "policies": [
                {
                    "policy": s.policy,
                    "episodes": s.episodes,
                    "success_rate": s.success_rate,
                    "success_interval": list(s.success_interval),
                    "mean_return": s.mean_return,
                    "errors": s.errors,
                    "first_error": s.first_error,
                }
                for s in self.scores
            ],
            "replay": {"seeds": self.replays_checked, "mismatch": self.replay_mismatch},
            "held_out": {"tasks": self.held_out, "leaked": [list(pair) for pair in self.leaked]},
            "findings": self.findings,
        }


def _canonical(value: Any) -> str:
    """`value` as JSON that two equal observations share: images by their pixels' hash (a PIL image's
    repr holds its address), and a tool message's `call` left out (it records the call's latency)."""

    def plain(item: Any) -> Any:
        if hasattr(item, "tobytes"):
            return f"image {getattr(item, 'size', '')} {hashlib.sha256(item.tobytes()).hexdigest()}"
        return repr(item)

    if isinstance(value, list):
        value = without_call_records(value)
    return json.dumps(value, sort_keys=True, default=plain)


def _last_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        content = message.get("content")
        if isinstance(content, str) and message.get("role") != "assistant":
            return content
    return ""


def degenerate_policies(reply_tokens: int, constant: str) -> dict[str, Policy]:
    """The policies that know nothing about the task, by name."""
    return {
        "empty reply": lambda messages, rng: "",
        "random words": lambda messages, rng: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))),
        "prompt repeated": lambda messages, rng: _last_text(messages),
        "longest reply": lambda messages, rng: " ".join(rng.choice(WORDS) for _ in range(reply_tokens)),
        "same answer": lambda messages, rng: constant,
    }


def play(factory: EnvFactory, seed: int, next_action: Callable[[list[dict]], str], settings: AuditSettings) -> Played:
    """One episode of a fresh env on task `seed`, each action from `next_action(messages so far)`."""
    played, messages = Played(), []
    env = factory()
    try:
        observation, info = call_with_timeout(env.reset, settings.step_timeout_s, seed)
        played.observations.append(_canonical(observation))
        played.task = _canonical(info.get("task"))
        messages = as_messages(observation)
        for _ in range(settings.max_turns):
            action = next_action(messages)
            played.actions.append(action)
            observation, reward, terminated, truncated, info = call_with_timeout(
                env.step, settings.step_timeout_s, action
            )
            played.observations.append(_canonical(observation))
            played.rewards.append(float(reward))
            played.total += float(reward)
            played.success = bool(info.get("success", False))
            messages = [*messages, {"role": "assistant", "content": action}, *as_messages(observation)]
            if terminated or truncated:
                break
    except EnvFailure as exc:
        played.error = str(exc)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
    return played


def _reply(policy: Policy, rng: random.Random, messages: list[dict]) -> str:
    return policy(messages, rng)


def has_expert(factory: EnvFactory) -> bool:
    """Whether the env has `expert_action()` (optional in the Env contract)."""
    probe = factory()
    found = callable(getattr(probe, "expert_action", None))
    close = getattr(probe, "close", None)
    if callable(close):
        close()
    return found


def play_expert(factory: EnvFactory, seed: int, settings: AuditSettings) -> Played:
    """The expert's episode: it reads the env's own state, so the factory's env is kept to ask it."""
    made: list[Any] = []

    def keep() -> Any:
        made.append(factory())
        return made[-1]

    return play(keep, seed, lambda messages: made[-1].expert_action(), settings)


def score(policy: str, episodes: list[Played]) -> PolicyScore:
    successes = sum(ep.success for ep in episodes)
    errors = [ep.error for ep in episodes if ep.error is not None]
    return PolicyScore(
        policy,
        len(episodes),
        successes,
        wilson_interval(successes, len(episodes)),
        sum(ep.total for ep in episodes) / len(episodes) if episodes else 0.0,
        len(errors),
        errors[0] if errors else None,
    )


def replay_mismatch(first: Played, second: Played, seed: int) -> str | None:
    """Where two plays of task `seed` with the same actions differ, or None."""
    if first.error or second.error:
        return None  # an env that raised is a finding of its own
    for turn, (a, b) in enumerate(zip(first.observations, second.observations)):
        if a != b:
            what = "the reset's observation" if turn == 0 else f"the observation after action {turn}"
            return f"seed {seed}: {what} differs between two plays with the same actions"
    if first.rewards != second.rewards:
        return f"seed {seed}: the rewards differ between two plays with the same actions ({first.rewards} vs {second.rewards})"
    if len(first.observations) != len(second.observations):
        return f"seed {seed}: one play ended after {len(first.rewards)} actions, the other after {len(second.rewards)}"
    return None


def replays_alike(factory: EnvFactory, seed: int, original: Played, settings: AuditSettings) -> str | None:
    """Play task `seed` again in a fresh env with `original`'s actions: where the two plays differ, or None."""
    moves = iter(original.actions)
    again = play(factory, seed, lambda messages: next(moves), replace(settings, max_turns=len(original.actions)))
    return replay_mismatch(original, again, seed)


def replay_check(factory: EnvFactory, seed: int, settings: AuditSettings) -> str | None:
    """The audit's replay check on one task: the expert's episode (random words' for an env without an
    expert) played again with the same actions; where the plays differ, or None."""
    if has_expert(factory):
        original = play_expert(factory, seed, settings)
    else:
        words = degenerate_policies(settings.reply_tokens, "yes")["random words"]
        original = play(factory, seed, partial(_reply, words, random.Random(seed)), settings)
    return replays_alike(factory, seed, original, settings)


def stored_play(opening: list[dict], turns: list[Turn]) -> Played:
    """Stored turns as the audit sees a play (canonical observations, rewards), to compare a branch's
    replayed turns with its parent's by `replay_mismatch`: `opening` is the reset's messages."""
    played = Played(observations=[_canonical(opening)])
    for turn in turns:
        played.actions.append(turn.text)
        played.observations.append(_canonical(json.loads(turn.observation)))
        played.rewards.append(float(turn.reward or 0.0))
    return played


def leaks(factory: EnvFactory, settings: AuditSettings) -> tuple[int, list[tuple[int, int]]]:
    """(held-out tasks compared, the (held-out seed, training seed) pairs that are one task)."""
    opening: dict[tuple[str, str], int] = {}  # (first observation, task) -> a training seed showing it
    tasks_of: dict[str, set[str]] = {}  # first observation -> the tasks it opens
    reset_only = replace(settings, max_turns=0)
    for seed in range(settings.train_tasks):
        ep = play(factory, task_seed("train", seed, settings.eval_seed_start), lambda m: "", reset_only)
        if ep.error is None:
            opening.setdefault((ep.observations[0], ep.task), seed)
            tasks_of.setdefault(ep.observations[0], set()).add(ep.task)
    leaked = []
    for index in range(settings.episodes):
        seed = task_seed("eval", index, settings.eval_seed_start)
        ep = play(factory, seed, lambda m: "", reset_only)
        if ep.error is not None:
            continue
        # An opening shared by different tasks gives nothing away: the policy cannot tell them apart.
        informative = len(tasks_of.get(ep.observations[0], set())) <= 1
        if informative and (ep.observations[0], ep.task) in opening:
            leaked.append((seed, opening[(ep.observations[0], ep.task)]))
    return settings.episodes, leaked


def audit(
    env: str, factory: EnvFactory, settings: AuditSettings, on_policy: Callable[[str], None] | None = None
) -> AuditReport:
    """Play every policy on the held-out seeds, check replays and leaks; the findings say what is wrong."""
    seeds = [task_seed("eval", i, settings.eval_seed_start) for i in range(settings.episodes)]
    played: dict[str, list[Played]] = {}
    if has_expert(factory):
        if on_policy:
            on_policy("expert")
        played["expert"] = [play_expert(factory, seed, settings) for seed in seeds]
    # "same answer" repeats the expert's first move on the first task: an answer in the env's format.
    constant = played["expert"][0].actions[0] if "expert" in played and played["expert"][0].actions else "yes"
    for name, policy in degenerate_policies(settings.reply_tokens, constant).items():
        if on_policy:
            on_policy(name)
        played[name] = []
        for index, seed in enumerate(seeds):
            played[name].append(play(factory, seed, partial(_reply, policy, random.Random(index)), settings))
    scores = [score(name, episodes) for name, episodes in played.items()]

    # Replay the expert's episodes (random words' without one) with the same actions, in a fresh env.
    mismatch = None
    originals = played.get("expert", played["random words"])[: settings.replays]
    for seed, original in zip(seeds, originals):
        mismatch = replays_alike(factory, seed, original, settings)
        if mismatch:
            break
    held_out, leaked = leaks(factory, settings)
    findings = _findings(scores, mismatch, held_out, leaked, settings)
    return AuditReport(env, scores, len(originals), mismatch, held_out, leaked, findings)


def _findings(
    scores: list[PolicyScore],
    mismatch: str | None,
    held_out: int,
    leaked: list[tuple[int, int]],
    settings: AuditSettings,
) -> list[str]:
    findings = []
    expert = next((s for s in scores if s.policy == "expert"), None)
    for s in scores:
        if s.errors:
            findings.append(
                f"The env raised on the {s.policy} policy's replies in {s.errors} of {s.episodes} episodes "
                f"({s.first_error}); such episodes are dropped from training and from eval's success rate."
            )
        if s.policy == "expert":
            continue
        # An empty reply knows nothing at all: any success is a loophole. The other policies may hit a
        # small answer space (a maze walked at random, one number of sixteen) by chance.
        limit = 0.0 if s.policy == "empty reply" else settings.max_success
        if s.success_rate > limit:
            findings.append(
                f"The {s.policy} policy succeeds in {s.successes} of {s.episodes} episodes (more than "
                f"{limit:.0%}): the env rewards a reply that knows nothing."
            )
        elif expert is not None and expert.mean_return > 0 and s.mean_return >= expert.mean_return / 2:
            findings.append(
                f"The {s.policy} policy earns a mean return of {s.mean_return:g}, at least half the expert's "
                f"{expert.mean_return:g}: the env rewards a reply that knows nothing."
            )
    if mismatch:
        findings.append(f"The env does not replay: {mismatch}.")
    if held_out and len(leaked) / held_out > settings.max_overlap:
        seed, train = leaked[0]
        findings.append(
            f"{len(leaked)} of {held_out} held-out tasks are also training tasks (more than "
            f"{settings.max_overlap:.0%}; e.g. held-out seed {seed} is training seed {train})."
        )
    return findings
