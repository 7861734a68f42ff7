"""The policy: loading the model and tokenizer with LoRA (peft) and quantisation (bitsandbytes),
the reference policy for KL, checkpoints and merged exports.

torch, transformers and peft are imported inside the functions, so that importing this module
stays cheap.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rlcli.console import err_console
from rlcli.errors import UsageError
from rlcli.export_folder import check_export_target, export_folder
from rlcli.models.cache import resolve_model

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, TrainingArguments

    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    # The policy as rlcli holds it: a transformers model, or a PeftModel around one (a LoRA run's).
    PolicyModel: TypeAlias = PreTrainedModel | PeftModel

# --- loading the policy ---------------------------------------------------------------


def load_policy(
    model_cfg: ModelSection,
    lora_cfg: LoraSection | None,
    quant_cfg: QuantizationSection,
    *,
    adapter: str | Path | None = None,
    trainable: bool = True,
) -> tuple[Any, Any]:
    """Load the policy model and its tokenizer as the recipe's model, lora and quantization say.

    adapter: a checkpoint folder from save_checkpoint: a LoRA adapter, put on the base model, or a
    full model (a run without LoRA), loaded instead of the base.
    trainable: with LoRA only the adapter trains; without LoRA (lora_cfg None) every parameter does.
    False loads for inference: no parameter requires grad.
    The model comes back in eval mode, as from_pretrained leaves it; call model.train() to update.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from rlcli.models import vision

    # A "Loading weights" bar per load would bury rlcli's own progress (eval loads one per checkpoint).
    hf_logging.disable_progress_bar()
    if quant_cfg.mode != "none" and lora_cfg is None and trainable:
        raise UsageError(
            "quantization: quantized weights cannot be fully fine-tuned; add a lora: section or set quantization: none."
        )
    base = resolve_model(model_cfg.name)
    checkpoint = _check_checkpoint(adapter) if adapter is not None else None
    is_adapter = checkpoint is not None and (checkpoint / "adapter_config.json").is_file()
    device = resolve_device(model_cfg.device)
    # A vision-language model comes with a processor; its tokenizer is what the rest of rlcli holds,
    # and vision.processor_of(tokenizer) finds the processor again.
    vision_type = vision.vision_model_type(base)
    is_vision = vision_type is not None
    if is_vision:
        template = _read_chat_template(model_cfg.chat_template) if model_cfg.chat_template else None
        processor = vision.load_processor(base, model_cfg.name, template)
        tokenizer = processor.tokenizer
        tokenizer.chat_template = processor.chat_template
        vision.attach_processor(tokenizer, processor)
    else:
        tokenizer = load_tokenizer(model_cfg, base)

    auto_class = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
    # A VLM's vision tower and projector stay unquantised (see quantization_config).
    keep = vision.PIXEL_MODULES[vision_type] if vision_type is not None else ()
    model: Any  # a transformers model, or a PeftModel around one
    with _streamed_reads() if quant_cfg.mode != "none" else contextlib.nullcontext():
        model = auto_class.from_pretrained(
            checkpoint if checkpoint is not None and not is_adapter else base,
            dtype=load_dtype(model_cfg, quant_cfg, device),
            device_map={"": device},
            quantization_config=quantization_config(quant_cfg, device, keep),
        )
    if quant_cfg.mode == "4bit":
        _keep_4bit_trainable(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if quant_cfg.mode != "none" and trainable:
        _prepare_quantized_for_training(model)

    if is_adapter:
        from peft import PeftModel

        assert checkpoint is not None  # is_adapter: a folder with adapter_config.json
        with _quiet_peft():
            model = PeftModel.from_pretrained(model, checkpoint, is_trainable=trainable)
        if not trainable and quant_cfg.mode == "none":
            # Inference only (eval, rollouts of a stored checkpoint): fold the adapter into the weights.
            # The separate LoRA branch costs ~45% more per prefill and ~20% per decode step on a CPU.
            # (Quantized weights keep the branch: merging would round the update away.)
            model = model.merge_and_unload()
    elif lora_cfg is not None and trainable:
        model = _add_lora(model, lora_cfg, model_cfg.name, exclude_vision=is_vision and not lora_cfg.target_vision)
    else:
        model.requires_grad_(trainable)
    if is_vision:
        vision.attach_processor(model, processor)  # the GRPO update builds pixels with it
    return model, tokenizer


def put_adapter(model: Any, folder: str | Path) -> Any:
    """`model`, loaded for inference without an adapter (or as put_adapter returned it), with the LoRA
    adapter of checkpoint folder `folder` in place of the one it has: only the adapter's weights are read
    (a few MB), the base model stays as it is. The adapter is a separate branch; merge_adapter() folds it
    into the weights. The first call wraps the model in peft's PeftModel: use the model it returns."""
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if not isinstance(model, PeftModel):
        with _quiet_peft():
            return PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    device = next(model.parameters()).device
    set_peft_model_state_dict(model, load_peft_weights(str(folder), device=str(device)))
    return model


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise UsageError(f"model.device is {name} but torch finds no CUDA GPU here; use auto or cpu.")
        return name
    raise UsageError(f"model.device: expected auto, cpu, cuda or cuda:N, got {name!r}.")


def on_one_device(args: TrainingArguments, device: str) -> None:
    """Make the Hugging Face Trainer built on `args` (SFT's, DPO's) train on `device` alone (the
    recipe's model.device, resolved), however many GPUs are visible.

    Without a distributed launcher, TrainingArguments counts every visible GPU (n_gpu) and takes
    cuda:0: with n_gpu > 1 the Trainer would wrap the policy in nn.DataParallel (a replica per GPU and
    n_gpu times the batch; TRL's trainers refuse it), and its batches would go to cuda:0 beside a
    policy on cuda:1. So n_gpu is 1, as the Trainer itself sets it for a model it must not wrap, and
    on cuda:N the args' device (where the Trainer puts the model and each batch) and accelerate's
    (where its dataloaders put batches, and where a 4-bit model must be) are cuda:N. The process's
    current CUDA device stays cuda:0, the in-process vLLM engine's.
    """
    import torch

    if args.device.type != "cuda":
        return
    args._n_gpu = 1
    target = torch.device(device)
    if target.index is not None and target != args.device:
        args._setup_devices = target  # a cached property: what args.device gives from now on
        args.distributed_state.device = target


def resolve_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        # bfloat16 halves memory and is fast on recent GPUs; on CPUs float32 is the safe default.
        return torch.bfloat16 if device.startswith("cuda") and has_native_bf16(device) else torch.float32
    return getattr(torch, name)


def has_native_bf16(device: str) -> bool:
    """Whether the GPU `device` (cuda or cuda:N) computes in bfloat16 natively: compute capability 8.0
    (Ampere) or newer. torch.cuda.is_bf16_supported() also counts emulation (a T4 or V100 says yes), and
    vLLM refuses bfloat16 below 8.0; and it asks about the current device, not the one the run uses."""
    import torch

    index = int(device.partition(":")[2] or 0)
    return torch.cuda.get_device_capability(index) >= (8, 0)


def load_dtype(model_cfg: ModelSection, quant_cfg: QuantizationSection, device: str) -> Any:
    """The dtype of the weights that stay unquantised: model.dtype, where `auto` with 4-bit is the
    compute dtype (bfloat16 by default). The embedding and LM head stay unquantised, and for a
    150k-token vocabulary they are the largest tensor: float32 (auto on a CPU) would double them."""
    if model_cfg.dtype == "auto" and quant_cfg.mode == "4bit":
        import torch

        return getattr(torch, quant_cfg.compute_dtype)
    return resolve_dtype(model_cfg.dtype, device)


def _prepare_quantized_for_training(model: Any) -> None:
    """Freeze the base weights (LoRA adds the trainable ones). What peft's prepare_model_for_kbit_training
    does without gradient checkpointing (that is grpo.gradient_checkpointing's choice), except that it
    upcasts only float16 weights to float32: float16 without loss scaling overflows. bfloat16 has
    float32's range and stays, as in the unquantised bf16 path (float32 adapter, bf16 activations):
    peft's upcast of the embedding and LM head would double the largest tensors and the residual stream."""
    import torch

    model.requires_grad_(False)
    for param in model.parameters():
        if param.dtype == torch.float16:
            param.data = param.data.float()


@contextlib.contextmanager
def _streamed_reads() -> Iterator[None]:
    """While from_pretrained quantises a checkpoint on the fly: each tensor is read with pread rather
    than through a memory map, and the memory its full-precision copies used is handed back to the OS
    before the next one is read. The load's peak is then the quantised model plus about one tensor.

    transformers memory-maps each safetensors file, and every page the quantiser reads stays resident
    (counted in the process's memory) until the file closes at the end of the load: the whole
    full-precision file on top of its quantised copy. And glibc keeps the freed temporaries (each
    tensor, its float32 conversion) in its heap, which the small quantised tensors allocated between
    them fragment: measured, 300-450 MB retained while quantising SmolLM2-135M. A transformers that
    no longer reads through modeling_utils.safe_open loads as it does by itself."""
    import transformers.modeling_utils as modeling_utils
    from safetensors import safe_open

    if getattr(modeling_utils, "safe_open", None) is not safe_open:
        yield
        return
    trim = _malloc_trim()

    def open_pread(filename: Any, framework: str = "pt", device: Any = "cpu", **kwargs: Any) -> Any:
        try:
            handle = safe_open(filename, framework=framework, device=device, backend="pread")
        except TypeError:  # safetensors before 0.8 has no pread backend: memory-map as transformers asked
            return safe_open(filename, framework=framework, device=device, **kwargs)
        return _TrimmedReads(handle, trim)

    # Patched where transformers looks it up; mypy sees the name as safetensors' class.
    modeling_utils.safe_open = open_pread  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        modeling_utils.safe_open = safe_open  # type: ignore[misc]


def _malloc_trim() -> Any:
    """A function that returns the C heap's free pages to the OS (glibc's malloc_trim), or does nothing
    where the C library has none (macOS, musl)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


class _TrimmedReads:
    """A safetensors file whose tensor slices trim the heap before they read (see _streamed_reads)."""

    def __init__(self, handle: Any, trim: Any) -> None:
        self._handle, self._trim = handle, trim

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _TrimmedReads:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._handle.__exit__(*exc)

    def get_slice(self, name: str) -> _TrimmedSlice:
        return _TrimmedSlice(self._handle, name, self._trim)


class _TrimmedSlice:
    def __init__(self, handle: Any, name: str, trim: Any) -> None:
        self._handle, self._name, self._trim = handle, name, trim
        self._slice = handle.get_slice(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._slice, name)

    def __getitem__(self, key: Any) -> Any:
        # transformers quantises one tensor at a time: reading this one means the last one's
        # full-precision copies are garbage now.
        self._trim()
        if key is Ellipsis:
            # The whole tensor, read once: with pread, safetensors 0.8's slice[...] holds two copies
            # at its peak (measured: +520 MB for a 272 MB embedding), get_tensor one.
            return self._handle.get_tensor(self._name)
        return self._slice[key]


def quantization_config(quant_cfg: QuantizationSection, device: str, keep: tuple[str, ...] = ()) -> Any:
    """A transformers BitsAndBytesConfig (the shape of TRL's get_quantization_config), or None.

    keep: modules (name prefixes) left unquantised besides the LM head. A VLM keeps its vision tower
    and projector (vision.PIXEL_MODULES): they run once per image, not per token, and are a small
    share of the weights (670 M of Qwen2.5-VL-3B's 3.8 B parameters, about 1 GB more in bfloat16
    than in 4-bit), while rounding them perturbs every image feature the language model reads.
    Frozen full-precision layers also take a LoRA adapter as they are (lora.target_vision)."""
    if quant_cfg.mode == "none":
        return None
    import torch

    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - a broken native library raises more than ImportError
        raise UsageError(
            f"quantization.mode {quant_cfg.mode} needs bitsandbytes, which cannot be imported here ({exc}); "
            "install it or set quantization: none."
        ) from None
    device_type = torch.device(device).type
    # Older bitsandbytes has no such list: it only ran on CUDA.
    if device_type not in getattr(bitsandbytes, "supported_torch_devices", {"cuda"}):
        raise UsageError(
            f"quantization.mode {quant_cfg.mode}: bitsandbytes {bitsandbytes.__version__} cannot run on {device_type}; "
            "set quantization: none."
        )
    from transformers import BitsAndBytesConfig

    # A skip list replaces transformers' default one, which is the LM head: name it again.
    skip = {"llm_int8_skip_modules": [*keep, "lm_head"]} if keep else {}
    if quant_cfg.mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        **skip,
        bnb_4bit_quant_type=quant_cfg.quant_type,
        bnb_4bit_use_double_quant=quant_cfg.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, quant_cfg.compute_dtype),
    )


def _keep_4bit_trainable(model: Any) -> None:
    # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights for inference on the first
    # eval-mode forward without grad, into a kernel with no backward: training afterwards silently
    # loses the gradients through the base weights. Rollouts and updates alternate on one model,
    # so turn the repacking off.
    import bitsandbytes

    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    # peft 0.21 still reads transformers' deprecated is_gradient_checkpointing: a FutureWarning
    # on every wrap that the user can do nothing about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


# The modules of a vision-language model that read pixels (its vision tower and the projector into the
# language model): without lora.target_vision, LoRA leaves them alone and they stay frozen.
VISION_MODULES = r".*(vision_model|vision_tower|visual|connector|multi_modal_projector)\b.*"


def lora_config(lora_cfg: LoraSection, exclude_vision: bool = False) -> Any:
    """A peft LoraConfig (the shape of TRL's get_peft_config); exclude_vision keeps it off VISION_MODULES."""
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM",
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        exclude_modules=VISION_MODULES if exclude_vision else None,
        bias="none",
    )


def _add_lora(model: Any, lora_cfg: LoraSection, model_name: str, exclude_vision: bool = False) -> Any:
    import torch
    from peft import get_peft_model

    # peft only complains when no target matches at all; a typo beside a valid name would
    # silently adapt fewer layers, so check every name.
    targets = lora_cfg.target_modules
    names = [name for name, _ in model.named_modules()]
    if targets == "all-linear":
        unmatched = []
    elif isinstance(targets, str):  # peft reads a string as a regex over full module names
        unmatched = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    else:
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UsageError(
            f"lora.target_modules: {', '.join(unmatched)} matches no module of {model_name}; "
            f"its linear layers are {', '.join(linear[:12])} (or use all-linear)."
        )
    try:
        with _quiet_peft():
            return get_peft_model(model, lora_config(lora_cfg, exclude_vision=exclude_vision))
    except ValueError as exc:
        raise UsageError(f"lora.target_modules: {exc}") from None


def load_tokenizer(model_cfg: ModelSection, path: str | Path) -> Any:
    """The tokenizer, padded on the left (generation continues after the prompt), with a chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_cfg.chat_template:
        tokenizer.chat_template = _read_chat_template(model_cfg.chat_template)
    if not tokenizer.chat_template:
        raise UsageError(
            f"model.name: the tokenizer of {model_cfg.name} has no chat template; "
            "set model.chat_template to a Jinja template or a file holding one."
        )
    return tokenizer


def _read_chat_template(value: str) -> str:
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise UsageError(f"model.chat_template: {value} is neither a Jinja template nor an existing file.")
    return path.read_text()


def _check_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"Checkpoint {path} does not exist.")
    if is_pruned(path):
        raise UsageError((path / PRUNED_NOTE).read_text().strip())
    if not (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise UsageError(
            f"Checkpoint {path} is neither a LoRA adapter (adapter_config.json) nor a model folder (config.json)."
        )
    return path


# --- the reference policy for KL ---------------------------------------------------


REFERENCE_ADAPTER = "reference"  # the name of the frozen SFT adapter that grpo.reference: sft loads


def check_reference_possible(lora_cfg: LoraSection | None, beta: float) -> None:
    """A KL penalty needs the reference policy, which rlcli computes on the policy's own base
    weights: the LoRA adapter switched off (the base model) or swapped for a frozen SFT adapter."""
    if beta > 0 and lora_cfg is None:
        raise UsageError(
            "grpo.beta > 0 needs a reference model, which rlcli gets by switching the LoRA adapter off "
            "(or swapping in the SFT adapter); add a lora: section or set grpo.beta: 0."
        )


def attach_reference(model: Any, checkpoint: str | Path) -> None:
    """Load the LoRA adapter at `checkpoint` (the run's SFT checkpoint) beside the trainable one as
    a second, frozen adapter, so that reference_context computes the SFT policy instead of the base.

    It costs one more adapter's weights, not a second model. peft's load_adapter leaves the new
    adapter frozen and inactive, and the trainable adapter active and trainable; both are checked.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise UsageError(
            "grpo.reference sft needs a LoRA policy (the SFT adapter is swapped in for the reference); "
            "add a lora: section, or set grpo.beta: 0."
        )
    folder = _check_checkpoint(checkpoint)
    if not (folder / "adapter_config.json").is_file():
        raise UsageError(f"grpo.reference sft: checkpoint {folder} is not a LoRA adapter (no adapter_config.json).")
    active = model.active_adapter
    with _quiet_peft():
        model.load_adapter(str(folder), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    reference_params = [p for n, p in model.named_parameters() if f".{REFERENCE_ADAPTER}." in n]
    if model.active_adapter != active or not reference_params or any(p.requires_grad for p in reference_params):
        raise RuntimeError("peft left the reference adapter active or trainable; the KL anchor would move.")


def reference_context(model: Any) -> AbstractContextManager[None]:
    """`with reference_context(model):` the model computes the reference policy, no second copy:
    the frozen SFT adapter when attach_reference loaded one, else the base model (adapter disabled).

    The reference is a fixed policy, so it is computed in eval mode (no dropout); the model's
    training mode and its trainable adapter come back on exit. Call it under torch.no_grad().
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise UsageError(
            "The reference policy needs a LoRA adapter to switch off; add a lora: section or set grpo.beta: 0."
        )
    return _as_reference(model)


@contextlib.contextmanager
def _as_reference(model: Any) -> Iterator[None]:
    training = model.training
    model.eval()
    try:
        if REFERENCE_ADAPTER in model.peft_config:
            active = model.active_adapter
            # peft's set_adapter also sets requires_grad: inference_mode=True freezes every adapter,
            # and switching back makes the trainable one trainable again (and the reference frozen)
            # before the backward pass that needs its gradients.
            model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield
            finally:
                model.set_adapter(active)
        else:
            with model.disable_adapter():
                yield
    finally:
        model.train(training)


# --- checkpoints and export -----------------------------------------------------------


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Save the LoRA adapter (or the full model, without LoRA) and the tokenizer (a vision-language
    model's processor) into `path`.

    The folder appears complete or not at all: it is written beside, fsynced and renamed into place.
    """
    return _save_folder(model, tokenizer, Path(path))


# What a pruned checkpoint folder holds instead of its weights: the sentence saying why, which a load
# of the folder ends with.
PRUNED_NOTE = "PRUNED.txt"


def prune_checkpoint(folder: Path, note: str) -> None:
    """Delete the weights and trainer state in a checkpoint folder, leaving `note` in their place. The
    note goes in first, whole (renamed into place): a kill part-way leaves a folder that reads as
    pruned, and pruning it again deletes the rest."""
    marker = folder / PRUNED_NOTE
    if not marker.is_file():
        partial = folder / f".{PRUNED_NOTE}.partial"
        partial.write_text(note + "\n")
        _fsync(partial)
        os.replace(partial, marker)
        _fsync(folder)
    for entry in folder.iterdir():
        if entry.name == PRUNED_NOTE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def is_pruned(folder: Path) -> bool:
    return (folder / PRUNED_NOTE).is_file()


def export_merged(
    model_cfg: ModelSection,
    lora_cfg: LoraSection | None,
    quant_cfg: QuantizationSection,
    adapter_path: str | Path,
    out_dir: str | Path,
    overwrite: bool = False,
    option: str = "--merge",
    extra: Callable[[Path], dict[str, bytes]] | None = None,
) -> Path:
    """Write the checkpoint merged into its base as one full model that from_pretrained loads.

    The base is loaded unquantized on the CPU: merging into 4-bit or 8-bit weights would round the
    adapter's update away. dtype auto means float32 here. `out_dir` may be new, empty, or (with
    `overwrite`) an earlier export; any other folder is refused untouched. A vision-language model
    exports with its processor (image processor, tokenizer, chat template). `extra(folder)` gives more
    files (name -> bytes: a model card) to write beside the model, from what was saved there; `option`
    is the command-line option that named `out_dir`, for the refusals.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from rlcli.models import vision

    out_dir = Path(out_dir)
    check_export_target(out_dir, option, overwrite)  # before minutes of loading and merging
    hf_logging.disable_progress_bar()  # its loading and shard-writing bars, among the command's sentences
    checkpoint = _check_checkpoint(adapter_path)
    is_adapter = (checkpoint / "adapter_config.json").is_file()
    if is_adapter != (lora_cfg is not None):
        expected = (
            "a LoRA adapter (adapter_config.json)"
            if lora_cfg is not None
            else "a full model (the recipe has no lora: section)"
        )
        raise UsageError(f"Checkpoint {checkpoint} does not match the recipe: expected {expected}.")
    base = resolve_model(model_cfg.name)
    auto_class: type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]
    if vision.vision_model_type(base) is not None:
        template = _read_chat_template(model_cfg.chat_template) if model_cfg.chat_template else None
        auto_class, processor = AutoModelForImageTextToText, vision.load_processor(base, model_cfg.name, template)
    else:
        auto_class, processor = AutoModelForCausalLM, load_tokenizer(model_cfg, base)
    dtype = resolve_dtype(model_cfg.dtype, "cpu")
    if quant_cfg.mode != "none":
        err_console.print(
            f"Merging into the unquantized base ({str(dtype).removeprefix('torch.')}): its outputs differ "
            f"slightly from the {quant_cfg.mode} policy that was trained."
        )
    if is_adapter:
        from peft import PeftModel

        model = auto_class.from_pretrained(base, dtype=dtype, device_map={"": "cpu"})
        with _quiet_peft():
            model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    else:
        model = auto_class.from_pretrained(checkpoint, dtype=dtype, device_map={"": "cpu"})
    with export_folder(out_dir, option, overwrite) as staging:
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        for name, data in (extra(staging) if extra else {}).items():
            (staging / name).write_bytes(data)
    return out_dir


def _save_folder(model: Any, tokenizer: Any, path: Path) -> Path:
    from peft import PeftModel

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(model, PeftModel):
        # Only the trainable adapter: a frozen reference adapter beside it (attach_reference) is not the policy.
        model.save_pretrained(str(tmp), selected_adapters=[model.active_adapter])
    else:
        model.save_pretrained(tmp)
    _save_tokenizer(tokenizer, tmp)
    fsync_folder(tmp)
    replace_folder(tmp, path)
    return path


# Per tokenizer object, its saved files' contents (a few MB), for the next checkpoint.
_tokenizer_files: weakref.WeakKeyDictionary[Any, dict[str, bytes]] = weakref.WeakKeyDictionary()


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """The tokenizer's files into `folder`, so that every checkpoint loads on its own; a vision-language
    model's whole processor (image processor, tokenizer, chat template), so that AutoProcessor loads
    from the checkpoint too. They are serialised once per process (tens of ms per checkpoint otherwise,
    more for a 150k vocabulary; they do not change while training) and their bytes are written into
    each folder after that."""
    from rlcli.models import vision

    files = _tokenizer_files.get(tokenizer)
    if files is None:
        with tempfile.TemporaryDirectory(prefix="rlcli-tokenizer-") as tmp:
            (vision.processor_of(tokenizer) or tokenizer).save_pretrained(tmp)
            files = {path.name: path.read_bytes() for path in Path(tmp).iterdir() if path.is_file()}
        _tokenizer_files[tokenizer] = files
    for name, data in files.items():
        (folder / name).write_bytes(data)


def fsync_folder(folder: Path, *, files: bool = True) -> None:
    """Flush the folder's files (unless files=False) and the folder itself to disk, so that after
    a host crash a folder that was renamed into place, and the row recorded for it, never point
    at empty or partial files."""
    if files:
        for path in sorted(folder.rglob("*")):
            _fsync(path)
    _fsync(folder)


def replace_folder(new: Path, target: Path) -> None:
    """Put the folder `new` in place of `target` (which may be missing), its parent fsynced after.

    A folder cannot be renamed over a non-empty one, and deleting the old one first would leave, for
    a kill in between, no checkpoint at all. So the two are swapped in one step (renameat2
    RENAME_EXCHANGE on Linux, renamex_np RENAME_SWAP on macOS) and the old one, now at `new`, is
    removed: a kill leaves the old folder or the new one, and at worst a stale `new` that the next
    save removes first. A file system that cannot swap gets the old folder moved aside first.
    """
    if not target.exists():
        new.rename(target)
    elif not _swap(new, target):
        retired = target.with_name(target.name + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        target.rename(retired)
        new.rename(target)
        new = retired
    shutil.rmtree(new, ignore_errors=True)  # the old folder, if there was one
    fsync_folder(target.parent, files=False)


def _swap(a: Path, b: Path) -> bool:
    """Exchange two paths atomically; False where the OS or the file system cannot."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):  # Linux
        at_fdcwd, rename_exchange = -100, 2
        done = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    elif hasattr(libc, "renamex_np"):  # macOS
        rename_swap = 2
        done = libc.renamex_np(os.fsencode(a), os.fsencode(b), rename_swap) == 0
    else:
        return False
    if done:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder too: fsync on its descriptor makes its entries durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
