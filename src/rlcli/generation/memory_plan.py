"""The GPU memory plan: what each stage of a recipe takes on each GPU, computed from the model's config
before anything is loaded, and the `auto` settings chosen from it.

Every figure is a bound for the recipe's worst case: sequences of `model.max_length` tokens, every
episode of a generate call at full length. The parts, per device:
- CUDA context: what the driver and cuBLAS take in every process that uses a GPU (outside torch's counters).
- weights: at their precision. bitsandbytes 4-bit keeps the decoder's linear layers in 4 bits with one
  absmax per 64 weights (8 bits with double quantisation) and everything else (embeddings, head,
  norms, a vision tower) in the compute dtype; 8-bit keeps them in 8 bits.
- LoRA state: the adapter in float32 with its gradient and AdamW's two moments (16 bytes a parameter);
  full fine-tuning: a gradient and two moments in the weights' dtype.
- activations: what autograd keeps for the backward, 37 x hidden + 10 x intermediate bytes a token a layer
  in bfloat16 (measured on a Qwen2 decoder layer with LoRA on every linear layer, at three widths, by
  saved-tensor hooks; bench/plan_calibration.py); with gradient checkpointing, each layer's input plus one
  layer recomputed. The SFT and DPO trainers also hold the [tokens, vocabulary] logits in float32 with
  their gradient (16 bytes a value); the GRPO update computes them in chunks of 2**24 values.
- vLLM: its weights (dense in the model's dtype, or FP8), the peak of its start-up profiling run (one step
  of max_num_batched_tokens tokens and the sampler's logits for max_num_seqs rows; a vision model's
  encoder on the largest image), CUDA graphs, and the KV cache left in its share of the card.
- the HF sampler: its KV cache for rollout.batch_size episodes at full length and a step's logits.

Nothing here imports torch: the card comes from nvidia-smi.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.errors import UsageError

if TYPE_CHECKING:
    from rlcli.recipe import QuantizationSection, Recipe

GB = 1_000_000_000
CUDA_CONTEXT = GB // 2  # CUDA 12-13 with cuBLAS on a Hopper or Ampere card, per process
CUDA_GRAPHS = GB // 2  # vLLM's captured graphs at its default capture sizes
SLEEP_RESIDUE = 3 * GB // 10  # what a sleeping vLLM engine keeps on the GPU (graph pools, buffers)
LOGIT_CHUNK_BYTES = 3 * 4 * 2**24  # the GRPO update's logits chunk (float32) with two temporaries
HEADROOM = 0.95  # of the card: the allocator's fragmentation and what the plan does not count
VLLM_STEP_TOKENS = 8192  # max_num_batched_tokens rlcli passes (vLLM's own default on cards under 70 GB)
# FP8 weights in vLLM: compute capability 8.9 (Ada, Hopper) or newer computes FP8 natively.
FP8_CAPABILITY = 8.9
# The architectures whose config the plan knows without a download: the shipped recipes' models and
# their siblings (the fields of their config.json that the plan reads).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-3B-Instruct": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-Coder-7B-Instruct": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        model_type="qwen2_5_vl", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    ),
}  # fmt: skip
# A Qwen2-VL/Qwen2.5-VL processor's largest image (its max_pixels), what vLLM profiles without a bound.
DEFAULT_MAX_PIXELS = 12845056
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- the model's shape ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model's config.json (a vision-language model: its language model's)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    vision_params: int = 0  # the vision tower and projector, kept unquantised
    vision_hidden: int = 0
    vision_intermediate: int = 0
    patch_pixels: int = 0  # pixels a vision token covers (patch size squared)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = config.get("text_config") or config
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            shape: dict[str, Any] = dict(
                layers=int(text["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(text["intermediate_size"]),
                heads=heads,
                kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                vocab=int(text.get("vocab_size") or config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"The model's config.json has no usable {exc} for the memory plan.") from None
        vision = config.get("vision_config")
        if vision:
            width = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
            inner = int(vision.get("intermediate_size") or width * int(vision.get("mlp_ratio", 4)))
            depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 0)
            merged = width * int(vision.get("spatial_merge_size", 1)) ** 2
            out = int(vision.get("out_hidden_size") or shape["hidden"])
            # Per block: attention (4 x width^2) and a gated MLP; the merger projects merged patches out.
            params = depth * (4 * width * width + 3 * width * inner) + merged * merged + merged * out
            shape |= dict(
                vision_params=params,
                vision_hidden=width,
                vision_intermediate=inner,
                patch_pixels=int(vision.get("patch_size", 14)) ** 2,
            )
        return cls(**shape)

    @property
    def linear_params(self) -> int:
        """The decoder's linear layers: what bitsandbytes quantises and LoRA adapts."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def other_params(self) -> int:
        """Embeddings, the head (unless tied), norms and the vision tower: never quantised."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * 2 * self.hidden + self.vision_params

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, r: int, targets: str | list[str]) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = {
            "q_proj": self.hidden + q,
            "k_proj": self.hidden + kv,
            "v_proj": self.hidden + kv,
            "o_proj": q + self.hidden,
            "gate_proj": self.hidden + self.intermediate,
            "up_proj": self.hidden + self.intermediate,
            "down_proj": self.intermediate + self.hidden,
        }
        named = [t for t in targets if t in sizes] if isinstance(targets, list) else []
        chosen = named or list(sizes)  # all-linear, or names the plan does not know: every projection
        return self.layers * r * sum(sizes[name] for name in chosen)

    def activation_bytes_per_token(self, dtype_bytes: int, checkpointing: bool) -> int:
        """What the backward keeps a token, over every layer (see the module's doc)."""
        layer = (37 * self.hidden + 10 * self.intermediate) * dtype_bytes // 2
        if checkpointing:
            return self.layers * self.hidden * dtype_bytes + layer
        return self.layers * layer


def model_shape(model_name: str) -> tuple[ModelShape, str]:
    """The model's shape and where it came from: its config.json when it is on this machine (a folder,
    the rlcli cache, the Hugging Face cache), else the shape rlcli knows for that name. No download."""
    config_path = _local_config(model_name)
    if config_path is not None:
        return ModelShape.from_config(json.loads(config_path.read_text())), str(config_path)
    if model_name in KNOWN_SHAPES:
        return ModelShape.from_config(KNOWN_SHAPES[model_name]), f"rlcli's copy of {model_name}'s config"
    raise UsageError(
        f"model.name: the memory plan needs {model_name}'s config.json, which is not on this machine; "
        "download the model (or its config.json) first, or give a local model folder."
    )


def _local_config(model_name: str) -> Path | None:
    from rlcli.models.cache import REGISTRY, models_dir

    path = Path(model_name).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if (models_dir() / model_name / "config.json").is_file():
        return models_dir() / model_name / "config.json"
    if model_name in REGISTRY and model_name not in KNOWN_SHAPES:
        from rlcli.models.cache import pull_model

        return pull_model(model_name) / "config.json"  # the tiny test models build in a second
    if model_name.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model_name, "config.json")
        except ValueError:
            return None
        return Path(cached) if isinstance(cached, str) else None
    return None


