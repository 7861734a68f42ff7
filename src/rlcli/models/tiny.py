"""tiny-random: a 2-layer random Llama with a byte-level ChatML tokenizer, built locally in about a second.

Tests and demos run on it where the numbers need not mean anything: it loads in a blink, every text
round-trips through its tokenizer, and its chat template renders tool calls like Qwen2.5's.
"""

from __future__ import annotations

from pathlib import Path

# Same seed, same weights: tests that compare numbers stay reproducible.
TINY_SEED = 0
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def build_tiny_random(out: Path, head_dim: int = 16) -> None:
    """Write the model and its tokenizer into `out` as a `from_pretrained` folder.

    head_dim: 16 gives tiny-random (hidden 64, 4 heads); vLLM's CPU attention refuses 16 (it
    takes 32, 64, 80, ...), so its tests build head_dim=64 (hidden 128, 2 heads), with the same tokenizer.
    """
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
