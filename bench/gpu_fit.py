"""Does the memory plan match a GPU? The quickstart with a real model, random 1.5B/3B/7B shapes on an
emulated 24 GB card, and vs_trl.py, each stage's measured peak beside the plan's prediction (issue 49).

Here (no GPU): the same sequence on the tiny models, to prove the script end to end (a few minutes):

    .venv/bin/python bench/gpu_fit.py --cpu

On a device machine (one H100; nothing there reaches a registry; at most 64 MiB travel per call, the
working tree's 2.5 MiB included; the machine stays warm 30 s after a call, so make the calls one straight
after the other; 15 minutes of device time in all). First, here:

    bash bench/gpu_fit_parts.sh     # SmolLM2's folder (269 MB) and the 12 wheels the device image lacks
                                    # (46 MB: trl, bitsandbytes, datasets, sqlite-utils, pydantic, ...) as
                                    # one tar.gz (235 MiB) in 60 MiB pieces runs/gpu_fit_parts/p1..p4, the
                                    # last with its sha256 (runs/ is in .gitignore); prints the calls below

Then the device tool's `run`, one call each (carry, then command):

    1-3. carry ["runs/gpu_fit_parts/pK"] (K = 1, 2, 3):
         mkdir -p /tmp/gf && cp runs/gpu_fit_parts/pK/* /tmp/gf/ && ls -l /tmp/gf
    4.   carry ["runs/gpu_fit_parts/p4"], timeout_s 600:
         mkdir -p /tmp/gf && cp runs/gpu_fit_parts/p4/* /tmp/gf/ && bash bench/gpu_fit_parts.sh --join || exit 1;
         export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; python3 bench/gpu_fit.py --smollm2 /tmp/smollm2-135m
         --only quickstart vs_trl --vs-trl-args="--steps 10" --out $OUT/gpu_fit_a.json 2>$OUT/gpu_fit_a.log
    5.   no carry, timeout_s 600:
         export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; python3 bench/gpu_fit.py --smollm2 /tmp/smollm2-135m
         --only shapes --out $OUT/gpu_fit_b.json 2>$OUT/gpu_fit_b.log

`--join` (on the device) joins the pieces, checks the sha256, unpacks /tmp/smollm2-135m and /tmp/whl,
and installs the wheels and rlcli itself (from the working tree that travelled) into /tmp/site. Each
section writes the JSON as soon as it has a result, so a call stopped at its limit still returns what it
measured. If device time runs short, call 5 can take `--shapes 1.5b 7b`.

The sections (--only picks some; each `rlcli run` is its own process, as a user's is):
- quickstart: recipes/quickstart.yaml as shipped, on the GPU (model.device cuda), SmolLM2-135M from
  --smollm2, rollout.engine vllm when vLLM can be imported, else hf. Held-out success of base, SFT and
  final (the last GRPO checkpoint, evaluated afterwards as bench/learning.py does) and latest (the best
  held-out checkpoint, keep_best), wall minutes of `rlcli run`, and per stage the measured peak
  (perf/gpu_mem_peak_gb, and perf/gpu_mem_reserved_gb where recorded) beside the plan's peak for the
  same recipe on the visible card (--plan-gpu-gb on a CPU).
- shapes: random-weight models of Qwen2.5-1.5B, 3B and 7B shape (memory_plan.KNOWN_SHAPES, tiny-random's
  tokenizer), each built in its own process and saved, then a short GRPO run (gpu_1x.yaml for 1.5B and
  3B, gpu_7b_qlora.yaml for 7B: 4-bit, --shape-iterations iterations, eval of latest) in a process that
  first caps torch's allocator at --emulate-gb (torch.cuda.set_per_process_memory_fraction) and then runs
  rlcli's CLI. The engine, vLLM's weights and its KV cache are the plan's choices for the emulated card,
  written into the recipe (the run itself would plan for the real card's memory). Per stage: measured
  peak vs the plan's for the emulated card, and whether it fit (an OOM is a result).
- vs_trl: bench/vs_trl.py with SmolLM2 from --smollm2 (--vs-trl-args passed on) and its summary lines.

The plan is a worst-case bound (every sequence at model.max_length) and counts a CUDA context (0.5 GB
per process) that torch's counters do not, so plan / measured above 1 is expected; below 1 means the plan
under-counts. On a CPU nothing measures GPU memory: the measured columns say n/a. The tables go to
stdout as Markdown, progress to stderr, the figures to --out as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
GB = 1e9

# The shapes: KNOWN_SHAPES key and the shipped recipe whose settings each runs with.
SHAPES = {
    "1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", "gpu_1x.yaml"),
    "3b": ("Qwen/Qwen2.5-3B-Instruct", "gpu_1x.yaml"),
    "7b": ("Qwen/Qwen2.5-7B-Instruct", "gpu_7b_qlora.yaml"),
}
# The run database's stage families and the plan's stage names (label and the grpo phase have no plan).
PLAN_STAGE = {"sft": "sft", "rollout": "rollout", "train": "update", "dpo": "dpo", "eval": "eval"}
# A reward that differs between random replies too (the share of digits), so that GRPO's groups have a
# signal and the update runs on random weights (as bench/gpu_smoke.py does).
DIGITS_REWARD = """
def digits(completions, **kwargs):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
"""
# The emulated card's process: cap torch's allocator before anything loads, then rlcli's own CLI.
CAPPED_RLCLI = """
import os, sys
import torch
gb = float(os.environ["GPU_FIT_EMULATE_GB"])
if torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 1e9 / total))
    print(f"gpu_fit: torch's allocator capped at {gb:g} GB of the card's {total / 1e9:.1f} GB", file=sys.stderr)
