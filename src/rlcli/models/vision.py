"""Vision-language models: their processor, images in chat messages, and the pixel inputs of a forward.

An observation's message may hold a list of content parts, `{"type": "text", "text": ...}` and
`{"type": "image", "image": PIL.Image | path | bytes}` (the transformers / TRL convention). The
rollout turns every image into a PIL image once, names it by the sha256 of its PNG bytes (what the
run database stores, once per image) and keeps it in the message for the chat template.

Token ids come from the model's processor, which expands each image placeholder of the rendered
chat into the image's tokens; those ids are what a turn stores. The pixels are a function of the
images alone, so training rebuilds them from the stored PNGs and never tokenises text again.

Families:
- Idefics3 and SmolVLM (same architecture; 1-D positions; the tiny test model tiny-random-vlm is an
  Idefics3).
- Qwen2-VL and Qwen2.5-VL (tiny-random-qwen2-vl). Their language model places tokens with 3-D
  rotary positions (M-RoPE): an image's tokens take (time, row, column) coordinates of its patch grid
  (`image_grid_thw`) and the text after it resumes past the grid's larger side, so a position is not
  the token's index. The sampler computes them with `mrope_positions`, training lets the model's
  forward compute them from `mm_token_type_ids` (`pixel_inputs` with input_ids).
  Their processors load without torchvision: the image processor is the PIL one and the video
  processor (which needs torchvision) is left out (`image_only_processor_class`).
Every family's forward takes the images of a batch in one tensor, in the order their tokens appear
row by row, which is how `pixel_inputs` lays them out.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.errors import UsageError

# Model types whose language model takes 3-D (M-RoPE) positions, computed from the image grids.
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Model types whose processors and forwards rlcli drives (config.json's model_type).
SUPPORTED_FAMILIES = ("idefics3", "smolvlm", *MROPE_FAMILIES)
# Per family, the modules that read pixels (the vision tower and the projector into the language
# model), by their names in the *ForConditionalGeneration model: quantisation leaves them alone.
# Qwen2-VL's projector (`merger`) sits inside `model.visual`.
PIXEL_MODULES = {
    "idefics3": ("model.vision_model", "model.connector"),
    "smolvlm": ("model.vision_model", "model.connector"),
    "qwen2_vl": ("model.visual",),
    "qwen2_5_vl": ("model.visual",),
}

# tokenizer -> its model's processor; load_policy registers it (rollouts, SFT and training get the
# tokenizer everywhere, and only a vision model's needs the processor beside it).
_processors: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def vision_model_type(path: str | Path) -> str | None:
    """The model_type of a vision-language model (its config.json has a vision_config), else None.
    `path` is a model folder or a hub id in the Hugging Face cache (as resolve_model returns them)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(str(path), "config.json")
        except ValueError:  # not a hub id either
            cached = None
        config_file = Path(cached) if isinstance(cached, str) else config_file
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if "vision_config" in config else None


def load_processor(path: str | Path, name: str, chat_template: str | None) -> Any:
    """The model's processor (image processor + tokenizer + chat template), padded on the left."""
    from transformers import AutoProcessor

    model_type = vision_model_type(path)
    if model_type not in SUPPORTED_FAMILIES:
        raise UsageError(
            f"model.name: {name} is a {model_type} vision-language model; rlcli drives "
            f"{', '.join(SUPPORTED_FAMILIES)} ones so far (see docs/models.md)."
        )
    processor_class = image_only_processor_class(model_type) if model_type in MROPE_FAMILIES else AutoProcessor
    try:
        processor = processor_class.from_pretrained(path)
    except (ImportError, TypeError, AttributeError) as exc:  # transformers without a backend it needs
        raise UsageError(f"model.name: the processor of {name} cannot be loaded here ({exc}).") from None
    processor.tokenizer.padding_side = "left"
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    if chat_template:
        processor.chat_template = chat_template
    if not processor.chat_template:
        raise UsageError(f"model.name: the processor of {name} has no chat template; set model.chat_template to one.")
    return processor