# --- the card -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    name: str
    total_bytes: int
    capability: float | None = None  # CUDA compute capability, 8.9 for an L4 or RTX 4090; None: unknown

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB


@functools.lru_cache(maxsize=1)
def visible_gpus() -> tuple[Card, ...]:
    """This process's GPUs in CUDA's order (CUDA_VISIBLE_DEVICES applied), from nvidia-smi; none
    without it. Never initialises CUDA, so a process that forks workers afterwards still can."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    query = "--query-gpu=index,uuid,name,memory.total,compute_cap"
    try:
        out = subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    rows = [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line.count(",") >= 4]
    cards = {}
    for index, uuid, name, mib, capability in rows:
        try:
            cap = float(capability)
        except ValueError:
            cap = None
        cards[index] = cards[uuid] = Card(name, int(float(mib)) * 2**20, cap)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(cards[index] for index, *_ in rows)
    chosen = []
    for item in visible.split(","):
        item = item.strip()
        if item not in cards:
            break  # CUDA stops at the first entry it cannot match
        chosen.append(cards[item])
    return tuple(chosen)


# --- the plan -------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    """One stage's memory on one device, in bytes by part, and its peak (their sum)."""

    stage: str  # sft, rollout, update, dpo, eval
    device: str  # cuda:N
    parts: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


