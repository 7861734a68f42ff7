"""Generation speed of rlcli's rollout engines on SmolLM2-135M, next to `model.generate` and a hardware bound.

    .venv/bin/python bench/rollout.py                              # batch 1, 8, 32; 64 new tokens; float32
    .venv/bin/python bench/rollout.py --quick                      # batch 1 and 8, 16 new tokens, 1 repeat, 1 thread (<1 min)
    .venv/bin/python bench/rollout.py --batches 8 --new-tokens 32 --dtype bfloat16 --lora 8 --greedy

What is measured, per batch size B (generated tokens per second = B x new tokens / wall time of one call):
  * rlcli: `rlcli.generation.hf_sampler.sample_batch`, the decode loop every rollout (`rlcli rollout`, the GRPO
    rollout stage, eval) calls, with one torch.Generator per row as the EpisodeRunner gives it. The
    prompts go in as token ids, exactly as the runner passes them.
  * bare: `model.generate` on the same left-padded prompts, same sampling (temperature, top_k 0,
    top_p 1; or greedy), the same number of new tokens.
  * ratio: rlcli / bare.
  * vllm: rlcli's vLLM engine, `rlcli.generation.vllm_engine.VllmEngine.generate`, on the same model
    folder, prompts (token ids), temperature and token budget, one seed per row, built as
    `policy_engine` builds it on a CPU: the dtype --vllm-dtype (default: --dtype, which is what
    `model.dtype` gives the engine), eager mode, prefix caching on, a 1 GiB KV cache
    (kv_cache_memory_bytes). The prefix cache is reset before every call, so each call prefills its
    prompts as the HF engines do. vLLM binds its OpenMP threads to the benchmark's thread count
    (VLLM_CPU_OMP_THREADS_BIND = the first N allowed CPUs) and stops torch.set_num_threads from
    working afterwards, so it runs after all HF measurements. Its start-up (building the engine)
    is printed separately and not part of tok/s. Skipped, with a line saying so, when vllm cannot
    be imported; --no-vllm skips it too.
  * bound: the compute bound, matmul peak / (2 x params) tokens/s, next to a bandwidth bound
    B x read bandwidth / weight bytes (one pass over the weights per decode step), and the
    smaller of the two. The peak is the GFLOP/s of a 2048x2048 matmul in the benchmark's dtype,
    measured at startup; the bandwidth is a sum over a 256 MB tensor. The bound assumes that a
    generated token costs 2 FLOPs per parameter (every linear layer and the tied lm_head; attention
    over the short context, norms, sampling and Python are ignored) and that decode matmuls, which
    are skinny (B rows), run at the square-matmul peak. Neither holds exactly, so real decoding sits
    well below it; it says how far from the hardware an engine is, not what is reachable.

Token counts are equal by construction: end-of-sequence stopping is disabled in both (rlcli: the
model's and tokenizer's eos ids are hidden from sample_batch; generate: min_new_tokens = max_new_tokens;
vllm: ignore_eos on each request's SamplingParams),
so every row produces exactly --new-tokens tokens. Each (engine, batch) is warmed up once, then
timed --repeats times; the best run counts (a busy neighbour only ever slows a run down).
Threads: torch's default (one per core) unless --threads is given (--quick uses 1); the table title
says which. On a machine shared with other work use --threads 1: with one thread per core, a core
taken by another process slows torch down 10-20x (measured), and the figures measure the neighbour.
--lora R puts an untrained LoRA adapter of rank R on every linear layer, as the GRPO rollout stage
samples with (peft, unmerged).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

QUESTIONS = list(zip(range(11, 99, 3), range(97, 10, -3)))  # 30 fixed pairs, shifted when more are needed


def matmul_peak_gflops(dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """GFLOP/s of an n x n matmul in `dtype`: the best of several timed batches of matmuls."""
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    for _ in range(3):
        a @ b  # warm-up (thread pool, kernel selection)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def read_bandwidth_gbs(mb: int = 256, seconds: float = 1.5) -> float:
    """GB/s of reading a large float32 tensor once (a sum): what one pass over the weights costs."""
    import torch

    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


class _NoEos:
    """The tokenizer as sample_batch sees it, minus its eos id: rows run to the token budget."""

    eos_token_id = None

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    pairs = list(QUESTIONS)
    while len(pairs) < count:
        pairs += [(a + 7, b + 5) for a, b in QUESTIONS]
    out = []
    for a, b in pairs[:count]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def time_rlcli(model, tokenizer, prompts, new_tokens: int, temperature: float, repeats: int) -> float:
    import torch

    from rlcli.generation.hf_sampler import sample_batch
    from rlcli.generation.sampler import SamplingConfig

    cfg = SamplingConfig(temperature=temperature, max_new_tokens=new_tokens)
    no_eos = _NoEos(tokenizer)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:

        def once(budget: int) -> float:
            generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(prompts))]
            start = time.perf_counter()
            samples = sample_batch(model, no_eos, prompts, generators, cfg, [budget] * len(prompts))
            elapsed = time.perf_counter() - start
            assert all(len(s.ids) == budget for s in samples), "a row stopped before its budget"
            return elapsed

        once(4)  # warm-up
        return min(once(new_tokens) for _ in range(repeats))
    finally:
        model.generation_config.eos_token_id = saved


def time_bare(model, tokenizer, prompts, new_tokens: int, temperature: float, repeats: int) -> float:
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )

    def once(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                **sampling,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] - width == n, "generate stopped before the budget"
        return elapsed

    torch.manual_seed(0)
    once(4)  # warm-up
    return min(once(new_tokens) for _ in range(repeats))


def start_vllm(model_path, dtype: str, threads: int, max_model_len: int):
    """rlcli's VllmEngine as `policy_engine` builds it on a CPU; (engine, start-up seconds), or (None, why)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken native library raises more than ImportError
        return None, f"vllm is not importable ({type(exc).__name__}: {exc})"
    from rlcli.generation.vllm_engine import VllmEngine

    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    engine = VllmEngine(
        model_path,
        max_model_len=max_model_len,
        dtype=dtype,
        device="cpu",
        kv_cache_memory_bytes=1 << 30,
    )
    return engine, time.perf_counter() - start