else:
    print("gpu_fit: no CUDA here, no cap", file=sys.stderr)
from rlcli.cli.app import main
main(sys.argv[1:])
"""
# The quickstart and the shapes cut to a couple of steps for --cpu (the tiny model, 1 thread).
CPU_QUICKSTART = [
    "sft.demos=4",
    "sft.batch_size=4",
    "sft.micro_batch_size=4",
    "grpo.iterations=2",
    "grpo.eval_every=1",
    "grpo.eval_tasks=2",
    "eval.tasks=4",
]
CPU_VS_TRL = "--steps 1 --eval-tasks 0 --prompts 2 --generations 2 --max-tokens 8 --only rlcli trl"


def log(message: str) -> None:
    print(f"gpu_fit: {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="Dry run on the CPU: the tiny model (tiny-random, head size 64) in place of SmolLM2 and the random "
        "shapes, a couple of steps each, 1 thread; the plan's predictions with measured n/a.",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("quickstart", "shapes", "vs_trl"),
        default=["quickstart", "shapes", "vs_trl"],
        help="The sections to run, in this order (default: all three).",
    )
    parser.add_argument(
        "--smollm2",
        type=Path,
        default=None,
        help="SmolLM2-135M-Instruct's folder (config.json, model.safetensors, tokenizer); default: rlcli's "
        "cache (`rlcli models pull smollm2-135m`). Used by quickstart (not with --cpu) and vs_trl.",
    )
    parser.add_argument(
        "--plan-gpu-gb",
        type=float,
        default=80.0,
        help="With --cpu: the card the quickstart's plan is for, in GB (on a GPU: the visible card's memory).",
    )
    parser.add_argument(
        "--plan-capability",
        type=float,
        default=9.0,
        help="With --cpu: that card's CUDA compute capability (9.0: an H100; on a GPU: the visible card's).",
    )
    parser.add_argument(
        "--emulate-gb",
        type=float,
        default=24.0,
        help="shapes: the card to emulate, in GB: torch's allocator is capped at this and the plan is for it.",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="shapes: which random-weight shapes to run (default: all).",
    )
    parser.add_argument(
        "--shape-iterations", type=int, default=1, help="shapes: GRPO iterations per shape (default 1)."
    )
    parser.add_argument(
        "--engine",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="The quickstart's rollout.engine: auto is vllm where vLLM can be imported, else hf. The shapes "
        "take the plan's choice for the emulated card (hf without vLLM).",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Overrides for the quickstart's recipe (the run and its plan), e.g. grpo.iterations=8.",
    )
    parser.add_argument(
        "--vs-trl-args",
        default=None,
        help="Options for bench/vs_trl.py, one string (default: none on a GPU, its full run; with --cpu: "
        f"{CPU_VS_TRL!r}).",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="run.threads and vs_trl's --threads (default: --cpu 1, else unset)."
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="Seconds each child process may run (default: no limit)."
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="Working folder: recipes, runs, logs, models (default: a temporary one).",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/gpu_fit.json"),
        help="Where the JSON results go (its folder is made); rewritten after every result.",
    )
    parser.add_argument("--build-shape", help=argparse.SUPPRESS)  # child mode: build a random model
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_shape:
        build_random_model(args.build_shape, args.folder)
        return 0
    if args.threads is None and args.cpu:
        args.threads = 1

    t0 = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="rlcli-gpu-fit-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(args, work)
    results: dict[str, Any] = {"setup": {k: str(v) if isinstance(v, Path) else v for k, v in setup.items()}}
    save(args.out, results)
    for section in args.only:
        log(f"--- {section} ---")
        if section == "quickstart":
            results["quickstart"] = run_quickstart(args, setup)
        elif section == "shapes":
            results["shapes"] = []
            for key in args.shapes:
                results["shapes"].append(run_shape(args, setup, key))
                save(args.out, results)
        else:
            results["vs_trl"] = run_vs_trl(args, setup)
        save(args.out, results)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    save(args.out, results)
    print(markdown(results))
    log(f"done in {results['wall_s'] / 60:.1f} min; JSON in {args.out}; logs in {work}")
    return 0


def save(out: Path, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


# --- the machine ------------------------------------------------------------------------------------


def make_setup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The device, the card the plans are for, the models folder every child reads (RLCLI_MODELS, with
    SmolLM2 linked in as smollm2-135m: vs_trl.py pulls that name) and the tiny model for --cpu."""
    import torch

    from rlcli.generation.memory_plan import visible_gpus
    from rlcli.models.cache import models_dir

    cards = visible_gpus()  # nvidia-smi: this process never initialises CUDA, so its children get the card
    if not args.cpu and not cards:
        raise SystemExit("gpu_fit: no GPU visible (nvidia-smi lists none); run with --cpu for the dry run.")
    smollm2 = (args.smollm2 or models_dir() / "smollm2-135m").expanduser().resolve()
    needs_smollm2 = "vs_trl" in args.only or ("quickstart" in args.only and not args.cpu)
    if needs_smollm2 and not (smollm2 / "config.json").is_file():
        raise SystemExit(
            f"gpu_fit: no SmolLM2 folder at {smollm2} (give --smollm2, or `rlcli models pull smollm2-135m`)."
        )
    models = work / "models"
    models.mkdir(exist_ok=True)
    link = models / "smollm2-135m"
    if needs_smollm2 and not link.exists():
        link.symlink_to(smollm2, target_is_directory=True)
    os.environ["RLCLI_MODELS"] = str(models)
    (work / "digits.py").write_text(DIGITS_REWARD)
    tiny = None
    if args.cpu:
        from rlcli.models.tiny import build_tiny_random

        tiny = work / "tiny-hd64"
        if not (tiny / "config.json").is_file():
            build_tiny_random(tiny, head_dim=64)  # vLLM's CPU attention takes head size 64, not tiny's 16
    card = cards[0] if cards else None
    vllm = importlib.util.find_spec("vllm") is not None
    setup = {
        "cpu": args.cpu,
        "device": "cpu" if args.cpu else "cuda",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "vllm": vllm,
        "card": None if card is None else card.name,
        "card_gb": None if card is None else round(card.total_gb, 1),
        "capability": args.plan_capability if card is None else card.capability,
        "plan_card_gb": args.plan_gpu_gb if card is None else round(card.total_gb, 1),
        "engine": ("vllm" if vllm else "hf") if args.engine == "auto" else args.engine,
        "work": work,
        "smollm2": smollm2 if needs_smollm2 else None,
        "tiny": tiny,
    }
    log(
        f"{'CPU dry run' if args.cpu else card.name + f' ({card.total_gb:.1f} GB)'}; torch {torch.__version__}; "  # type: ignore[union-attr]
        f"vLLM {'importable' if vllm else 'not installed'}; work folder {work}"
    )
    return setup