@dataclass
class Choices:
    """What the `auto` settings mean on this card, and why."""

    engine: str  # hf or vllm
    vllm_quantization: str | None = None  # none or fp8; None without vLLM
    vllm_memory: float | None = None  # the share of the engine's GPU passed to vLLM
    kv_cache_bytes: int | None = None  # what that share leaves for the KV cache
    sleep_level: int | None = None  # 1 or 2 when the engine sleeps during updates; None when it does not
    why: list[str] = field(default_factory=list)


@dataclass
class MemoryPlan:
    model: str
    shape_source: str
    card: Card
    gpus: int
    choices: Choices
    stages: list[StagePlan]
    problems: list[str]  # one sentence each: a stage that cannot fit, the figure and the setting to change

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "config": self.shape_source,
            "card": {
                "name": self.card.name,
                "memory_gb": _gb(self.card.total_bytes),
                "capability": self.card.capability,
            },
            "gpus": self.gpus,
            "fits": self.fits,
            "problems": self.problems,
            "choices": {
                "engine": self.choices.engine,
                "vllm_quantization": self.choices.vllm_quantization,
                "vllm_memory": self.choices.vllm_memory,
                "kv_cache_gb": None if self.choices.kv_cache_bytes is None else _gb(self.choices.kv_cache_bytes),
                "sleep_level": self.choices.sleep_level,
                "why": self.choices.why,
            },
            "stages": [
                {
                    "stage": s.stage,
                    "device": s.device,
                    "peak_gb": _gb(s.peak),
                    "parts_gb": {name: _gb(size) for name, size in s.parts.items() if size},
                }
                for s in self.stages
            ],
        }


def _gb(size: float) -> float:
    return round(size / GB, 2)


def plan_memory(recipe: Recipe, stages: list[str], card: Card, gpus: int = 1) -> MemoryPlan:
    """The memory of `stages` (sft, grpo, dpo, eval: as run.stages names them) of the recipe on `gpus`
    cards like `card`; the `auto` settings resolved for them."""
    shape, source = model_shape(recipe.model.name)
    layout = _Layout(recipe, shape, card, gpus)
    return MemoryPlan(recipe.model.name, source, card, gpus, layout.choices, layout.stages(stages), layout.problems)