def time_vllm(engine, prompts, new_tokens: int, temperature: float, repeats: int) -> float:
    from rlcli.generation import vllm_engine
    from rlcli.generation.sampler import SamplingConfig

    cfg = SamplingConfig(temperature=temperature, max_new_tokens=new_tokens)
    seeds = [1000 + i for i in range(len(prompts))]
    build = vllm_engine._sampling_params

    def no_eos(config, seed, max_tokens):
        params = build(config, seed, max_tokens)
        params.ignore_eos = True  # read when the request is added, before the eos id is attached
        return params

    def once(budget: int) -> float:
        engine.llm.reset_prefix_cache()  # prefill every call, as the HF engines do
        start = time.perf_counter()
        samples = engine.generate(prompts, seeds, cfg, [budget] * len(prompts))
        elapsed = time.perf_counter() - start
        assert all(len(s.ids) == budget for s in samples), "a row stopped before its budget"
        return elapsed

    vllm_engine._sampling_params = no_eos
    try:
        once(4)  # warm-up
        return min(once(new_tokens) for _ in range(repeats))
    finally:
        vllm_engine._sampling_params = build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="Batch sizes (rows per call).")
    parser.add_argument("--new-tokens", type=int, default=64, help="New tokens per row (eos stopping is disabled).")
    parser.add_argument("--repeats", type=int, default=2, help="Timed calls per engine and batch; the best counts.")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="Weights dtype (rlcli's CPU default, model.dtype auto, is float32).",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature (recipes' 0.7).")
    parser.add_argument("--greedy", action="store_true", help="Greedy decoding instead of sampling.")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="Put an (untrained) LoRA adapter of rank R on all linear layers, as GRPO rollouts do.",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="The vLLM engine's dtype (default: --dtype, as policy_engine passes model.dtype).",
    )
    parser.add_argument("--no-vllm", action="store_true", help="Leave the vLLM column out.")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N); 0 keeps torch's default.")
    parser.add_argument("--quick", action="store_true", help="Batch 1 and 8, 16 new tokens, 1 repeat, 1 thread.")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.new_tokens, args.repeats = [1, 8], 16, 1
        args.threads = args.threads or 1
    temperature = 0.0 if args.greedy else args.temperature

    import torch

    from rlcli.models.cache import pull_model
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 150)
    pull_model("smollm2-135m")
    load = os.getloadavg()[0]
    if load > 0.5:
        console.print(
            f"[yellow]Load average {load:.1f} before the start: other processes are using the CPU; "
            "timings will be noisy (--threads 1 is far more robust on a busy machine).[/yellow]"
        )
    dtype = getattr(torch, args.dtype)
    with console.status("Measuring the matmul peak and read bandwidth"):
        peak = matmul_peak_gflops(dtype)
        bandwidth = read_bandwidth_gbs()
    with console.status("Loading SmolLM2-135M"):
        lora = LoraSection(r=args.lora, alpha=2 * args.lora) if args.lora else None
        model, tokenizer = load_policy(
            ModelSection(name="smollm2-135m", dtype=args.dtype), lora, QuantizationSection(), trainable=bool(lora)
        )
        model.eval()
    base = model.get_base_model() if lora else model
    params = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    weight_bytes = params * torch.finfo(dtype).bits // 8
    compute_bound = peak * 1e9 / (2 * params)
    all_prompts = prompts_for(tokenizer, max(args.batches))

    vllm_dtype = args.vllm_dtype or args.dtype
    threads = torch.get_num_threads()
    rows = []
    for size in args.batches:
        prompts = all_prompts[:size]
        with console.status(f"batch {size}: rlcli sample_batch"):
            t_rlcli = time_rlcli(model, tokenizer, prompts, args.new_tokens, temperature, args.repeats)
        with console.status(f"batch {size}: model.generate"):
            t_bare = time_bare(model, tokenizer, prompts, args.new_tokens, temperature, args.repeats)
        tokens = size * args.new_tokens
        bw_bound = size * bandwidth * 1e9 / weight_bytes
        rows.append(
            {
                "batch": size,
                "prompt_len": statistics.mean(len(p) for p in prompts),
                "rlcli": tokens / t_rlcli,
                "bare": tokens / t_bare,
                "bw_bound": bw_bound,
                "bound": min(compute_bound, bw_bound),
                "vllm": None,
            }
        )

    engine, startup, skipped = None, None, "--no-vllm"
    if not args.no_vllm:
        if args.lora:
            skipped = "--lora: the vLLM engine serves merged weights, not an unmerged adapter"
        else:
            with console.status("Starting the vLLM engine"):
                engine, startup = start_vllm(
                    pull_model("smollm2-135m"), vllm_dtype, threads, ModelSection(name="smollm2-135m").max_length
                )
            if engine is None:
                skipped, startup = startup, None
    if engine is not None:
        for r in rows:
            prompts = all_prompts[: r["batch"]]
            with console.status(f"batch {r['batch']}: vLLM"):
                t_vllm = time_vllm(engine, prompts, args.new_tokens, temperature, args.repeats)
            r["vllm"] = r["batch"] * args.new_tokens / t_vllm

    mode = "greedy" if temperature == 0 else f"sampling T={temperature}"
    title = (
        f"SmolLM2-135M ({params / 1e6:.1f}M params, {args.dtype}{f', LoRA r={args.lora}' if args.lora else ''}), "
        f"{args.new_tokens} new tokens, {mode}, {threads} torch threads "
        f"({'set' if args.threads else 'default'}), {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    table = Table(title=title)
    for column in (
        "batch",
        "prompt tok",
        "rlcli tok/s",
        "bare generate tok/s",
        "rlcli / bare",
        f"vLLM tok/s ({vllm_dtype})",
        "vLLM / rlcli",
        "compute bound tok/s",
        "bandwidth bound tok/s",
        "rlcli / bound",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r["batch"]),
            f"{r['prompt_len']:.0f}",
            f"{r['rlcli']:.1f}",
            f"{r['bare']:.1f}",
            f"{r['rlcli'] / r['bare']:.2f}",
            "-" if r["vllm"] is None else f"{r['vllm']:.1f}",
            "-" if r["vllm"] is None else f"{r['vllm'] / r['rlcli']:.2f}",
            f"{compute_bound:.0f}",
            f"{r['bw_bound']:.0f}",
            f"{r['rlcli'] / r['bound']:.0%}",
        )
    console.print(table)
    console.print(
        f"matmul peak {peak:.0f} GFLOP/s ({args.dtype}, 2048x2048), read bandwidth {bandwidth:.1f} GB/s, "
        f"weights {weight_bytes / 1e6:.0f} MB. Compute bound = peak / (2 x {params / 1e6:.1f}M) tokens/s: 2 FLOPs per "
        "parameter per token at the square-matmul peak (attention, sampling and Python ignored). Bandwidth bound = "
        "batch x bandwidth / weight bytes: one read of the weights per decode step. rlcli / bound uses the smaller."
    )
    if engine is not None:
        console.print(
            f"vLLM {__import__('vllm').__version__} ({vllm_dtype}, eager, 1 GiB KV cache, OpenMP threads bound to CPUs "
            f"{os.environ['VLLM_CPU_OMP_THREADS_BIND']}): engine start-up {startup:.1f} s (not in tok/s). "
            f"rlcli and bare generate: {args.dtype}. Load average at the start {load:.2f}, at the end {os.getloadavg()[0]:.2f}."
        )
    else:
        console.print(f"vLLM column skipped: {skipped}.")


if __name__ == "__main__":
    main()
