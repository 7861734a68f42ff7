"""Where the memory plan's activation constant comes from: the bytes autograd keeps for the backward, a
token a layer, of a Qwen2 decoder layer with LoRA on every linear layer, at Qwen2.5-1.5B's and -7B's
widths and one narrower MLP, against the plan's 37 x hidden + 10 x intermediate (bfloat16).

    .venv/bin/python bench/plan_calibration.py            # about a minute on 2 cores
    .venv/bin/python bench/plan_calibration.py --4bit     # the same with bitsandbytes 4-bit base weights

Saved tensors are counted by their storage (each once), weights excluded; the per-token figure is the
difference between 2 and 4 layers and between 128 and 512 tokens, so embeddings, the head and anything
fixed per layer drop out. Runs on the CPU: what autograd saves does not depend on the device (SDPA keeps
no tokens x tokens scores on either).
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch

SHAPES = {  # hidden, intermediate, attention heads, KV heads
    "Qwen2.5-1.5B": (1536, 8960, 12, 2),
    "narrow MLP": (1536, 3072, 12, 2),
    "Qwen2.5-7B": (3584, 18944, 28, 4),
}


def saved_bytes(shape: tuple[int, int, int, int], layers: int, tokens: int, four_bit: bool) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

    hidden, inner, heads, kv = shape
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inner,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=1024,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if four_bit:
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            quant = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
            model = Qwen2ForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.bfloat16)
        for module in model.modules():  # rlcli's loader does the same (docs/models.md)
            if type(module).__name__ == "Linear4bit":
                module.support_avx512bf16_for_cpu = False
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear")).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 1024, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model.model.model(input_ids=ids)
    return sum(kept.values())


def per_token_per_layer(shape: tuple[int, int, int, int], four_bit: bool) -> float:
    def per_layer(tokens: int) -> float:
        return (saved_bytes(shape, 4, tokens, four_bit) - saved_bytes(shape, 2, tokens, four_bit)) / 2

    return (per_layer(512) - per_layer(128)) / (512 - 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--4bit", dest="four_bit", action="store_true", help="bitsandbytes 4-bit base weights")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    print("| shape | hidden | intermediate | measured B/token/layer | plan (37 h + 10 i) | plan / measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        measured = per_token_per_layer(shape, args.four_bit)
        planned = 37 * shape[0] + 10 * shape[1]
        print(f"| {name} | {shape[0]} | {shape[1]} | {measured:,.0f} | {planned:,} | {planned / measured:.3f} |")


if __name__ == "__main__":
    main()
