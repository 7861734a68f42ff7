"""The HF sampler and vLLM sample the same policy (rlcli.engine.parity; issue 31, item 8).

For the quickstart's first prompt and sampling (temperature 0.8, 12 new tokens, stop at a newline),
2,000 samples from each engine, through the Sampler interface the rollouts use:
- their first tokens are compared with each other and with the trainer's probabilities (chi-square);
- their mean sequence logprob under the trainer's model (an HF forward) is the same within a few
  standard errors;
- each engine's recorded logprobs are the trainer's recomputation.
The second test shows that the check can fail: 1,000 samples of vLLM at temperature 1.0 against the
HF sampler's at 0.8.

The model is the tiny head_dim-64 model of tests/models/test_vllm_engine.py, served by the session's shared
engine. Its random weights give a near-uniform next token (logits with a spread of 0.24), over which
no temperature can be told apart; its final norm is scaled up (its logits x 3) so that its first
token has a top probability of 0.44 at the recipe's temperature, more like a trained model's, and the engine
serves those weights for this module.
"""

from __future__ import annotations

import pytest
import torch

from rlcli.engine.parity import (
    chi_square_fit,
    chi_square_same,
    first_prompt_ids,
    first_tokens,
    mean_difference_z,
    next_token_probs,
    recomputed_logprobs,
    summarise,
)
from rlcli.generation.hf_sampler import HfSampler
from rlcli.generation.sampler import SamplingConfig
from rlcli.generation.vllm_engine import VllmSampler, merged_weights
from test_vllm_engine import ENGINE_OPTIONS, engine, needs_vllm, tiny64  # noqa: F401 (fixtures)

SAMPLES = 2000
HOTTER_SAMPLES = 1000  # enough: the check puts the hotter sampler 20 standard errors off
# The quickstart's rollout (recipes/quickstart.yaml), which its eval samples with too.
QUICKSTART = SamplingConfig(temperature=0.8, max_new_tokens=12, stop=["\n"])
SHARPEN = 3.0  # logits x 3: the first token's top probability goes from 0.015 to 0.44 at T = 0.8
# Engine and trainer both compute in float32: what is left is summation order, ~1e-6 on this model.
LOGPROB_TOLERANCE = 1e-4
# Same policy: p-values above this (a test that fails once in a thousand seeds), and mean sequence
# logprobs within this many standard errors. The samples are seeded, so the figures are fixed.
ALPHA = 1e-3
MAX_Z = 4.0


def sample_with(sampler, prompt: list[int], seeds: range):
    sampler.start(list(seeds))
    return sampler.sample(list(range(len(seeds))), [prompt] * len(seeds), [sampler.config.max_new_tokens] * len(seeds))


@pytest.fixture(scope="module")
def parity(tiny64):  # noqa: F811 (the fixture imported above)
    """The sharpened model, the prompt, the HF sampler's samples and vLLM's at the recipe's temperature,
    and vLLM's at temperature 1.0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.generation.vllm_engine import shared_engine

    model = AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32).to(ENGINE_OPTIONS["device"])
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    tokenizer = AutoTokenizer.from_pretrained(tiny64)
    prompt = first_prompt_ids(tokenizer, "guess_number", {"low": 1, "high": 16})
    hf = sample_with(HfSampler(model, tokenizer, QUICKSTART), prompt, range(SAMPLES))
    shared = shared_engine(str(tiny64), **ENGINE_OPTIONS)
    shared.load_weights(merged_weights(model))
    shared.serves_base = False  # whoever uses the engine next loads the weights it needs
    vllm = sample_with(VllmSampler(shared, QUICKSTART), prompt, range(SAMPLES))
    hotter = SamplingConfig(temperature=1.0, max_new_tokens=QUICKSTART.max_new_tokens, stop=QUICKSTART.stop)
    vllm_hotter = sample_with(VllmSampler(shared, hotter), prompt, range(HOTTER_SAMPLES))
    return model, prompt, hf, vllm, vllm_hotter


def compare(model, prompt, a, b):
    """The parity figures of samples a against samples b, both scored at the recipe's temperature."""
    temperature = QUICKSTART.logprob_temperature
    probs = next_token_probs(model, prompt, temperature)
    sums = [summarise(s, recomputed_logprobs(model, prompt, s, temperature)) for s in (a, b)]
    return {
        "same": chi_square_same(first_tokens(a), first_tokens(b)),
        "fit": [chi_square_fit(first_tokens(s), probs) for s in (a, b)],
        "logprob": sums,
        "z": mean_difference_z(*sums),
    }


@pytest.mark.slow
@needs_vllm
def test_the_engines_sample_the_same_policy(parity):
    model, prompt, hf, vllm, _ = parity
    figures = compare(model, prompt, hf, vllm)
    assert figures["same"].df >= 10  # enough first tokens that are not rare for the test to say something
    assert figures["same"].p > ALPHA, figures
    assert all(fit.p > ALPHA for fit in figures["fit"]), figures
    assert abs(figures["z"]) < MAX_Z, figures
    hf_logprobs, vllm_logprobs = figures["logprob"]
    assert hf_logprobs.max_gap < LOGPROB_TOLERANCE and vllm_logprobs.max_gap < LOGPROB_TOLERANCE, figures
    # Stop handling: both end their replies the same way, on the newline or the cap.
    assert {s.finished for s in hf} == {s.finished for s in vllm} == {True, False}
    assert abs(hf_logprobs.mean_tokens - vllm_logprobs.mean_tokens) < 0.5, figures


@pytest.mark.slow
@needs_vllm
def test_the_check_sees_a_sampler_at_another_temperature(parity):
    model, prompt, hf, _, vllm_hotter = parity
    figures = compare(model, prompt, hf, vllm_hotter)
    assert figures["same"].p < 1e-9, figures
    assert figures["fit"][0].p > ALPHA and figures["fit"][1].p < 1e-9, figures
    assert figures["z"] > 2 * MAX_Z, figures  # the hotter samples are less likely under the policy


@pytest.mark.slow
@needs_vllm
def test_vllm_samples_a_batch_of_prompts_over_a_steps_token_budget(engine):  # noqa: F811
    """vLLM's CPU build died on a seeded request whose prompt it prefilled in chunks ("CPU Generator
    does not use offset"): 40 distinct prompts of 120 tokens are over a step's 4,096 tokens. The
    engine now prefills whole prompts (vllm_engine._whole_prefills_on_cpu); each sample is still
    the one its seed gives alone."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 500, (120,), generator=generator).tolist() for _ in range(40)]
    together = engine.generate(prompts, list(range(40)), QUICKSTART)
    alone = engine.generate(prompts[-1:], [39], QUICKSTART)
    assert all(s.ids for s in together)
    assert together[-1] == alone[0]