class _Layout:
    """The plan's arithmetic for one recipe, model and card."""

    def __init__(self, recipe: Recipe, shape: ModelShape, card: Card, gpus: int) -> None:
        self.recipe, self.shape, self.card, self.gpus = recipe, shape, card, gpus
        self.problems: list[str] = []
        model, rollout = recipe.model, recipe.rollout
        if model.device == "cpu":
            raise UsageError("model.device is cpu: the memory plan is for GPUs; set model.device: auto or cuda.")
        self.trainer_device = _cuda(model.device)
        self.engine_device = _cuda(rollout.device or model.device)
        for device in {self.trainer_device, self.engine_device}:
            if int(device.partition(":")[2]) >= gpus:
                self.problems.append(
                    f"{device}: the recipe uses {device} but the plan has {gpus} GPU{'s' if gpus > 1 else ''}; "
                    "set --gpus, or model.device and rollout.device."
                )
        # auto is bfloat16 from Ampere (8.0) on, float32 before; 4-bit computes in quantization.compute_dtype.
        native_bf16 = card.capability is None or card.capability >= 8.0
        dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if native_bf16 else "float32")
        if model.dtype == "auto" and recipe.quantization.mode == "4bit":
            dtype = recipe.quantization.compute_dtype
        self.dtype_bytes = 4 if dtype == "float32" else 2
        self.asynchronous = recipe.grpo.max_staleness > 0
        self.choices = self._choose()

    # -- the parts ---------------------------------------------------------------------------------

    def weights(self, quant: QuantizationSection | None = None) -> int:
        """The policy's weights in memory, quantised as the recipe says (or as `quant`: a distill teacher's)."""
        shape, quant = self.shape, quant or self.recipe.quantization
        if quant.mode == "4bit":
            absmax = 1 / 64 + 4 / (64 * 256) if quant.double_quant else 4 / 64
            return int(shape.linear_params * (0.5 + absmax)) + shape.other_params * self.dtype_bytes
        if quant.mode == "8bit":
            return shape.linear_params + shape.other_params * self.dtype_bytes
        return shape.params * self.dtype_bytes

    def trainable_state(self) -> int:
        """The trained parameters' gradients and AdamW moments (and LoRA's own weights)."""
        lora = self.recipe.lora
        if lora is None:
            return self.shape.params * 3 * self.dtype_bytes
        return self.shape.lora_params(lora.r, lora.target_modules) * 16

    def resident(self) -> int:
        """The trainer's policy between updates: weights, adapter and optimizer state."""
        return self.weights() + self.trainable_state()

    def training_parts(self, sequences: int, checkpointing: bool, full_logits: bool) -> dict[str, int]:
        tokens = sequences * self.recipe.model.max_length
        parts = {
            "weights": self.weights(),
            "lora + optimizer" if self.recipe.lora else "gradients + optimizer": self.trainable_state(),
            "activations": tokens * self.shape.activation_bytes_per_token(self.dtype_bytes, checkpointing),
            # float32 logits with their log-softmax and gradient; GRPO keeps one chunk of them
            "logits": tokens * self.shape.vocab * 16 if full_logits else LOGIT_CHUNK_BYTES,
        }
        if self.recipe.quantization.mode != "none":
            # A quantised layer is dequantised for its matmul: the largest one exists at a time.
            parts["dequantised layer"] = self.shape.hidden * self.shape.intermediate * self.dtype_bytes
        return parts

    def sampler_parts(self) -> dict[str, int]:
        """The HF sampler's KV cache and a step's logits, beside the policy it samples with."""
        rollout, model = self.recipe.rollout, self.recipe.model
        kv = rollout.batch_size * model.max_length * self.shape.kv_bytes_per_token(self.dtype_bytes)
        return {"HF sampler KV cache": kv, "HF sampler logits": rollout.batch_size * self.shape.vocab * 4 * 2}

    def opponent(self, stage: str) -> int:
        """A model opponent's copy of the policy on the HF sampler (vLLM holds the policy's weights only):
        env.opponent in GRPO's rollouts, eval.opponents in eval; the policy itself (self) costs nothing."""
        from rlcli.recipe import ENV_OPPONENTS

        named = self.recipe.env.opponent if stage == "rollout" else self.recipe.eval.opponents
        kinds = named if isinstance(named, list) else [] if named is None else [named]
        if not any(kind not in ENV_OPPONENTS and kind != "self" for kind in kinds):
            return 0
        return self.weights() + sum(self.sampler_parts().values())

    def engine_weights(self, quantization: str) -> int:
        if quantization == "fp8":
            return self.shape.linear_params + self.shape.other_params * self.dtype_bytes
        return self.shape.params * self.dtype_bytes

    def engine_profile(self) -> int:
        """vLLM's start-up profiling peak: one step of tokens through the widest layer, the sampler's
        logits, and a vision model's encoder on its largest images."""
        shape, rollout = self.shape, self.recipe.rollout
        step = max(self.recipe.model.max_length, VLLM_STEP_TOKENS)
        peak = step * (3 * shape.intermediate + 4 * shape.hidden) * self.dtype_bytes
        peak += rollout.batch_size * shape.vocab * 4 * 2
        if shape.vision_params:
            width, height = rollout.vllm_image_size or (DEFAULT_MAX_PIXELS, 1)
            patches = width * height // shape.patch_pixels * self.images_per_prompt()
            peak += patches * (3 * shape.vision_intermediate + 8 * shape.vision_hidden) * self.dtype_bytes
        return peak

    def images_per_prompt(self) -> int:
        keep = self.recipe.env.keep_images
        return keep if isinstance(keep, int) else 1

    def engine_fixed(self, quantization: str) -> int:
        return self.engine_weights(quantization) + self.engine_profile() + CUDA_GRAPHS

    def one_sequence_kv(self) -> int:
        return self.recipe.model.max_length * self.shape.kv_bytes_per_token(self.dtype_bytes)

    # -- the choices -------------------------------------------------------------------------------

    def _choose(self) -> Choices:
        rollout = self.recipe.rollout
        vllm_installed = _vllm_installed()
        if rollout.engine == "hf" or (rollout.engine == "auto" and (rollout.top_k or rollout.top_p != 1)):
            return Choices("hf", why=[self._hf_reason()])
        quantization, why = self._engine_quantization()
        share, kv, share_why = self._engine_share(quantization)
        if rollout.engine == "auto" and not vllm_installed:
            return Choices("hf", why=["rollout.engine auto: the HF sampler, because vLLM is not installed."])
        if rollout.engine == "auto" and kv is None and rollout.vllm_memory is None:
            return Choices(
                "hf",
                why=[
                    f"rollout.engine auto: the HF sampler, because vLLM's {_gb(self.engine_fixed(quantization))} GB "
                    f"({'FP8' if quantization == 'fp8' else 'dense'} weights, profiling run, graphs) and one sequence's KV cache do not fit in the "
                    f"{_gb(self.vllm_room())} GB free beside the trainer."
                ],
            )
        choices = Choices("vllm", quantization, share, kv, self._sleep_level(), why=[why, share_why])
        if kv is None:
            self.problems.append(f"rollout: {share_why}")
        if choices.sleep_level is not None:
            sync = "adapter" if choices.sleep_level == 1 else "merged"
            choices.why.append(
                f"vLLM sleeps at level {choices.sleep_level} during each update: "
                + (
                    "its weights go to host memory, since adapter sync serves LoRA over them."
                    if sync == "adapter"
                    else "its weights are dropped, not copied to host memory, since merged sync reloads them all."
                )
            )
        return choices

    def _hf_reason(self) -> str:
        if self.recipe.rollout.engine == "hf":
            return "rollout.engine hf: rlcli's sampler on the trainer's GPU."
        return "rollout.engine auto: the HF sampler, because top_k/top_p are on (vLLM's logprobs would be truncated)."

    def _engine_quantization(self) -> tuple[str, str]:
        """vLLM's weights: dense in the model's dtype, or FP8 (vLLM 0.32 has no bitsandbytes: FP8 is the
        smallest weight format it quantises to online, and a sync's merged weights are quantised again)."""
        setting, quant = self.recipe.rollout.vllm_quantization, self.recipe.quantization.mode
        capable = self.card.capability is not None and self.card.capability >= FP8_CAPABILITY
        if setting == "none":
            return "none", "rollout.vllm_quantization none: vLLM serves the weights dense."
        if setting == "fp8":
            if self.card.capability is not None and not capable:
                self.problems.append(
                    f"rollout.vllm_quantization fp8: {self.card.name} (compute capability {self.card.capability}) has "
                    f"no FP8 arithmetic (it needs {FP8_CAPABILITY} or newer); set rollout.vllm_quantization: none."
                )
            return "fp8", "rollout.vllm_quantization fp8: vLLM keeps the linear layers in FP8."
        if quant == "none":
            return "none", "rollout.vllm_quantization auto: dense, as the trainer's weights are (quantization none)."
        if self.shape.vision_params:
            return "none", "rollout.vllm_quantization auto: dense, since FP8 in vLLM is not checked on vision models."
        if not capable:
            return "none", (
                f"rollout.vllm_quantization auto: dense, as {self.card.name} has no FP8 arithmetic "
                f"(compute capability {FP8_CAPABILITY} or newer)."
            )
        dense, fp8 = self.engine_weights("none"), self.engine_weights("fp8")
        return "fp8", (
            f"rollout.vllm_quantization auto: FP8 for the {quant} policy, {_gb(fp8)} GB of weights in vLLM instead "
            f"of {_gb(dense)} GB dense (vLLM 0.32 cannot hold bitsandbytes weights)."
        )

    def _engine_share(self, quantization: str) -> tuple[float | None, int | None, str]:
        """The share of the engine's card passed to vLLM, the KV cache it leaves, and why; (None, None,
        sentence) when vLLM cannot fit."""
        rollout, total = self.recipe.rollout, self.card.total_bytes
        fixed = self.engine_fixed(quantization)
        free = self.vllm_room()
        beside = int(total * HEADROOM) - free
        one = self.one_sequence_kv()
        setting = rollout.vllm_memory
        if setting is not None and setting > 1:  # bytes of KV cache
            need = fixed + int(setting)
            if need > free:
                return (
                    None,
                    None,
                    (
                        f"rollout.vllm_memory {int(setting)} bytes of KV cache needs {_gb(need)} GB for vLLM, but "
                        f"{_gb(free)} GB of the card's {_gb(total)} GB are free beside the trainer; lower it."
                    ),
                )
            return round(need / total + 0.005, 2), int(setting), f"rollout.vllm_memory: {_gb(setting)} GB of KV cache."
        if setting is not None:
            share = float(setting)
            kv = int(share * total) - fixed
            if share * total > free:
                return (
                    None,
                    None,
                    (
                        f"rollout.vllm_memory {share} asks vLLM for {_gb(share * total)} GB but {_gb(free)} GB of "
                        f"the card are free beside the trainer ({_gb(beside)} GB); set rollout.vllm_memory to at "
                        f"most {max(free / total - 0.005, 0):.2f}."
                    ),
                )
            if kv < one:
                return None, None, self._no_kv_room(quantization, share * total, fixed, one)
            return share, kv, f"rollout.vllm_memory {share}: {_gb(kv)} GB of KV cache after vLLM's {_gb(fixed)} GB."
        wanted = max(
            rollout.batch_size * self.recipe.model.max_length * self.shape.kv_bytes_per_token(self.dtype_bytes), one
        )
        kv = min(wanted, free - fixed)
        if kv < one:
            return None, None, self._no_kv_room(quantization, free, fixed, one)
        # In hundredths, as vLLM is usually given it: rounded up to hold what is wanted, down to fit.
        share = min(math.ceil((fixed + kv) / total * 100), math.floor((free / total) * 100)) / 100
        kv = int(share * total) - fixed
        return (
            share,
            kv,
            (
                f"rollout.vllm_memory auto: {share}, {_gb(kv)} GB of KV cache "
                + ("(every episode of a generate call at full length)." if kv >= wanted else "(what the card leaves).")
            ),
        )

    def vllm_room(self) -> int:
        """What the engine's card has free for vLLM: less the trainer on a shared card (and its update,
        unless the engine sleeps through it)."""
        opponent = max(self.opponent("rollout"), self.opponent("eval"))
        beside = CUDA_CONTEXT + (self.resident() + opponent if self.colocated() else 0)
        if self.colocated() and not self.sleeps():
            beside += self._update_extra()
        return int(self.card.total_bytes * HEADROOM - beside)

    def _no_kv_room(self, quantization: str, budget: float, fixed: int, one: int) -> str:
        hint = "rollout.engine: hf, a smaller model.max_length"
        if quantization == "none" and self.recipe.quantization.mode != "none":
            hint = "rollout.vllm_quantization: fp8 (or auto), " + hint
        kind = "FP8" if quantization == "fp8" else "dense"
        return (
            f"vLLM needs {_gb(fixed)} GB for its {kind} weights, profiling run and graphs and {_gb(one)} GB of KV cache "
            f"for one sequence of model.max_length, but gets {_gb(budget)} GB; set {hint}, or a smaller model."
        )

    def _update_extra(self) -> int:
        parts = self.training_parts(self.recipe.grpo.micro_batch_size, self.recipe.grpo.gradient_checkpointing, False)
        return sum(parts.values()) - self.resident()

    def colocated(self) -> bool:
        """The engine shares the trainer's GPU in the trainer's process (synchronous GRPO, eval)."""
        return self.engine_device == self.trainer_device

    def sleeps(self) -> bool:
        setting = self.recipe.rollout.vllm_sleep
        return setting if setting != "auto" else self.colocated() and not self.asynchronous

    def _sleep_level(self) -> int | None:
        if not self.sleeps():
            return None
        return 1 if self.recipe.rollout.vllm_sync == "adapter" else 2

    # -- the stages --------------------------------------------------------------------------------

    def stages(self, names: list[str]) -> list[StagePlan]:
        out: list[StagePlan] = []
        for name in dict.fromkeys(names):
            if name == "sft":
                sft = self.recipe.sft
                checkpointing = sft.gradient_checkpointing
                out.append(
                    self._trainer_stage("sft", sft.micro_batch_size, full_logits=True, checkpointing=checkpointing)
                )
            elif name == "grpo":
                out += self._grpo()
            elif name == "distill":  # GRPO's loop with a teacher beside the student, taken as the student's size
                *sampling, update = self._grpo()
                from rlcli.recipe import QuantizationSection

                teacher = QuantizationSection(mode=self.recipe.distill.quantization)
                update.parts["teacher model"] = self.weights(teacher)
                out += [*sampling, update]
            elif name == "dpo":
                dpo = self.recipe.dpo
                checkpointing = dpo.gradient_checkpointing
                out.append(
                    self._trainer_stage("dpo", 2 * dpo.micro_batch_size, full_logits=True, checkpointing=checkpointing)
                )
            elif name == "eval":
                out += self._sampling("eval")
        for stage in out:
            if stage.peak > self.card.total_bytes * HEADROOM:
                self.problems.append(self._too_big(stage))
        return out

    def _trainer_stage(self, name: str, sequences: int, *, full_logits: bool, checkpointing: bool = False) -> StagePlan:
        parts = {"CUDA context": int(CUDA_CONTEXT), **self.training_parts(sequences, checkpointing, full_logits)}
        return StagePlan(name, self.trainer_device, parts)

    def _grpo(self) -> list[StagePlan]:
        grpo = self.recipe.grpo
        update = self._trainer_stage(
            "update", grpo.micro_batch_size, full_logits=False, checkpointing=grpo.gradient_checkpointing
        )
        if self.opponent("rollout"):
            update.parts["opponent model"] = self.weights()  # the last drawn opponent stays loaded
        if self.choices.engine == "vllm" and self.colocated() and not self.asynchronous:
            update.parts["vLLM (asleep)" if self.sleeps() else "vLLM"] = (
                int(SLEEP_RESIDUE) if self.sleeps() else int((self.choices.vllm_memory or 0) * self.card.total_bytes)
            )
        return [*self._sampling("rollout"), update]

    def _sampling(self, name: str) -> list[StagePlan]:
        """A stage that samples: the policy resident in the trainer and its sampler, on one or two devices
        (the engine on its own GPU, or an asynchronous worker process with its own copy of the policy)."""
        choices = self.choices
        trainer = {"CUDA context": int(CUDA_CONTEXT), "weights": self.weights()}
        if name == "rollout":
            trainer["lora + optimizer" if self.recipe.lora else "gradients + optimizer"] = self.trainable_state()
        if self.opponent(name):
            trainer["opponent model"] = self.opponent(name)
        if choices.engine == "hf":
            if self.asynchronous and name == "rollout":
                worker = {"CUDA context": int(CUDA_CONTEXT), "weights": self.weights(), **self.sampler_parts()}
                return self._merge(name, [(self.trainer_device, trainer), (self.engine_device, worker)])
            return [StagePlan(name, self.trainer_device, trainer | self.sampler_parts())]
        engine = {
            "vLLM weights": self.engine_weights(choices.vllm_quantization or "none"),
            "vLLM profiling peak": self.engine_profile(),
            "vLLM CUDA graphs": int(CUDA_GRAPHS),
            # Without a share that fits, the least vLLM takes: one sequence's KV cache.
            "vLLM KV cache": self.one_sequence_kv() if choices.kv_cache_bytes is None else choices.kv_cache_bytes,
        }
        if self.asynchronous and name == "rollout":
            # The worker process: its own CUDA context and a copy of the policy beside its engine.
            engine |= {"worker CUDA context": int(CUDA_CONTEXT), "worker weights": self.weights()}
        elif not self.colocated():
            engine["CUDA context"] = int(CUDA_CONTEXT)
        return self._merge(name, [(self.trainer_device, trainer), (self.engine_device, engine)])

    @staticmethod
    def _merge(name: str, pieces: list[tuple[str, dict[str, int]]]) -> list[StagePlan]:
        by_device: dict[str, dict[str, int]] = {}
        for device, parts in pieces:
            merged = by_device.setdefault(device, {})
            for part, size in parts.items():
                merged[part] = merged.get(part, 0) + size
        return [StagePlan(name, device, parts) for device, parts in sorted(by_device.items())]

    def _too_big(self, stage: StagePlan) -> str:
        largest = max(stage.parts, key=lambda part: stage.parts[part])
        advice = {
            "activations": self._activation_advice(stage.stage) if largest == "activations" else "",
            "logits": f"lower {'sft' if stage.stage == 'sft' else 'dpo'}.micro_batch_size or model.max_length",
            "weights": "set quantization: 4bit, or a smaller model",
            "vLLM weights": "set rollout.vllm_quantization: fp8, or rollout.engine: hf",
            "vLLM KV cache": "lower rollout.vllm_memory",
            "HF sampler KV cache": "lower rollout.batch_size or model.max_length",
            "gradients + optimizer": "train a LoRA adapter (lora: {r: 16})",
        }.get(largest, "lower model.max_length or the micro-batch sizes")
        return (
            f"{stage.stage} on {stage.device}: needs about {_gb(stage.peak)} GB ({largest} {_gb(stage.parts[largest])} GB) "
            f"of the card's {_gb(self.card.total_bytes)} GB; {advice}."
        )

    def _activation_advice(self, stage: str) -> str:
        section = {"update": "grpo", "sft": "sft", "dpo": "dpo"}[stage]
        on = getattr(self.recipe, section).gradient_checkpointing
        checkpointing = "" if on else f"set {section}.gradient_checkpointing: true or "
        return f"{checkpointing}lower {section}.micro_batch_size or model.max_length"