@functools.cache  # one class per family: processors of one model type share it
def image_only_processor_class(model_type: str) -> Any:
    """The processor class of a Qwen2-VL-family model_type without its video processor.

    transformers' Qwen2-VL processors take an image processor, a tokenizer and a video processor, and
    check the video processor's class even when it is None; that check, and the video processor
    itself, need torchvision. rlcli never passes videos, so it builds them from the other two parts
    (the image processor is then the PIL one, which needs no torchvision).
    """
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    base = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[model_type]

    def __init__(
        self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any
    ) -> None:
        # The processor's sub-processors are the parameters of __init__: leaving video_processor out
        # of the signature is what drops it.
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template)

    # Named as the base class: processor_config.json then says Qwen2VLProcessor, as a real checkpoint's.
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


def attach_processor(tokenizer: Any, processor: Any) -> None:
    _processors[tokenizer] = processor


def processor_of(tokenizer: Any) -> Any | None:
    """The processor of a vision-language model's tokenizer; None for a text model's."""
    return _processors.get(tokenizer) if tokenizer is not None else None


# --- images --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageRef:
    """An image of a conversation: the PIL image the processor reads and the hash it is stored by."""

    sha256: str
    image: Any  # PIL.Image.Image, RGB


def to_image(value: Any) -> Any:
    """A PIL image (RGB) from an image part's value: a PIL image, a path, or encoded bytes."""
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, (str, Path)):
        image = Image.open(Path(value).expanduser())
    else:
        raise ValueError(f"an image part holds a {type(value).__name__}; expected a PIL image, a path or bytes")
    image.load()
    return image.convert("RGB")


def png_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    # PNG is lossless: the stored image gives back exactly the pixels the model saw.
    image.save(out, format="PNG")
    return out.getvalue()


def image_from_png(data: bytes) -> Any:
    return to_image(data)


def name_images(messages: list[dict], pngs: dict[str, bytes]) -> list[dict]:
    """Messages whose image parts hold a PIL image and its `sha256`; each new image's PNG goes into `pngs`."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image" and "sha256" not in part:
                    image = to_image(part.get("image"))
                    data = png_bytes(image)
                    sha = hashlib.sha256(data).hexdigest()
                    pngs.setdefault(sha, data)
                    part = {"type": "image", "image": image, "sha256": sha}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


def message_images(messages: list[dict]) -> list[ImageRef]:
    """The images of named messages (name_images), in the order the chat template writes them."""
    return [
        ImageRef(part["sha256"], part["image"])
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def keep_last_images(messages: list[dict], keep: int | None) -> list[dict]:
    """The messages with only their last `keep` images (None: all); an older image part becomes the
    text "[earlier screenshot omitted]", so the model still sees that there was one."""
    if keep is None:
        return messages
    total = len(message_images(messages))
    drop = total - keep
    if drop <= 0:
        return messages
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image" and drop > 0:
                    drop -= 1
                    part = {"type": "text", "text": "[earlier screenshot omitted]"}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


# --- tokens and pixels -----------------------------------------------------------------------


def render(processor: Any, messages: list[dict]) -> str:
    """The chat as text, with one placeholder per image, ending in the generation prompt."""
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def tokenize(processor: Any, text: str, images: list[ImageRef]) -> list[int]:
    """Token ids of `text` whose image placeholders stand for `images`, expanded by the processor into
    the image tokens exactly as the model reads them."""
    if not images:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = processor(text=[text], images=[[ref.image for ref in images]], add_special_tokens=False)
    return list(out["input_ids"][0])


def fold_image_tokens(processor: Any, ids: list[int], images: list[ImageRef], cache: dict[str, list[int]]) -> list[int]:
    """`ids` with each image's tokens (as `tokenize` expanded them) folded back into the processor's one
    image placeholder token: the prompt as vLLM takes it with the images beside it, since vLLM's own
    processor expands every placeholder it finds. cache: each image's expansion, by sha256.

    An image's expansion is found from where the previous one ended; the placeholder text alone,
    expanded with the image, gives it (Idefics3 wraps the image tokens in marker tokens, Qwen2-VL
    repeats its image token), so this needs no knowledge of the family."""
    placeholder = processor.tokenizer(processor.image_token, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    cursor = 0
    for ref in images:
        if ref.sha256 not in cache:
            cache[ref.sha256] = tokenize(processor, processor.image_token, [ref])
        expanded = cache[ref.sha256]
        start = _find(ids, expanded, cursor)
        if start < 0:
            raise ValueError(f"image {ref.sha256[:12]}'s tokens are not in the prompt after token {cursor}")
        out += ids[cursor:start] + placeholder
        cursor = start + len(expanded)
    return out + ids[cursor:]


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The index of the first occurrence of `part` in `ids` at or after `start`; -1 if none."""
    first, n = part[0], len(part)
    i = start
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return -1
        if ids[i : i + n] == part:
            return i
        i += 1


