"""Typed records of the run database: what the engine, the reports and the CLI receive.

Each record mirrors one table (docs/database.md): JSON text columns arrive parsed, token blobs
arrive as lists, 0/1 columns as bools. Only store/ turns rows into records and records into rows.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rlcli.store.names import EvalStage, try_parse_stage


class EndReason(str, Enum):
    """Why an episode ended; the values are the strings stored in `episodes.end_reason`."""

    TERMINATED = "terminated"  # the env ended it
    TRUNCATED = "truncated"  # the env cut it off (its own time or step limit)
    MAX_TURNS = "max_turns"  # env.max_turns agent turns were played
    CONTEXT = "context"  # the next prompt would not fit in model.max_length
    LENGTH = "length"  # the last reply was cut by rollout.max_new_tokens
    ERROR = "error"  # the env failed; the episode carries the error
    ENV_TIMEOUT = "env_timeout"  # an env call outlasted env.step_timeout_s; the episode carries the error

    @property
    def hit_a_cap(self) -> bool:
        """Cut short by a length or turn cap rather than played to its end: this is what reward
        functions see as `truncated` and what `grpo.mask_truncated` leaves out of the loss."""
        return self in (EndReason.TRUNCATED, EndReason.MAX_TURNS, EndReason.CONTEXT, EndReason.LENGTH)


@dataclass(frozen=True)
class Run:
    name: str
    status: str  # created | running | done | failed
    recipe: dict[str, Any]  # the resolved recipe
    recipe_sha256: str
    recipe_path: str | None
    seed: int
    created_at: str
    updated_at: str
    versions: dict[str, str | None]
    git_sha: str | None
    hostname: str
    error: str | None = None  # why the last command on it failed

    @property
    def description(self) -> str:
        return self.recipe.get("run", {}).get("description") or ""


@dataclass(frozen=True)
class Stage:
    id: int
    run: str
    name: str  # sft, rollout/0, train/3, eval/base, ...
    status: str  # pending | running | done | failed
    params: dict[str, Any]
    result: dict[str, Any] | None  # the stage's summary, once done
    error: str | None
    started_at: str | None  # its first start
    finished_at: str | None  # the end of its last run
    pid: int | None
    elapsed_s: float | None = None  # seconds it worked, summed over its runs that ended; None: an older rlcli's row

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def duration_s(self) -> float | None:
        """The time the stage worked. A stage can run twice with hours of other stages between (an eval
        asked again for more tasks, a resume), so this is not its first start to its last end,
        except on an older rlcli's row, which has nothing else."""
        if self.elapsed_s is not None:
            return self.elapsed_s
        if not self.started_at or not self.finished_at:
            return None
        elapsed = dt.datetime.fromisoformat(self.finished_at) - dt.datetime.fromisoformat(self.started_at)
        return round(elapsed.total_seconds(), 3)


@dataclass(frozen=True)
class Turn:
    turn_index: int
    prompt_ids: list[int]  # every token the model saw for this turn
    completion_ids: list[int]  # the sampled tokens
    logprobs: list[float]  # sampling-time logprobs of completion_ids
    reward: float = 0.0
    text: str = ""
    observation: str = "[]"  # JSON messages the env answered with
    terminated: bool = False
    truncated: bool = False
    info: str = "{}"  # JSON
    gen_time_s: float = 0.0
    env_time_s: float = 0.0
    images: list[str] = field(default_factory=list)  # sha256 of the images in prompt_ids, in order


@dataclass(frozen=True)
class Episode:
    id: int | None  # None until stored
    run: str
    stage: str
    iteration: int | None
    split: str  # train | eval
    task_index: int
    sample_index: int
    seed: int
    policy: str  # base | expert | a checkpoint id | train/<i>
    status: str  # ok | failed
    end_reason: EndReason | None
    env_return: float
    success: bool
    num_turns: int
    num_tokens: int  # generated tokens
    task: dict[str, Any]
    messages: list[dict[str, Any]]
    template_consistent: bool
    error: str | None
    created_at: str
    attempts: int = 1  # times its stage played it: after a lost env, or a timeout with env.timeout_retries
    transient: bool = False  # failed in a way that need not recur (an env call timed out); stored: final
    lost: int = 0  # attempts whose env was lost with a worker killed for another episode, played again
    earlier_errors: str | None = None  # how each earlier attempt ended, one line each
    # grpo.branch: the episode this one branched from, and its turn where this one's own sampling began
    # (the turns before it replay the parent's actions); None for an episode played from its reset.
    parent_episode_id: int | None = None
    branch_turn: int | None = None
    turns: list[Turn] = field(default_factory=list, compare=False)  # loaded only by queries that need them
    # sha256 -> PNG of the images its turns show, to store with it (the images table); empty when read back
    images: dict[str, bytes] = field(default_factory=dict, compare=False)

    @property
    def hit_a_cap(self) -> bool:
        return self.end_reason is not None and self.end_reason.hit_a_cap


