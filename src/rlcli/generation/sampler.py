"""The seam every caller generates through: sampling settings, a sample, and the `Sampler` protocol.

Two samplers implement it: `hf_sampler.HfSampler` (rlcli's own decode loop over a transformers
model) and `vllm_engine.VllmSampler` (an in-process vLLM engine); `engines.make_sampler` picks one.
Rollouts, evaluation, the judge and the asynchronous rollout worker take a `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rlcli.models import vision

if TYPE_CHECKING:
    from rlcli.recipe import RolloutSection


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)

    @property
    def logprob_temperature(self) -> float:
        """The temperature under which logprobs are recorded (and recomputed in training)."""
        return self.temperature if self.temperature > 0 else 1.0


def sampling_config(rollout_cfg: RolloutSection) -> SamplingConfig:
    """The recipe's sampling settings (its `rollout` section)."""
    return SamplingConfig(
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        top_k=rollout_cfg.top_k,
        max_new_tokens=rollout_cfg.max_new_tokens,
        stop=list(rollout_cfg.stop),
    )


@dataclass
class Sample:
    ids: list[int]
    logprobs: list[float]
    finished: bool  # ended on an eos token or a stop string (not on the token cap)


class Sampler(Protocol):
    """How rollouts generate: a chunk of episodes, each with its own sample seed, played turn by turn.

    `start` begins a chunk; each `sample` call is one turn of the chunk's episodes named by `rows`
    (indices into the seeds given to `start`). An episode's tokens depend on its seed and its
    prompts only, never on which other episodes share the batch.
    images: a vision-language model's, those of each prompt in the order of their tokens (None: a
    text model's prompts).
    """

    config: SamplingConfig

    def start(self, seeds: list[int]) -> None: ...

    def sample(
        self,
        rows: list[int],
        prompts: list[list[int]],
        budgets: list[int],
        images: list[list[vision.ImageRef]] | None = None,
    ) -> list[Sample]: ...
