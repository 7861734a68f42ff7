"""The OpenAI-compatible endpoint over the vLLM sampler (the engine `rlcli serve` and rollouts use where
vLLM is installed): concurrent clients served by one sampling call, with the tokens each gets alone."""

from __future__ import annotations

import threading
import time

import openai
import torch

from rlcli.generation.endpoint import Endpoint
from rlcli.generation.sampler import SamplingConfig
from test_vllm_engine import ENGINE_OPTIONS, merged_weights, needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)


@needs_vllm
def test_concurrent_clients_share_one_vllm_call(tiny64):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.generation.vllm_engine import VllmSampler, shared_engine

    engine = shared_engine(str(tiny64), **ENGINE_OPTIONS)
    if not engine.serves_base or engine.base_quantization != "none":  # another module's weights
        engine.load_weights(merged_weights(AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32)))
        engine.serves_base, engine.base_quantization = True, "none"
    tokenizer = AutoTokenizer.from_pretrained(tiny64)
    config = SamplingConfig(temperature=1.0, max_new_tokens=8)
    prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in range(4)]
    with Endpoint(VllmSampler(engine, config), tokenizer, "tiny64", defaults=config, max_length=1024) as endpoint:
        api = openai.OpenAI(base_url=endpoint.url(), api_key="unused", max_retries=0)
        alone = [
            api.chat.completions.create(model="m", messages=p, seed=n, logprobs=True) for n, p in enumerate(prompts)
        ]
        together: dict[int, openai.types.chat.ChatCompletion] = {}

        def ask(n: int) -> None:
            together[n] = api.chat.completions.create(model="m", messages=prompts[n], seed=n, logprobs=True)

        with endpoint.hold():
            threads = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            while endpoint.waiting() < 4:
                time.sleep(0.01)
        for thread in threads:
            thread.join()
    assert endpoint.batches == 5 and endpoint.requests == 8  # four calls alone, then one for the four together
    for n, reply in enumerate(alone):
        assert together[n].choices[0].message.content == reply.choices[0].message.content
    records = endpoint.calls()
    for record in records:
        assert len(record.logprobs) == len(record.completion_ids) and all(lp <= 0 for lp in record.logprobs)