def pixel_inputs(processor: Any, images: list[Any], model: Any, input_ids: Any = None) -> dict[str, Any]:
    """The forward's pixel arguments for `images` (PIL images, in the order their tokens appear in the
    batch, row after row), on the model's device and in its dtype; {} without images.

    Idefics3 takes them as one [1, images, 3, H, W] list whatever the batch's rows (its forward
    drops all-zero padding images, fills the image tokens in order). Qwen2-VL takes the patches of
    all images as one [patches, dim] tensor and each image's patch grid (`image_grid_thw`).
    input_ids (the batch's [B, L] tensor) is for a forward without position_ids: an M-RoPE model
    then computes its 3-D positions from `mm_token_type_ids` (1 at image tokens), added here.
    """
    if not images:
        return {}
    param = next(model.parameters())
    out = processor.image_processor(images=[list(images)], return_tensors="pt")
    pixels = {"pixel_values": out["pixel_values"].to(param.device, _float_dtype(model))}
    for key in ("pixel_attention_mask", "image_grid_thw"):
        if key in out:
            pixels[key] = out[key].to(param.device)
    if input_ids is not None and uses_mrope(model):
        pixels["mm_token_type_ids"] = (input_ids == processor.image_token_id).int()
    return pixels


def slot_token_ids(config: Any) -> list[int]:
    """The tokens a vision-language model's forward reads as image (or video) slots, to be filled with
    features: the policy never writes them. One in a reply would be a slot without an image when
    training forwards the sequence (the forward fails), so the samplers and the trainer both take
    them out of the policy's distribution (their logits -inf). [] for a text model."""
    ids = (getattr(config, name, None) for name in ("image_token_id", "video_token_id"))
    return [i for i in ids if isinstance(i, int)]


def uses_mrope(model: Any) -> bool:
    """Whether the model's language model takes 3-D (M-RoPE) positions (Qwen2-VL's family)."""
    return getattr(model.config, "model_type", None) in MROPE_FAMILIES


def mrope_positions(model: Any, processor: Any, ids: list[int], grids: Any) -> tuple[Any, int]:
    """The 3-D positions ([3, len(ids)], counted from 0) of a sequence whose images have the patch
    grids `grids` ([images, 3], on the CPU), as the model's own forward computes them (its
    get_rope_index), and the shift from a token's index to its position at the end (the text after
    the last image continues from len(ids) + shift).

    Every position of a segment moves by the same amount when the segment starts later, so a turn's
    new tokens get theirs from this plus where the cached tokens before them ended."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft wrapper
    row = torch.tensor([ids])
    types = (row == processor.image_token_id).int()
    positions, shift = inner.model.get_rope_index(row, mm_token_type_ids=types, image_grid_thw=grids)
    return positions[:, 0], int(shift[0, 0])


def _float_dtype(model: Any) -> Any:
    """The dtype the vision tower computes in (quantised weights keep float norms and embeddings)."""
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
