"""tiny-random: a 2-layer random Llama with a byte-level ChatML tokenizer, built locally in about a second;
tiny-random-vlm, tiny-random-qwen2-vl and tiny-random-qwen2.5-vl: the same idea for an Idefics3
(SmolVLM-style), a Qwen2-VL and a Qwen2.5-VL vision-language model, each with its processor.

Tests and demos run on them where the numbers need not mean anything: they load in a blink, every text
round-trips through their tokenizer, and the chat template renders tool calls like Qwen2.5's (and,
for the VLMs, image parts as their family's image placeholder).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

# Same seed, same weights: tests that compare numbers stay reproducible.
TINY_SEED = 0
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def build_tiny_random(out: Path, head_dim: int = 16) -> None:
    """Write the model and its tokenizer into `out` as a `from_pretrained` folder.

    head_dim: 16 gives tiny-random (hidden 64, 4 heads); vLLM's CPU attention refuses 16 (it
    takes 32, 64, 80, ...), so its tests build head_dim=64 (hidden 128, 2 heads), with the same tokenizer.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer([IM_START, IM_END], CHATML_TOOLS_TEMPLATE)
    bpe = tokenizer.backend_tokenizer
    end = _token_id(bpe, IM_END)
    hidden = max(64, 2 * head_dim)
    heads = hidden // head_dim
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=end,
        pad_token_id=end,
    )
    # fork_rng keeps the caller's random state untouched.
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tiny_tokenizer(special_tokens: list[str], chat_template: str, corpus: str = "") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: it round-trips any text (every byte is in the alphabet); the merges
    learnt from a small built-in corpus just make common words a few tokens long."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((_TINY_CORPUS + corpus).splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=IM_END, pad_token=IM_END, chat_template=chat_template
    )


def _token_id(bpe: Tokenizer, token: str) -> int:
    """The id of one of the special tokens the tiny tokenizer was built with."""
    token_id = bpe.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{token!r} is not in the tiny tokenizer's vocabulary")
    return token_id


# Idefics3's (SmolVLM's) image tokens: the processor writes each image as
# <fake_token_around_image><global-img> + <image> x image_seq_len + <fake_token_around_image>.
IMAGE_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>"]
# The tiny VLM sees every image at 112x112 pixels: 8x8 patches of 14, merged 2x2 by the connector
# into 16 image tokens, so an episode of a few screenshots stays a few hundred tokens.
TINY_VLM_IMAGE_SIZE = 112


def build_tiny_random_vlm(out: Path, head_dim: int = 16) -> None:
    """Write a random Idefics3 (SmolVLM's architecture: a 2-layer Llama of hidden 64 after a 2-layer
    SigLIP-style vision tower of width 32) with its processor (Idefics3's image processor, a byte-level
    tokenizer with its image tokens, and a ChatML template that renders image parts as <image>) into
    `out`, as one `from_pretrained` folder.

    head_dim: as for build_tiny_random (64 gives the Llama hidden 128 and 2 heads, which vLLM's CPU
    attention takes: the vLLM tests build that one).

    (build_tiny_random_qwen2_vl builds the other family rlcli drives.)
    """
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tiny_tokenizer([IM_START, IM_END, *IMAGE_TOKENS], VLM_CHAT_TEMPLATE, _VLM_CORPUS)
    bpe = tokenizer.backend_tokenizer
    end = _token_id(bpe, IM_END)
    hidden = max(64, 2 * head_dim)
    heads = hidden // head_dim
    text = {
        "model_type": "llama",
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": end,
        "pad_token_id": end,
        "bos_token_id": None,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": TINY_VLM_IMAGE_SIZE,
        "patch_size": 14,
    }
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=_token_id(bpe, "<image>"),
        tie_word_embeddings=True,
        pad_token_id=end,
    )
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = end
    side = {"longest_edge": TINY_VLM_IMAGE_SIZE}
    image_processor = Idefics3ImageProcessorPil(size=side, max_image_size=side, do_image_splitting=False)
    image_seq_len = (TINY_VLM_IMAGE_SIZE // 14) ** 2 // 2**2
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=VLM_CHAT_TEMPLATE,
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)


