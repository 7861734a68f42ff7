"""Whether the HF sampler and vLLM sample the same policy, on SmolLM2-135M and the quickstart.

    .venv/bin/python bench/engine_parity.py                         # 3000 samples per engine, 256 games
    .venv/bin/python bench/engine_parity.py --run quickstart --runs-dir runs --games 256
    .venv/bin/python bench/engine_parity.py --quick                 # 300 samples, 16 games, base only

What is measured (rlcli.engine.parity; tests/models/test_engine_parity.py checks the same on the tiny model):
  * first token: for the quickstart's first prompt (guess_number's first observation through the
    chat template, as the rollout renders it), --samples samples from each engine at the recipe's
    temperature and token budget, stop strings included, through the Sampler interface the
    rollouts use (HfSampler; VllmSampler over the engine `policy_engine` builds for the recipe).
    Their first tokens are compared with each other (chi-square homogeneity) and with the trainer's
    probabilities (goodness of fit); tokens expected fewer than 5 times are pooled into one cell.
    Per policy in --first-token (base, and the SFT checkpoint when the run has one: vLLM then serves
    the LoRA merged into the weights, as after every GRPO sync).
  * sequence logprob: the mean, over each engine's samples, of the sample's logprob under the
    trainer's model (an HF forward at the recipe's temperature, as GRPO recomputes it), with a 95%
    interval, and z = (HF - vLLM) / standard error of the difference; plus the largest gap between
    an engine's recorded token logprobs and that recomputation.
  * held-out success: base, SFT and final (`latest`, the newest checkpoint) of --run on the first
    --games held-out games, each checkpoint played by each engine, one game per task at the recipe's
    eval temperature: what `rlcli eval` does (the same collect over the eval split), recorded in
    scratch runs under --out (parity-hf, parity-vllm) so that the source run is only read.
    Skipped for a checkpoint the run does not have.

Threads: torch's default unless --threads; vLLM's OpenMP threads are bound to as many cores. On a
machine shared with other work the figures are unaffected (none is a timing); the run just takes longer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(stderr=True, highlight=False)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--run", default="quickstart", help="the run whose checkpoints are evaluated")
    parser.add_argument("--runs-dir", default="runs", help="where --run is recorded")
    parser.add_argument("--out", default="runs/engine-parity", help="runs dir of the scratch eval runs")
    parser.add_argument("--samples", type=int, default=3000, help="samples per engine and policy (first token)")
    parser.add_argument("--first-token", nargs="*", default=["base", "sft"], help="policies of the first-token part")
    parser.add_argument("--games", type=int, default=256, help="held-out games per checkpoint and engine")
    parser.add_argument("--checkpoints", nargs="*", default=["base", "sft", "latest"])
    parser.add_argument("--chunk", type=int, default=256, help="samples per sampler call")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--quick", action="store_true", help="300 samples, 16 games, base only")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.games, args.first_token, args.checkpoints = 300, 16, ["base"], ["base"]
    return args


def source_checkpoint(args, which: str):
    """(found, checkpoint) of --run: base is (True, None); a checkpoint the run lacks is (False, None)."""
    from rlcli.errors import UsageError
    from rlcli.store.checkpoints import resolve_checkpoint
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

    if which == "base":
        return True, None
    if not (Path(args.runs_dir) / "rlcli.db").is_file():
        return False, None
    rundb = RunDB.open(args.runs_dir)
    try:
        return True, resolve_checkpoint(RunStore(rundb, args.run), which)
    except (UsageError, KeyError, ValueError):
        return False, None
    finally:
        rundb.close()


def load(recipe, ckpt):
    from rlcli.models.loading import load_policy

    return load_policy(
        recipe.model, recipe.lora, recipe.quantization, adapter=ckpt.path if ckpt else None, trainable=False
    )


def samplers(args, model, tokenizer, sampling, ckpt):
    """The HF sampler and the vLLM sampler of one policy, built as a rollout builds them."""
    from rlcli.generation.engines import make_sampler
    from rlcli.recipe import load_recipe

    out = {}
    for engine in ("hf", "vllm"):
        recipe = load_recipe(Path(args.recipe), [f"rollout.engine={engine}"])
        folder = ckpt.path if ckpt else None
        out[engine] = make_sampler(recipe, model, tokenizer, sampling, base=ckpt is None, checkpoint_folder=folder)
    return out


def sample_many(sampler, prompt: list[int], samples: int, chunk: int, seed0: int):
    out = []
    for start in range(0, samples, chunk):
        seeds = list(range(seed0 + start, seed0 + min(samples, start + chunk)))
        sampler.start(seeds)
        out += sampler.sample(
            list(range(len(seeds))), [prompt] * len(seeds), [sampler.config.max_new_tokens] * len(seeds)
        )
    return out


def first_token_part(args, recipe, which: str, ckpt) -> dict:
    from rlcli.engine import parity
    from rlcli.generation.sampler import sampling_config
    from rlcli.store.evals import eval_decoding

    model, tokenizer = load(recipe, ckpt)
    sampling = sampling_config(recipe.rollout)
    sampling.temperature = eval_decoding(recipe)[0]
    prompt = parity.first_prompt_ids(tokenizer, recipe.env.name, recipe.env.kwargs)
    got, seconds = {}, {}
    for engine, sampler in samplers(args, model, tokenizer, sampling, ckpt).items():
        start = time.perf_counter()
        got[engine] = sample_many(sampler, prompt, args.samples, args.chunk, seed0=0)
        seconds[engine] = time.perf_counter() - start
        console.print(f"{which}: {args.samples} samples from {engine} in {seconds[engine]:.0f} s")
    temperature = sampling.logprob_temperature
    probs = parity.next_token_probs(model, prompt, temperature)
    summaries = {
        engine: parity.summarise(s, parity.recomputed_logprobs(model, prompt, s, temperature))
        for engine, s in got.items()
    }
    firsts = {engine: parity.first_tokens(s) for engine, s in got.items()}
    same = parity.chi_square_same(firsts["hf"], firsts["vllm"])
    fits = {engine: parity.chi_square_fit(firsts[engine], probs) for engine in got}
    top = probs.topk(3)
    return {
        "policy": which,
        "checkpoint": ckpt.path if ckpt else None,
        "prompt_tokens": len(prompt),
        "temperature": sampling.temperature,
        "samples": args.samples,
        "top_first_tokens": [
            {"token": tokenizer.convert_ids_to_tokens(int(t)), "p": float(p), **{e: firsts[e][int(t)] for e in got}}
            for p, t in zip(top.values, top.indices)
        ],
        "chi_square_same": vars(same),
        "chi_square_fit": {engine: vars(fit) for engine, fit in fits.items()},
        "logprob": {engine: vars(summary) for engine, summary in summaries.items()},
        "z": parity.mean_difference_z(summaries["hf"], summaries["vllm"]),
        "finished": {engine: sum(s.finished for s in got[engine]) / len(got[engine]) for engine in got},
        "seconds": seconds,
    }


def heldout_part(args, which: str, ckpt) -> dict:
    """One checkpoint on the first --games held-out games with each engine (rlcli eval's collect)."""
    from rlcli.cli.common import open_run
    from rlcli.engine.evaluate import eval_metrics
    from rlcli.engine.rollout import collect
    from rlcli.generation.engines import make_sampler
    from rlcli.generation.sampler import sampling_config
    from rlcli.store.episodes import stage_episodes
    from rlcli.store.evals import eval_decoding

    out = {"checkpoint": which, "path": ckpt.path if ckpt else None}
    model = tokenizer = None
    for engine in ("hf", "vllm"):
        overrides = [f"rollout.engine={engine}"]
        with open_run(Path(args.recipe), f"parity-{engine}", Path(args.out), overrides, force=True) as ctx:
            recipe = ctx.recipe
            if model is None:
                model, tokenizer = load(recipe, ckpt)
            sampling = sampling_config(recipe.rollout)
            sampling.temperature = eval_decoding(recipe)[0]
            folder = ckpt.path if ckpt else None
            sampler = make_sampler(recipe, model, tokenizer, sampling, base=ckpt is None, checkpoint_folder=folder)
            # Named by the source run and checkpoint id, so that a re-run resumes it and another run's differs.
            stage = f"eval-{args.run}-{ckpt.id}" if ckpt else "eval-base"
            start = time.perf_counter()
            collect(
                ctx,
                stage=stage,
                policy_label=which,
                sampler=sampler,
                tokenizer=tokenizer,
                task_indices=list(range(args.games)),
                group_size=1,
                split="eval",
                progress_label=f"{which} {engine}",
            )
            metrics = eval_metrics(stage_episodes(ctx.store, stage), 1)
        out[engine] = {
            k: metrics[k] for k in ("tasks", "success_rate", "ci_low", "ci_high", "mean_turns", "mean_tokens")
        }
        out[engine]["seconds"] = time.perf_counter() - start
        out[engine]["temperature"] = sampling.temperature
    return out


def main() -> None:
    args = parse_args()
    import torch

    from rlcli.recipe import load_recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = load_recipe(Path(args.recipe))
    threads = torch.get_num_threads()
    figures: dict = {"recipe": args.recipe, "run": args.run, "threads": threads, "first_token": [], "heldout": []}
    for which in args.first_token:
        found, ckpt = source_checkpoint(args, which)
        if not found:
            console.print(f"first token: run {args.run!r} has no {which} checkpoint in {args.runs_dir}; skipped")
            continue
        figures["first_token"].append(first_token_part(args, recipe, which, ckpt))
        save(args, figures)
    for which in args.checkpoints:
        found, ckpt = source_checkpoint(args, which)
        if not found:
            console.print(f"held-out: run {args.run!r} has no {which} checkpoint in {args.runs_dir}; skipped")
            continue
        figures["heldout"].append(heldout_part(args, which, ckpt))
        save(args, figures)
    print_first_token(figures)
    print_heldout(figures)


def save(args, figures: dict) -> None:
    """After each part, so that a long run interrupted keeps what it measured."""
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


def print_first_token(figures: dict) -> None:
    if not figures["first_token"]:
        return
    table = Table(title=f"First token and sequence logprob ({figures['threads']} threads)")
    for column in ("policy", "chi2 hf vs vllm", "fit hf", "fit vllm", "logprob hf", "logprob vllm", "z", "max gap"):
        table.add_column(column)
    for row in figures["first_token"]:
        same, fit, lp = row["chi_square_same"], row["chi_square_fit"], row["logprob"]

        def chi(c):
            return f"{c['stat']:.1f} (df {c['df']}), p={c['p']:.3g}"

        def mean(s):
            return f"{s['mean']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"

        table.add_row(
            row["policy"],
            chi(same),
            chi(fit["hf"]),
            chi(fit["vllm"]),
            mean(lp["hf"]),
            mean(lp["vllm"]),
            f"{row['z']:.2f}",
            f"{lp['hf']['max_gap']:.1e} / {lp['vllm']['max_gap']:.1e}",
        )
    Console().print(table)


def print_heldout(figures: dict) -> None:
    if not figures["heldout"]:
        return
    table = Table(title="Held-out success, one game per task")
    for column in ("checkpoint", "games", "hf", "95% CI", "vllm", "95% CI"):
        table.add_column(column)
    for row in figures["heldout"]:
        hf, vllm = row["hf"], row["vllm"]
        table.add_row(
            row["checkpoint"],
            str(hf["tasks"]),
            f"{hf['success_rate']:.3f}",
            f"{hf['ci_low']:.2f}-{hf['ci_high']:.2f}",
            f"{vllm['success_rate']:.3f}",
            f"{vllm['ci_low']:.2f}-{vllm['ci_high']:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