def plan_card(setup: dict[str, Any], gb: float | None = None) -> Any:
    """The card a plan is for: the visible one (or --plan-gpu-gb's), or an emulated one of `gb` GB."""
    from rlcli.generation.memory_plan import Card

    if gb is not None:
        return Card(f"{gb:g} GB (emulated)", int(gb * GB), setup["capability"])
    name = setup["card"] or f"{setup['plan_card_gb']:g} GB GPU"
    return Card(name, int(setup["plan_card_gb"] * GB), setup["capability"])


def plan_for(recipe: dict[str, Any], path: Path, overrides: list[str], card: Any) -> Any:
    """The memory plan of the GPU recipe (written to `path`) on `card`, for the stages it runs."""
    from rlcli.engine.pipeline import planned_stages
    from rlcli.generation.memory_plan import plan_memory
    from rlcli.recipe import load_recipe

    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    loaded = load_recipe(path, overrides)
    return plan_memory(loaded, planned_stages(loaded), card, gpus=1)


# --- running rlcli ----------------------------------------------------------------------------------


def child(command: list[str], log_path: Path, timeout: float | None, env: dict[str, str] | None = None) -> dict:
    """A child process, its output to log_path; exit code, seconds, last error line, and whether it ran out
    of GPU memory or time."""
    t0 = time.perf_counter()
    shown = ["<cap>" if arg == CAPPED_RLCLI else arg for arg in command]
    log(f"$ {shlex.join(shown)}")
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout, cwd=REPO)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    log_path.write_text(output)
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
    oom = "OutOfMemoryError" in output or "CUDA out of memory" in output or "out of memory" in error.lower()
    result = {
        "exit": code,
        "seconds": round(time.perf_counter() - t0, 1),
        "oom": oom,
        "timed_out": code is None,
        "stdout": done.stdout if code is not None else "",
        "error": "" if code == 0 else error[:300],
    }
    if code != 0:
        log(
            f"exit {code} after {result['seconds']} s ({'OOM' if oom else 'timeout' if code is None else 'failed'}): {result['error']}"
        )
        log(f"log: {log_path}")
    return result