@dataclass(frozen=True)
class RewardRow:
    episode_id: int
    label_set: str
    component: str  # a reward function's name, or "total" for the weighted sum
    value: float
    weight: float | None
    error: str | None = None  # why the value is a fallback (e.g. a judge reply with no score)


@dataclass(frozen=True)
class LabelledEpisode:
    """An episode with its rewards under one label set (reward None: not labelled, e.g. failed)."""

    episode: Episode
    label_set: str | None
    reward: float | None
    components: dict[str, RewardRow] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeSummary:
    """What a rollout stage produced, as its stage result and its summary table show it."""

    episodes: int
    failed: int
    return_mean: float | None
    success_rate: float | None
    turns_mean: float | None
    tokens: int
    replayed_lost: int = 0  # plays again of episodes whose env was lost with a killed worker

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> EpisodeSummary:
        """A rollout stage's stored result (one from before rlcli counted replayed_lost has none)."""
        return cls(**{name: stored[name] for name in cls.__dataclass_fields__ if name in stored})


# Metrics each stage records on CUDA (engine/context.py), under the stage's own name: the peak of
# torch's allocator in this process (the trainer's tensors, and an in-process vLLM engine's, which
# allocates through it too) on the GPU where it was largest; what the vLLM engine took from its GPU
# when it started (weights, KV cache, CUDA graphs); and the peak of what torch's allocator reserved
# from the driver (allocated plus its cache), on the GPU where that was largest. A stage that used
# more than one GPU also records both peaks per device, under KEY/cuda:N. The CUDA context itself
# (about 0.5 GB per GPU) is in none of torch's counters.
GPU_PEAK_KEY = "perf/gpu_mem_peak_gb"
VLLM_MEMORY_KEY = "perf/vllm_mem_gb"
GPU_RESERVED_KEY = "perf/gpu_mem_reserved_gb"
GPU_MEMORY_KEYS = (GPU_PEAK_KEY, VLLM_MEMORY_KEY, GPU_RESERVED_KEY)


@dataclass(frozen=True)
class PlayedGame:
    """A held-out two-player game, as the ratings read it: who played whom, and the first one's score
    (1 a win, 0.5 a draw, 0 a loss)."""

    player: str  # the evaluated policy: base, expert or ckpt-<id>
    opponent: str  # random, bot, base or ckpt-<id>
    score: float


@dataclass(frozen=True)
class Metric:
    run: str
    stage: str
    step: int
    key: str  # namespaced: rollout/reward_mean, train/kl, perf/tokens_per_s
    value: float
    created_at: str


@dataclass(frozen=True)
class Checkpoint:
    id: int
    run: str
    stage: str
    iteration: int
    path: str
    kind: str  # lora | full
    created_at: str


@dataclass(frozen=True)
class EvalResult:
    id: int | None  # None until stored
    run: str
    stage: str
    checkpoint: str  # base | sft | latest | best | expert | an id, as asked
    checkpoint_id: int | None  # the resolved checkpoint, None for the base model
    split: str
    tasks: int
    k: int
    success_rate: float
    ci_low: float
    ci_high: float
    mean_return: float
    pass_at_k: float
    avg_at_k: float
    mean_turns: float
    mean_tokens: float
    details: dict[str, Any]
    created_at: str

    @property
    def label(self) -> str:
        """A short display name that tells checkpoints apart: "latest" (the newest) and "best" (the highest
        held-out success) name other checkpoints as a run goes on, so say which it was: `latest (#33)`,
        `best (#25)`; a checkpoint asked for by id is `#25`.
        How it sampled is `decoding`, a column of its own in tables."""
        which, ckpt = self.checkpoint, self.checkpoint_id
        if ckpt is None:
            return which
        return f"#{ckpt}" if which == str(ckpt) else f"{which} (#{ckpt})"

    @property
    def decoding(self) -> str:
        """How the eval sampled: greedy, or the temperature and samples per task (t0.8-k4)."""
        stage = try_parse_stage(self.stage)
        return (stage.decoding if isinstance(stage, EvalStage) else "") or "greedy"

    @property
    def opponent(self) -> str | None:
        """A two-player game's opponent named by eval.opponents (random, bot, base, ckpt-<id>); else None."""
        stage = try_parse_stage(self.stage)
        return stage.opponent if isinstance(stage, EvalStage) else None


@dataclass(frozen=True)
class RecipeVersion:
    """One entry of a run's recipe history: the recipe, the hashes of its code files, and why it was recorded."""

    id: int
    run: str
    recipe: dict[str, Any]
    recipe_sha256: str
    code: dict[str, str]  # path as the recipe names it -> SHA-256 of the file
    reason: str
    created_at: str