# Qwen2-VL's image tokens: the processor expands <|image_pad|> into one per merged 2x2 patch group,
# between <|vision_start|> and <|vision_end|>; <|video_pad|> is there because its processor asks for it.
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tiny_random_qwen2_vl(out: Path) -> None:
    """Write a random Qwen2-VL (a 2-layer Qwen2 of hidden 64 with 3-D rotary positions, after a 2-layer
    vision tower of width 32) with its processor (Qwen2-VL's image processor, a byte-level tokenizer
    with its vision tokens, and a ChatML template that renders image parts as
    <|vision_start|><|image_pad|><|vision_end|>) into `out`, as one `from_pretrained` folder.

    Images are resized to at most TINY_VLM_IMAGE_SIZE**2 pixels (sides multiples of 28): a 112x112
    screenshot is an 8x8 grid of 14-pixel patches, merged 2x2 into 16 image tokens; a 112x84 one 12.
    """
    _build_tiny_qwen_vl(out, "qwen2_vl")


def build_tiny_random_qwen2_5_vl(out: Path) -> None:
    """build_tiny_random_qwen2_vl for Qwen2.5-VL: the same language model and processor, its vision
    tower (SwiGLU blocks, windowed attention in the first block, full in the second)."""
    _build_tiny_qwen_vl(out, "qwen2_5_vl")


def _build_tiny_qwen_vl(out: Path, model_type: str) -> None:
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlcli.models.vision import image_only_processor_class

    template = vlm_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer = _tiny_tokenizer([IM_START, IM_END, *QWEN2_VL_TOKENS], template, _VLM_CORPUS)
    bpe = tokenizer.backend_tokenizer
    end = _token_id(bpe, IM_END)
    text = {
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        # head_dim 16: its 8 rotary frequencies split 2/3/3 over time, height and width (M-RoPE).
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "eos_token_id": end,
        "pad_token_id": end,
        "bos_token_id": None,
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config_class: type[Qwen2VLConfig] | type[Qwen2_5_VLConfig]
    model_class: type[Qwen2VLForConditionalGeneration] | type[Qwen2_5_VLForConditionalGeneration]
    if model_type == "qwen2_vl":
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        # hidden_size: the merger's output, the language model's width.
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        # window_size 56 pixels: 2x2 merged patches per attention window, several windows per screen.
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56)
        vision.update(fullatt_block_indexes=[1])
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=_token_id(bpe, "<|image_pad|>"),
        video_token_id=_token_id(bpe, "<|video_pad|>"),
        vision_start_token_id=_token_id(bpe, "<|vision_start|>"),
        vision_end_token_id=_token_id(bpe, "<|vision_end|>"),
        tie_word_embeddings=True,
        # transformers 4.x keeps it on the top-level config; 5.x takes it from text_config only.
        pad_token_id=end,  # type: ignore[call-arg]
    )
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = model_class(config)
    model.generation_config.eos_token_id = end
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=TINY_VLM_IMAGE_SIZE**2)
    processor = image_only_processor_class(model_type)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=template
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)


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


def vlm_chat_template(image_placeholder: str) -> str:
    """CHATML_TOOLS_TEMPLATE (without tools) where a message's content may be a list of parts: text
    parts are written out, image parts become `image_placeholder`, which the processor expands into
    the image's tokens."""
    return _VLM_CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", image_placeholder)


_VLM_CHAT_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for part in message.content %}
            {%- if part.type == 'image' %}
                {{- 'IMAGE_PLACEHOLDER' }}
            {%- elif part.type == 'text' %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
VLM_CHAT_TEMPLATE = vlm_chat_template("<image>")

_VLM_CORPUS = """\
Click the Save button. click(56, 30) click(12, 88) Save Open Cancel Export File Edit Help OK
Screenshot of the screen. Where do you click? Clicked inside Save. Missed: that is Open.
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