def _cuda(device: str) -> str:
    """A recipe device on a GPU, as cuda:N (auto and cuda are the first GPU)."""
    return device if device.startswith("cuda:") else "cuda:0"


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def plan_on_this_machine(recipe: Recipe, stages: list[str]) -> MemoryPlan | None:
    """The plan for this machine's GPUs (the trainer's card), or None where the recipe uses none: no GPU
    visible, or model.device cpu."""
    cards = visible_gpus()
    if not cards or recipe.model.device == "cpu":
        return None
    try:
        model_shape(recipe.model.name)
    except UsageError as exc:
        # A model family whose config the plan cannot read runs unplanned rather than not at all.
        _warn_once(f"warning: no memory plan for this run: {exc}")
        return None
    index = int(_cuda(recipe.model.device).partition(":")[2])
    return plan_memory(recipe, stages, cards[min(index, len(cards) - 1)], gpus=len(cards))


def check_fits(recipe: Recipe, stages: list[str]) -> None:
    """Refuse, in one sentence, a recipe whose stages cannot fit this machine's GPUs (nothing on a CPU)."""
    if not stages:
        return
    plan = plan_on_this_machine(recipe, stages)
    if plan is not None and plan.problems:
        raise UsageError(f"{plan.problems[0]} (rlcli recipes plan shows every stage.)")


@functools.cache
def _warn_once(text: str) -> None:
    from rlcli.console import err_console

    err_console.print(text, highlight=False, markup=False)