def rlcli(
    setup: dict[str, Any], name: str, runs: Path, *args: str, timeout: float | None, capped_gb: float | None = None
) -> dict:
    """`rlcli --runs-dir RUNS ARGS` in its own process, its output in WORK/name.log; with capped_gb, behind
    the allocator cap."""
    entry = ["-c", CAPPED_RLCLI] if capped_gb is not None else ["-m", "rlcli"]
    env = {"GPU_FIT_EMULATE_GB": str(capped_gb)} if capped_gb is not None else None
    return child([sys.executable, *entry, "--runs-dir", str(runs), *args], setup["work"] / f"{name}.log", timeout, env)


def stage_memory(runs: Path, run: str, plan: Any) -> list[dict[str, Any]]:
    """Per plan stage: the plan's peak and the largest measured peak over the run's stages of that family
    (rollout/0, rollout/1, ... are one rollout row), with the failed stage, if any."""
    from rlcli.store.db import RunDB
    from rlcli.store.records import GPU_PEAK_KEY, GPU_RESERVED_KEY

    measured: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}
    if (runs / "rlcli.db").is_file():
        rundb = RunDB.open(runs)
        try:
            for key in (GPU_PEAK_KEY, GPU_RESERVED_KEY):
                for metric in rundb.metrics(run, key):
                    family = PLAN_STAGE.get(metric.stage.split("/")[0])
                    if family is not None:
                        seen = measured.setdefault(family, {})
                        seen[key] = max(seen.get(key, 0.0), metric.value)
            for stage in rundb.stages(run):
                family = PLAN_STAGE.get(stage.name.split("/")[0])
                if stage.status == "failed" and family is not None:
                    failed[family] = stage.name
        finally:
            rundb.close()
    rows = []
    for stage in plan.stages:
        seen = measured.get(stage.stage, {})
        peak = seen.get(GPU_PEAK_KEY)
        rows.append(
            {
                "stage": stage.stage,
                "device": stage.device,
                "plan_gb": round(stage.peak / GB, 2),
                "plan_parts_gb": {part: round(size / GB, 2) for part, size in stage.parts.items() if size},
                "measured_gb": None if peak is None else round(peak, 2),
                "reserved_gb": None if GPU_RESERVED_KEY not in seen else round(seen[GPU_RESERVED_KEY], 2),
                "plan_over_measured": round(stage.peak / GB / peak, 2) if peak else None,
                "failed_stage": failed.get(stage.stage),
            }
        )
    return rows


