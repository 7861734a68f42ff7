"""The HF sampler on any device: seeded draws on the model's device, one host sync per decode step."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import DEVICE, make_ctx, write_recipe
from rlcli.generation import hf_sampler
from rlcli.generation.hf_sampler import TurnCache, sample_batch
from rlcli.generation.sampler import SamplingConfig

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]


@pytest.fixture(scope="module")
def policy():
    from rlcli.models.loading import load_policy
    from rlcli.recipe import ModelSection, QuantizationSection

    return load_policy(ModelSection(name="tiny-random", dtype="float32"), None, QuantizationSection(), trainable=False)


def _index(device: torch.device) -> torch.device:
    """A CUDA device with its index: a generator made on "cuda" draws on the current GPU, cuda:0."""
    return torch.device(device.type, device.index or 0) if device.type == "cuda" else device


def generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator(DEVICE).manual_seed(s) for s in seeds]


CONFIGS = [
    SamplingConfig(max_new_tokens=12),
    SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12),
    SamplingConfig(temperature=0, max_new_tokens=12),
    SamplingConfig(max_new_tokens=12, stop=["e"]),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "top-k-p", "greedy", "stop"])
def test_samples_depend_only_on_the_seed_not_on_the_batch(policy, cfg):
    model, tokenizer = policy
    batched = sample_batch(model, tokenizer, PROMPTS, generators([1, 2, 3]), cfg, [12, 3, 8])
    again = sample_batch(model, tokenizer, PROMPTS, generators([1, 2, 3]), cfg, [12, 3, 8])
    alone = sample_batch(model, tokenizer, PROMPTS[2:], generators([3]), cfg, [8])
    assert [s.ids for s in batched] == [s.ids for s in again]
    assert [s.logprobs for s in batched] == [s.logprobs for s in again]
    assert [len(s.ids) for s in batched] <= [12, 3, 8] and len(batched[1].ids) <= 3
    assert batched[2].ids == alone[0].ids
    assert batched[2].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)
    if cfg.temperature > 0:
        other_seed = sample_batch(model, tokenizer, PROMPTS[2:], generators([4]), cfg, [8])
        assert other_seed[0].ids != alone[0].ids


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["plain", "top-k-p"])
def test_a_shared_first_prompt_is_prefilled_once_and_samples_as_if_alone(policy, cfg, monkeypatch):
    """A group's episodes start from the same prompt: it is prefilled once and its cache copied to
    each of them; each still samples what it samples alone with its seed, and the next turn goes on
    from its own copy."""
    model, tokenizer = policy
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]]
    alone = [sample_batch(model, tokenizer, [p], generators([s]), cfg)[0] for p, s in zip(prompts, [1, 2, 3, 4])]
    rows = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: rows.append(k["input_ids"].shape[0]) or forward(*a, **k))
    cache = TurnCache()
    cache.align(["a", "b", "c", "d"])
    together = sample_batch(model, tokenizer, prompts, generators([1, 2, 3, 4]), cfg, turn_cache=cache)
    monkeypatch.undo()
    assert rows[0] == 2 and set(rows[1:]) == {4}
    assert [s.ids for s in together] == [s.ids for s in alone]
    for s, a in zip(together, alone):
        assert s.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert cache.ids == [p + s.ids[:-1] for p, s in zip(prompts, together)]
    second = [ids + [20, 21] for ids in cache.ids]
    continued = sample_batch(model, tokenizer, second, generators([5, 6, 7, 8]), cfg, turn_cache=cache)
    fresh = sample_batch(model, tokenizer, second, generators([5, 6, 7, 8]), cfg)
    assert [s.ids for s in continued] == [s.ids for s in fresh]


@pytest.mark.parametrize("seed", range(5))
def test_a_draw_is_the_one_torch_multinomial_makes(seed):
    """The sampler's draw reproduces torch.multinomial's for the same generator state, so recorded
    episodes from before the sync-free sampler replay unchanged."""
    from rlcli.generation.hf_sampler import _draw

    # On the CPU, where the episodes recorded before it were sampled.
    probs = torch.randn(3, 1000).mul(3).softmax(-1)
    probs[1, 500:] = 0  # top-k/top-p leave zeros
    reference, ours = (
        [torch.Generator().manual_seed(seed) for _ in range(3)],
        [torch.Generator().manual_seed(seed) for _ in range(3)],
    )
    for _ in range(3):
        expected = [int(torch.multinomial(probs[i], 1, generator=reference[i])) for i in range(3)]
        assert _draw(probs, ours, [True] * 3).tolist() == expected
    # A row that is not drawn leaves its generator untouched.
    before = ours[1].get_state()
    _draw(probs, ours, [True, False, True])
    assert torch.equal(ours[1].get_state(), before)


HOST_READS = ["tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "top-k-p", "greedy", "stop"])
def test_the_sampler_reads_from_the_device_once_per_step(policy, cfg, monkeypatch):
    """On a GPU every read of a tensor's value waits for the device; per row and per token they
    serialise the decode loop. Allowed: one read per step (the step's tokens), one at the end.

    Only the sampler's own reads count: transformers reads the attention mask once per forward to
    choose its attention kernel, before the forward's work is queued, so that read waits for little."""
    model, tokenizer = policy
    cache = TurnCache()
    cache.align(["a", "b", "c"])
    sample_batch(model, tokenizer, PROMPTS, generators([1, 2, 3]), cfg, turn_cache=cache)
    second = [p + [20, 21] for p in cache.ids]  # the next turn continues from the cache

    reads, forwards = [], []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if sys._getframe(1).f_code.co_filename == hf_sampler.__file__:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    samples = sample_batch(model, tokenizer, second, generators([4, 5, 6]), cfg, turn_cache=cache)
    monkeypatch.undo()

    assert max(len(s.ids) for s in samples) > 1
    assert len(reads) <= len(forwards) + 1, reads


def test_draws_use_generators_on_the_device_of_the_probabilities(policy, monkeypatch):
    """CUDA raises for a CPU generator; check every draw pairs a generator with a tensor on its device."""
    model, tokenizer = policy
    pairs = []
    exponential, multinomial = torch.Tensor.exponential_, torch.multinomial

    def checked_exponential(self, *args, generator=None, **kwargs):
        pairs.append((_index(generator.device), _index(self.device)))
        return exponential(self, *args, generator=generator, **kwargs)

    def checked_multinomial(probs, *args, generator=None, **kwargs):
        pairs.append((_index(generator.device), _index(probs.device)))
        return multinomial(probs, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch.Tensor, "exponential_", checked_exponential)
    monkeypatch.setattr(torch, "multinomial", checked_multinomial)
    sample_batch(model, tokenizer, PROMPTS, generators([1, 2, 3]), SamplingConfig(max_new_tokens=4))
    assert pairs and all(g == t for g, t in pairs)


def test_rollout_makes_its_generators_on_the_model_device(tmp_path, monkeypatch):
    from rlcli.engine.rollout import run_rollout_stage

    devices = []

    class Recording(torch.Generator):
        def __new__(cls, device=None):
            devices.append(device)
            return super().__new__(cls, device=device or "cpu")

    monkeypatch.setattr(torch, "Generator", Recording)
    recipe = write_recipe(tmp_path / "r.yaml", rollout={"tasks": 1, "group_size": 2, "max_new_tokens": 2})
    summary = run_rollout_stage(make_ctx(recipe, tmp_path / "runs"), stage="rollout", policy="base", split="train")
    assert summary.episodes == 2
    assert devices and all(d is not None and torch.device(d).type == DEVICE for d in devices), devices


@pytest.mark.parametrize("fn", ["judge", "reward_model"])
def test_model_rewards_go_on_the_device_they_are_given(fn, monkeypatch):
    """The judge and the reward model follow the recipe's model.device, not "cuda whenever there is one"."""
    from rlcli.models.cache import tiny_random_path
    from rlcli.recipe import RewardSpec
    from rlcli.rewards.scoring import build_reward_fns

    folder = str(tiny_random_path())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU the recipe does not use
    # Moving a model to "cuda" raises on this CPU build of torch.
    kwargs = {"model": folder} if fn == "judge" else {"model": folder, "label": 0}
    [reward] = build_reward_fns([RewardSpec(fn=fn, kwargs=kwargs)], device="cpu")
    net = reward.scorer.lm if fn == "judge" else reward.scorer.net
    assert net.device == torch.device("cpu")
