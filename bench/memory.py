"""Peak memory and time of one GRPO update at a 150k vocabulary: rlcli's update against TRL's loss.

    .venv/bin/python bench/memory.py                              # 8 x 2,048 tokens, 4 layers, bf16 and 4-bit
    .venv/bin/python bench/memory.py --seq-len 256 --layers 2     # a quick check that it runs (~1 min)

The model is a randomly initialised Qwen2 with Qwen2.5-0.5B's vocabulary (151,936 tokens), width
(896, 14 query and 2 key/value heads, MLP 4,864) and tied embeddings, but only `--layers` of its 24
layers, so a CPU can run it and no download is needed. It is saved once (bfloat16) in a temporary
folder; every measurement loads it in a fresh subprocess, whose peak RSS (ru_maxrss) is its own.

The batch: `--sequences` conversations of exactly `--seq-len` tokens, the same for both sides: a
system prompt shared by all, then a task prompt, then 6 assistant turns with 5 environment
observations between them (which do not train), random token ids; advantages +1/-1 alternately.
Both sides: LoRA r 16, alpha 32 on all linear layers (float32 adapter on bf16 or 4-bit weights), one
forward and backward over all sequences at once (micro-batch = batch), AdamW step, no gradient
checkpointing (`--gradient-checkpointing` turns it on for both), token-mean loss, clip 0.2/0.28.

- **rlcli**: `rlcli.engine.grpo.update.update` as `train grpo` calls it (chunked logprobs from the hidden
  states, length-sorted micro-batches, shared prefix), on TrainSequences built from the batch.
- **TRL**: `GRPOTrainer.compute_loss` (TRL's own `_compute_loss`: full-vocabulary logits for every
  completion position, `selective_log_softmax`, entropies), on the inputs its generation step would
  hand it: prompt = the shared system prompt and task prompt, completion = the rest, `tool_mask`
  zero on the observations, `loss_type="dapo"`; then backward and the same AdamW step. TRL's trainer
  is built (model, peft, optimizer settings) but its generation is not run.

Per row: RSS after loading (the load's peak), the process's peak RSS, the update's own growth over
the load, and the seconds of the last of `--steps` updates (the first pays one-time costs). The
table ends with rlcli / TRL peak and time ratios and rlcli's 4-bit / bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

VOCAB, HIDDEN, HEADS, KV_HEADS, MLP = 151_936, 896, 14, 2, 4_864
TURNS = 6
CONFIGS = ("rlcli-bf16", "trl-bf16", "rlcli-4bit", "trl-4bit")
LORA = {"r": 16, "alpha": 32}


def build_model(folder: Path, layers: int) -> None:
    """Qwen2.5-0.5B's shapes with `layers` layers, random weights, saved in bfloat16 with a tokenizer
    (tiny-random's: a tokenizer is only needed for loading; the batch is token ids)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_tokenizer
    from rlcli.recipe import ModelSection

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    load_tokenizer(ModelSection(name="tiny-random"), resolve_model("tiny-random")).save_pretrained(folder)


def conversation_layout(seq_len: int) -> list[tuple[int, bool]]:
    """(tokens, trainable) spans of one conversation: 1/8 prompt (of it 64 tokens of shared system
    prompt), then 6 assistant turns and 5 observations, the observations 2/5 of an assistant turn."""
    prompt = max(seq_len // 8, 66)
    rest = seq_len - prompt
    observation = rest * 2 // (TURNS * 5 + (TURNS - 1) * 2)
    turn = (rest - (TURNS - 1) * observation) // TURNS
    spans = [(prompt, False)]
    for t in range(TURNS):
        spans.append((turn, True))
        if t < TURNS - 1:
            spans.append((observation, False))
    spans[-1] = (spans[-1][0] + seq_len - sum(n for n, _ in spans), True)  # rounding goes to the last turn
    return spans


def make_batch(sequences: int, seq_len: int) -> list[dict]:
    """The conversations as token ids, trainable mask and advantage, from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (64,), generator=gen).tolist()
    rows = []
    for i in range(sequences):
        ids, mask = list(system), [0.0] * len(system)
        for k, (n, trainable) in enumerate(conversation_layout(seq_len)):
            n -= len(system) if k == 0 else 0  # the shared system prompt opens the task prompt
            ids += torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            mask += [float(trainable)] * n
        rows.append({"ids": ids, "mask": mask, "advantage": 1.0 if i % 2 == 0 else -1.0})
    return rows


def measure(config: str, folder: str, args) -> dict:
    """Runs inside the child process."""
    import torch

    torch.manual_seed(0)
    side, fmt = config.split("-")
    batch = make_batch(args.sequences, args.seq_len)
    times = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as work:
        model, step = (_rlcli if side == "rlcli" else _trl)(folder, fmt, batch, args, Path(work))
        load_peak = _peak_rss_mb()
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return {
        "config": config,
        "load_peak_mb": load_peak,
        "peak_mb": _peak_rss_mb(),
        "step_s": times[-1],
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _rlcli(folder: str, fmt: str, batch: list[dict], args, work: Path):
    import torch

    from rlcli.engine.grpo.update import TrainSequence, update
    from rlcli.models.loading import load_policy
    from rlcli.recipe import load_recipe

    recipe_file = work / "recipe.yaml"
    recipe_file.write_text(
        json.dumps(  # JSON is YAML
            {
                "run": {"name": "memory", "seed": 0},
                "model": {"name": folder, "dtype": "bfloat16", "device": "cpu", "max_length": args.seq_len + 64},
                "lora": {**LORA, "dropout": 0.0, "target_modules": "all-linear"},
                "quantization": "4bit" if fmt == "4bit" else "none",
                "env": {"name": "guess_number", "max_turns": TURNS},
                "rollout": {"tasks": 1, "group_size": len(batch), "temperature": 1.0},
                "grpo": {
                    "micro_batch_size": len(batch),
                    "clip_low": 0.2,
                    "clip_high": 0.28,
                    "aggregation": "token_mean",
                    "beta": 0.0,
                    "lr": 1e-5,
                    "gradient_checkpointing": args.gradient_checkpointing,
                },
            }
        )
    )
    recipe = load_recipe(recipe_file)
    model, _ = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    sequences = [
        TrainSequence(
            i, 0, r["ids"], r["mask"], [0.0] * len(r["ids"]), [0] * len(r["ids"]), [r["advantage"]] * len(r["ids"])
        )
        for i, r in enumerate(batch)
    ]
    ctx = types.SimpleNamespace(recipe=recipe)  # update reads only the recipe
    return model, lambda: update(ctx, model, optimizer, scheduler, sequences, 0)


def _trl(folder: str, fmt: str, batch: list[dict], args, work: Path):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlcli.models.loading import quantization_config
    from rlcli.recipe import QuantizationSection

    quant = quantization_config(QuantizationSection(mode=fmt), "cpu") if fmt == "4bit" else None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quant)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    n = len(batch)
    config = GRPOConfig(
        output_dir=str(work),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=args.seq_len,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        num_iterations=1,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=False,  # the weights are bf16 already; no autocast, as on rlcli's side
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * n),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules="all-linear",
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before compute_loss
    model = trainer.model
    model.train()
    prompt_len = conversation_layout(args.seq_len)[0][0]
    ids = torch.tensor([r["ids"] for r in batch])
    mask = torch.tensor([r["mask"] for r in batch])
    inputs = {
        "prompt_ids": ids[:, :prompt_len],
        "prompt_mask": torch.ones_like(ids[:, :prompt_len]),
        "completion_ids": ids[:, prompt_len:],
        "completion_mask": torch.ones_like(ids[:, prompt_len:]),
        "tool_mask": mask[:, prompt_len:].long(),
        "advantages": torch.tensor([r["advantage"] for r in batch]),
        "num_items_in_batch": mask[:, prompt_len:].sum(),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return model, step


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers (Qwen2.5-0.5B has 24).")
    parser.add_argument("--sequences", type=int, default=8, help="Conversations in the update.")
    parser.add_argument("--seq-len", type=int, default=2048, help="Tokens per conversation.")
    parser.add_argument("--steps", type=int, default=2, help="Updates per process; the last one is timed.")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="On for both sides.")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: one per core).")
    parser.add_argument("--json", type=Path, help="Also write the rows to this file.")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model", help=argparse.SUPPRESS)  # child mode: the saved model's folder
    parser.add_argument("--build", help=argparse.SUPPRESS)  # child mode: save the model in this folder
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one, args.model, args)))
        return
    if args.build:
        build_model(Path(args.build), args.layers)
        return

    console = Console()
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        console.print(f"[yellow]Load average {os.getloadavg()[0]:.1f}: times will be noisy.[/]")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-model-") as folder:
        # In a child too: a process starts with the peak RSS of the one that forked it (ru_maxrss
        # survives exec), so the parent stays small.
        with console.status(f"Building the {args.layers}-layer model"):
            subprocess.run(
                [sys.executable, __file__, "--build", folder, "--layers", str(args.layers)],
                check=True,
                capture_output=True,
            )
        child_args = [
            "--layers",
            str(args.layers),
            "--sequences",
            str(args.sequences),
            "--seq-len",
            str(args.seq_len),
            "--steps",
            str(args.steps),
            "--model",
            folder,
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
            *(["--threads", str(args.threads)] if args.threads else []),
        ]
        for config in args.configs:
            with console.status(f"Measuring {config}"):
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", config, *child_args],
                    check=False,
                    capture_output=True,
                    text=True,
                )
            if proc.returncode != 0:
                console.print(f"[red]{config} failed[/]:\n{proc.stderr[-3000:]}")
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    show(console, rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def show(console: Console, rows: list[dict], args) -> None:
    table = Table(
        title=(
            f"One GRPO update: {args.sequences} x {args.seq_len} tokens, vocab {VOCAB:,}, hidden {HIDDEN}, "
            f"{args.layers} layers, LoRA r {LORA['r']}"
        )
    )
    for name in ("config", "RSS after load MB", "peak RSS MB", "update's growth MB", "step s"):
        table.add_column(name, justify="left" if name == "config" else "right")
    by = {r["config"]: r for r in rows}
    for r in rows:
        table.add_row(
            r["config"],
            f"{r['load_peak_mb']:,.0f}",
            f"{r['peak_mb']:,.0f}",
            f"{r['peak_mb'] - r['load_peak_mb']:,.0f}",
            f"{r['step_s']:.2f}",
        )
    console.print(table)
    for fmt in ("bf16", "4bit"):
        ours, theirs = by.get(f"rlcli-{fmt}"), by.get(f"trl-{fmt}")
        if ours and theirs:
            console.print(
                f"{fmt}: rlcli / TRL peak RSS {ours['peak_mb'] / theirs['peak_mb']:.2f}x "
                f"(update's growth {_ratio(ours, theirs)}), step time {ours['step_s'] / theirs['step_s']:.2f}x"
            )
    if "rlcli-4bit" in by and "rlcli-bf16" in by:
        console.print(f"rlcli 4-bit / bf16 peak RSS: {by['rlcli-4bit']['peak_mb'] / by['rlcli-bf16']['peak_mb']:.2f}x")


def _ratio(ours: dict, theirs: dict) -> str:
    growth = theirs["peak_mb"] - theirs["load_peak_mb"]
    return f"{(ours['peak_mb'] - ours['load_peak_mb']) / growth:.2f}x" if growth > 0 else "n/a"


if __name__ == "__main__":
    main()