def heldout(runs: Path, run: str) -> dict[str, dict[str, Any]]:
    """The run's held-out evals by stage (eval/base, eval/ckpt-3, ...), each with the checkpoint it was asked
    as (base, sft, latest, or an id) and the one that was evaluated, from its database."""
    from rlcli.store.db import RunDB
    from rlcli.store.evals import eval_results
    from rlcli.store.run_store import RunStore

    if not (runs / "rlcli.db").is_file():
        return {}
    rundb = RunDB.open(runs)
    try:
        return {
            r.stage: {
                "checkpoint": r.checkpoint,
                "success": round(r.success_rate, 3),
                "ci": [round(r.ci_low, 2), round(r.ci_high, 2)],
                "tasks": r.tasks,
                "checkpoint_id": r.checkpoint_id,
            }
            for r in eval_results(RunStore(rundb, run))
        }
    finally:
        rundb.close()


def final_checkpoint(runs: Path, run: str) -> int | None:
    from rlcli.store.checkpoints import train_checkpoints
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

    if not (runs / "rlcli.db").is_file():
        return None
    rundb = RunDB.open(runs)
    try:
        trained = train_checkpoints(RunStore(rundb, run))
        return trained[-1].id if trained else None
    finally:
        rundb.close()


# --- 1. the quickstart ------------------------------------------------------------------------------


def run_quickstart(args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """recipes/quickstart.yaml on the GPU with SmolLM2 (--cpu: the tiny model, a couple of steps), its
    held-out base/SFT/final/latest, wall minutes, and per stage the measured peak beside the plan's."""
    work, engine = setup["work"], setup["engine"]
    recipe = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    recipe["run"]["name"] = "gpu-fit-quickstart"
    recipe["model"] |= {"name": "smollm2-135m", "device": "cuda"}
    recipe["rollout"]["engine"] = engine
    plan = plan_for(recipe, work / "quickstart-plan.yaml", args.set, plan_card(setup))
    overrides = list(args.set)
    if args.cpu:
        recipe["model"] |= {"name": str(setup["tiny"]), "device": "cpu"}
        if engine == "vllm":
            recipe["rollout"]["vllm_memory"] = 1 << 28  # on a CPU, above 1: bytes of KV cache
        overrides = CPU_QUICKSTART + overrides
    if args.threads:
        recipe["run"]["threads"] = args.threads
    path = work / "quickstart.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    runs = work / "runs-quickstart"
    done = rlcli(setup, "quickstart-run", runs, "run", "-r", str(path), *overrides, timeout=args.timeout)
    final, final_s = final_checkpoint(runs, recipe["run"]["name"]), None
    if final is not None:  # the last GRPO checkpoint, which `latest` (keep_best: the best one) may not be
        which = str(final)
        extra = rlcli(
            setup, "quickstart-eval-final", runs, "eval", "-r", str(path), *overrides, "-c", which, timeout=args.timeout
        )
        final_s = extra["seconds"]
    evals = heldout(runs, recipe["run"]["name"])
    points = {
        point["checkpoint"]: point for point in evals.values() if point["checkpoint"] in ("base", "sft", "latest")
    }
    # The final checkpoint's eval: its own (-c ID), or latest's when latest is that checkpoint; the
    # in-training evals (grpo.eval_every) of it have fewer tasks.
    of_final = [point for point in evals.values() if final is not None and point["checkpoint_id"] == final]
    if of_final:
        points["final"] = max(of_final, key=lambda point: point["tasks"])
    result = {
        "model": str(setup["tiny"] if args.cpu else setup["smollm2"]),
        "engine": engine,
        "overrides": overrides,
        "exit": done["exit"],
        "error": done["error"],
        "wall_min": round(done["seconds"] / 60, 2),
        "final_eval_s": final_s,
        "heldout": points,
        "heldout_all": evals,
        "plan_card": plan.card.name,
        "plan_card_gb": round(plan.card.total_bytes / GB, 1),
        "plan_fits": plan.fits,
        "plan_choices": plan.to_dict()["choices"],
        "stages": stage_memory(runs, recipe["run"]["name"], plan),
    }
    log(f"quickstart: exit {done['exit']}, {result['wall_min']} min")
    return result


# --- 2. the random-weight shapes on an emulated card ------------------------------------------------


def build_random_model(key: str, folder: Path) -> None:
    """Child mode: a random model of KNOWN_SHAPES[key]'s shape in bfloat16 with tiny-random's tokenizer,
    built on the GPU where there is one, saved to folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcli.generation.memory_plan import KNOWN_SHAPES
    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_tokenizer
    from rlcli.recipe import ModelSection

    tokenizer = load_tokenizer(ModelSection(name="tiny-random"), resolve_model("tiny-random"))
    fields = {k: v for k, v in KNOWN_SHAPES[key].items() if k != "model_type"}
    config = Qwen2Config(**fields, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: no float32 copy of a 7B model first
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def shape_recipe(args: argparse.Namespace, setup: dict[str, Any], key: str, model: str) -> dict[str, Any]:
    """The shape's shipped recipe cut to --shape-iterations GRPO iterations and a short eval of latest,
    with a reward that random weights can vary."""
    hub_id, file = SHAPES[key]
    recipe = yaml.safe_load((RECIPES / file).read_text())
    recipe["run"] = {"name": f"gpu-fit-{key}", "seed": 0, "stages": ["grpo", "eval"]}
    recipe["model"] |= {"name": model, "device": "cuda"}
    recipe["rewards"] = [{"fn": "numeric_match"}, {"fn": f"{setup['work'] / 'digits.py'}:digits", "name": "digits"}]
    recipe["grpo"] |= {"iterations": args.shape_iterations}
    recipe["eval"] = {"tasks": 16, "checkpoints": ["latest"]}
    return recipe


def pin_choices(recipe: dict[str, Any], plan: Any, real_gb: float | None) -> None:
    """Write the plan's choices for the emulated card into the recipe: in the run, rlcli plans for the
    card nvidia-smi shows (the real one), and vLLM takes its share of the real card. vLLM's share is
    rescaled to the real card, so that it takes the same bytes as on the emulated one."""
    choices = plan.choices
    recipe["rollout"]["engine"] = choices.engine
    if choices.engine == "vllm" and choices.vllm_memory:
        scale = plan.card.total_bytes / (real_gb * GB) if real_gb else 1.0
        recipe["rollout"]["vllm_quantization"] = choices.vllm_quantization or "none"
        recipe["rollout"]["vllm_memory"] = round(choices.vllm_memory * scale, 4)


def run_shape(args: argparse.Namespace, setup: dict[str, Any], key: str) -> dict[str, Any]:
    """One random-weight shape: build it (its own process), plan it for the emulated card, run the short
    GRPO recipe behind the allocator cap, and compare each stage's peak with the plan's."""
    work, hub_id = setup["work"], SHAPES[key][0]
    recipe = shape_recipe(args, setup, key, hub_id)
    # The prediction: the shipped recipe's auto settings, planned for the emulated card.
    plan = plan_for(recipe, work / f"shape-{key}-plan.yaml", [], plan_card(setup, args.emulate_gb))
    pin_choices(recipe, plan, setup["card_gb"])
    result: dict[str, Any] = {
        "shape": key,
        "shape_of": hub_id,
        "engine": recipe["rollout"]["engine"],
        "emulated_gb": args.emulate_gb,
        "plan_fits": plan.fits,
        "plan_problems": plan.problems,
        "plan_choices": plan.to_dict()["choices"],
    }
    if args.cpu:
        folder, built = setup["tiny"], None
        recipe["model"] |= {"name": str(folder), "device": "cpu", "dtype": "float32"}
        recipe["quantization"]["compute_dtype"] = "float32"
        recipe["rollout"] |= {"tasks": 2, "group_size": 2, "max_new_tokens": 8, "batch_size": 4}
        if recipe["rollout"]["engine"] == "vllm":
            recipe["rollout"] |= {"vllm_memory": 1 << 28, "vllm_quantization": "none"}
        recipe["grpo"] |= {"micro_batch_size": 4}
        recipe["eval"]["tasks"] = 2
    else:
        folder = work / f"random-{key}"
        built = child(
            [sys.executable, __file__, "--build-shape", hub_id, "--folder", str(folder)],
            work / f"build-{key}.log",
            args.timeout,
        )
        result["build_s"] = built["seconds"]
        if built["exit"] != 0:
            return result | {"fit": "build failed", "error": built["error"], "stages": stage_memory(work, "-", plan)}
        recipe["model"]["name"] = str(folder)
    if args.threads:
        recipe["run"]["threads"] = args.threads
    path = work / f"shape-{key}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    runs = work / f"runs-{key}"
    done = rlcli(
        setup, f"shape-{key}-run", runs, "run", "-r", str(path), timeout=args.timeout, capped_gb=args.emulate_gb
    )
    fit = "yes" if done["exit"] == 0 else "OOM" if done["oom"] else "timeout" if done["timed_out"] else "failed"
    result |= {
        "fit": fit,
        "exit": done["exit"],
        "error": done["error"],
        "run_s": done["seconds"],
        "stages": stage_memory(runs, recipe["run"]["name"], plan),
    }
    if built is not None:  # the 7B's folder is 15 GB: the disk holds one shape at a time
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    log(f"shape {key}: {fit} ({done['seconds']} s)")
    return result


# --- 3. vs_trl.py -----------------------------------------------------------------------------------


def run_vs_trl(args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """bench/vs_trl.py on SmolLM2 (linked into RLCLI_MODELS as smollm2-135m): its summary lines and rows."""
    work = setup["work"]
    extra = shlex.split(args.vs_trl_args if args.vs_trl_args is not None else (CPU_VS_TRL if args.cpu else ""))
    if args.threads and "--threads" not in extra:
        extra += ["--threads", str(args.threads)]
    raw = work / "vs_trl.json"
    done = child(
        [sys.executable, str(REPO / "bench" / "vs_trl.py"), *extra, "--json", str(raw)],
        work / "vs_trl.log",
        args.timeout,
    )
    summary_lines = [
        line.strip() for line in done["stdout"].splitlines() if line.startswith(("TRL / ", "rlcli / rlcli-async"))
    ]
    rows = {}
    if raw.is_file():
        spec = importlib.util.spec_from_file_location("vs_trl", REPO / "bench" / "vs_trl.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        rows = {side: module.summary(r) for side, r in json.loads(raw.read_text()).items()}
    log(f"vs_trl: exit {done['exit']}; {' | '.join(summary_lines) or 'no summary line'}")
    return {"args": extra, "exit": done["exit"], "error": done["error"], "summary": summary_lines, "sides": rows}


# --- the report -------------------------------------------------------------------------------------


def _gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def markdown(results: dict[str, Any]) -> str:
    setup = results["setup"]
    where = (
        "CPU dry run (tiny models; no GPU memory measured)"
        if setup["cpu"]
        else f"{setup['card']} ({setup['card_gb']} GB)"
    )
    out = [f"## gpu_fit: {where}, torch {setup['torch']}, vLLM {'yes' if setup['vllm'] else 'no'}", ""]
    rows: list[list[str]] = []
    quick = results.get("quickstart")
    if quick:
        out += [
            f"Quickstart ({quick['engine']} sampler, {quick['wall_min']:.1f} min wall-clock, exit {quick['exit']}): held-out success",
            "",
            "| checkpoint | success | 95% CI | tasks |",
            "| --- | ---: | --- | ---: |",
        ]
        for label in ("base", "sft", "final", "latest"):
            point = quick["heldout"].get(label)
            if point:
                which = f" (#{point['checkpoint_id']})" if point["checkpoint_id"] else ""
                ci = f"{point['ci'][0]:.2f}-{point['ci'][1]:.2f}"
                out.append(f"| {label}{which} | {point['success']:.2f} | {ci} | {point['tasks']} |")
        out.append("")
        plan_on = f"plan on {quick['plan_card']} ({quick['plan_card_gb']:g} GB)"
        rows += [
            _memory_row("quickstart", plan_on, "yes" if quick["exit"] == 0 else "failed", s) for s in quick["stages"]
        ]
    for shape in results.get("shapes", []):
        plan_on = f"{shape['engine']}, plan on {shape['emulated_gb']:g} GB, plan fits: {'yes' if shape['plan_fits'] else 'no'}"
        rows += [_memory_row(f"random {shape['shape']}", plan_on, shape["fit"], s) for s in shape["stages"]]
    if rows:
        out += [
            "Peak GPU memory per stage: the plan's prediction beside the measured peak (GB)",
            "",
            "| run | plan | stage | plan GB | measured GB | reserved GB | plan / measured | ran |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        out.append("")
    trl = results.get("vs_trl")
    if trl:
        out += [
            f"vs_trl.py {' '.join(trl['args'])} (exit {trl['exit']})",
            "",
            "| side | s/step | gen tok/s | reward last 1/4 | held-out acc | train wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for side, row in trl["sides"].items():
            acc = "–" if row["heldout"] is None else f"{row['heldout']:.3f}"
            out.append(
                f"| {side} | {row['s_step']:.2f} | {row['tok_s']:.1f} | {row['reward_last']:.3f} | {acc} | {row['total_s']:.0f} |"
            )
        out += ["", *(f"- {line}" for line in trl["summary"] or ["no summary line (see the log)"]), ""]
    if "wall_s" in results:
        out.append(f"Total wall-clock: {results['wall_s'] / 60:.1f} min.")
    return "\n".join(out)


def _memory_row(run: str, plan_on: str, ran: str, stage: dict[str, Any]) -> list[str]:
    ratio = "n/a" if stage["plan_over_measured"] is None else f"{stage['plan_over_measured']:.2f}"
    if stage.get("failed_stage"):
        ran = f"{ran} in {stage['failed_stage']}"
    return [
        run,
        plan_on,
        stage["stage"],
        f"{stage['plan_gb']:.2f}",
        _gb(stage["measured_gb"]),
        _gb(stage["reserved_gb"]),
        ratio,
        ran,
    ]


if __name__ == "__main__":
    sys.exit(main())
