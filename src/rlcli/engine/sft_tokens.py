"""SFT's tokenisation: each conversation rendered with the model's chat template into token ids and an
assistant-only loss mask (text models), or through the processor with its images (vision-language
models); rows longer than model.max_length are cut and counted; a seeded eval split."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, cast

from rlcli.engine.sft_data import Conversation
from rlcli.errors import UsageError
from rlcli.models import vision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from rlcli.store.db import RunDB


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, end_ids: set[int]
) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask that is 1 only on trained assistant replies.

    The conversation is rendered incrementally through the chat template: the messages before each
    trained reply with the generation prompt (context), then the messages through that reply (the
    reply). Each new piece of text is tokenised on its own and appended, which is how the rollout
    engine builds prompts, so SFT sees the token boundaries the policy sees when it acts. A reply
    is trained through its end-of-turn token (learning to stop); what the template adds after it
    (ChatML's newline) is context, as it is at rollout time.
    """
    messages = conversation.messages
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < conversation.first_trained:
            continue
        prompt = _render(tokenizer, messages[:index], conversation.tools, add_generation_prompt=True)
        turn = _render(tokenizer, messages[: index + 1], conversation.tools, add_generation_prompt=False)
        if not prompt.startswith(rendered) or not turn.startswith(prompt):
            raise UsageError(
                f"{conversation.origin}: the chat template renders earlier turns differently once later ones "
                "follow, so the assistant's tokens cannot be told apart; set model.chat_template to a template "
                "that renders each turn the same way whatever comes after it."
            )
        context = _encode(tokenizer, prompt[len(rendered) :])
        reply = _encode(tokenizer, turn[len(prompt) :])
        trained = next((i + 1 for i, tok in enumerate(reply) if tok in end_ids), len(reply))
        ids += context + reply
        mask += [0] * len(context) + [1] * trained + [0] * (len(reply) - trained)
        rendered = turn
    return ids, mask


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool
) -> str:
    text = tokenizer.apply_chat_template(
        messages,
        # transformers types tools as an (invariant) list of dicts or callables: a list of dicts is one.
        tools=tools,  # type: ignore[arg-type]
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    return cast(str, text)  # tokenize=False: the text


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The rendered text already holds every special token the template wants (as the rollout sees it).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversations(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], max_length: int, end_ids: set[int]
) -> tuple[list[dict[str, list[int]]], int]:
    """Pre-tokenised rows (`input_ids`, `assistant_masks`) cut at max_length, and how many were cut.

    A conversation whose first trained token lies beyond max_length has nothing left to learn
    from and is dropped; if that leaves nothing, the error says so.
    """
    rows, truncated = [], 0
    for conversation in conversations:
        ids, mask = tokenize_conversation(tokenizer, conversation, end_ids)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if 1 in mask:
            rows.append({"input_ids": ids, "assistant_masks": mask})
    if not rows:
        raise UsageError(
            f"Every SFT conversation's first assistant reply starts after model.max_length={max_length} tokens; "
            "raise model.max_length."
        )
    return rows, truncated


def with_images(rundb: RunDB, conversations: list[Conversation]) -> tuple[list[Conversation], dict[str, Any]]:
    """The conversations with every image part holding its PIL image and sha256, and sha256 -> image.

    Episodes (expert demos, a run's good episodes) name their screenshots by hash: those come back
    from the run database. A data file's image parts hold the image itself (a path or bytes).
    """
    from rlcli.store.images import load_images

    wanted = [
        part["sha256"]
        for conversation in conversations
        for part in _image_parts(conversation.messages)
        if "image" not in part and "sha256" in part
    ]
    stored = {sha: vision.image_from_png(data) for sha, data in load_images(rundb, wanted).items()}
    out = []
    for conversation in conversations:
        messages = []
        for message in conversation.messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "image" and "image" not in part:
                        if part.get("sha256") not in stored:
                            raise UsageError(
                                f"{conversation.origin}: an image of the conversation is not in the run database "
                                "(played by a text model, or by the expert before rlcli stored its screenshots); "
                                "play the episodes again in another --run."
                            )
                        part = {**part, "image": stored[part["sha256"]]}
                    parts.append(part)
                message = {**message, "content": parts}
            messages.append(message)
        try:
            messages = vision.name_images(messages, {})
        except (ValueError, OSError) as exc:
            raise UsageError(f"{conversation.origin}: an image cannot be read ({exc}).") from None
        out.append(Conversation(messages, conversation.origin, conversation.tools, conversation.first_trained))
    pictures = {ref.sha256: ref.image for c in out for ref in vision.message_images(c.messages)}
    return out, pictures


def _image_parts(messages: list[dict]) -> list[dict]:
    return [
        part
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def tokenize_image_conversation(
    processor: ProcessorMixin, conversation: Conversation, end_ids: set[int], keep_images: int | None
) -> list[dict[str, Any]]:
    """tokenize_conversation for a vision-language model: rows of `input_ids`, `assistant_masks`,
    `image_hashes` (the images in the ids, in order) and `image_spans` (the start and end of the
    context piece that holds each image's tokens, for cutting a row without splitting them).

    The pieces are tokenised the way the rollout builds a prompt (engine/rollout.py), the processor
    expanding each image placeholder into the image's tokens, and each reply sees the images that
    env.keep_images leaves it. When that rewrites the past (an older screenshot dropped), the replies
    so far are one row and the next starts afresh, as the rollout then trains turns one by one.
    """
    messages = conversation.messages
    rows: list[dict[str, Any]] = []
    ids: list[int] = []
    mask: list[int] = []
    images: list[vision.ImageRef] = []
    spans: list[tuple[int, int]] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < conversation.first_trained:
            continue
        view = vision.keep_last_images(messages[: index + 1], keep_images)
        prompt = vision.render(processor, view[:-1])
        turn = processor.apply_chat_template(view, add_generation_prompt=False, tokenize=False)
        shown = vision.message_images(view[:-1])
        if ids and (
            not prompt.startswith(rendered) or [r.sha256 for r in shown[: len(images)]] != [r.sha256 for r in images]
        ):
            rows.append(_image_row(ids, mask, images, spans))
            ids, mask, images, spans, rendered = [], [], [], [], ""
        if not turn.startswith(prompt):
            raise UsageError(
                f"{conversation.origin}: the chat template renders a reply's context differently once the reply "
                "follows, so the assistant's tokens cannot be told apart; set model.chat_template to a template "
                "that renders each turn the same way whatever comes after it."
            )
        fresh = shown[len(images) :]
        context = vision.tokenize(processor, prompt[len(rendered) :], fresh)
        reply = _encode(processor.tokenizer, turn[len(prompt) :])
        trained = next((i + 1 for i, tok in enumerate(reply) if tok in end_ids), len(reply))
        spans += [(len(ids), len(ids) + len(context))] * len(fresh)
        ids += context + reply
        mask += [0] * len(context) + [1] * trained + [0] * (len(reply) - trained)
        images += fresh
        rendered = turn
    if ids:
        rows.append(_image_row(ids, mask, images, spans))
    return rows


def _image_row(ids: list[int], mask: list[int], images: list[vision.ImageRef], spans: list[tuple[int, int]]) -> dict:
    return {"input_ids": ids, "assistant_masks": mask, "image_hashes": [r.sha256 for r in images], "image_spans": spans}


def encode_image_conversations(
    processor: ProcessorMixin,
    conversations: list[Conversation],
    max_length: int,
    end_ids: set[int],
    keep_images: int | None,
) -> tuple[list[dict[str, Any]], int]:
    """encode_conversations for a vision-language model (rows of tokenize_image_conversation).

    A row longer than max_length is cut there, or before the context piece of an image whose tokens
    the cut would split (a forward needs each image's tokens whole); the images past the cut go.
    """
    rows, truncated = [], 0
    for conversation in conversations:
        for row in tokenize_image_conversation(processor, conversation, end_ids, keep_images):
            ids, mask, hashes = row["input_ids"], row["assistant_masks"], row["image_hashes"]
            if len(ids) > max_length:
                truncated += 1
                cut = min([max_length] + [start for start, end in row["image_spans"] if end > max_length])
                kept = sum(1 for _, end in row["image_spans"] if end <= cut)
                ids, mask, hashes = ids[:cut], mask[:cut], hashes[:kept]
            if 1 in mask:
                rows.append({"input_ids": ids, "assistant_masks": mask, "image_hashes": hashes})
    if not rows:
        raise UsageError(
            f"Every SFT conversation's first assistant reply starts after model.max_length={max_length} tokens; "
            "raise model.max_length."
        )
    return rows, truncated


def split_examples(rows: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded held-out share for eval loss: at least one example when asked for, never all of them."""
    if eval_fraction == 0 or len(rows) < 2:
        return rows, []
    from rlcli.generation.seeds import derive_seed

    order = list(range(len(rows)))
    random.Random(derive_seed(seed, "sft/split")).shuffle(order)
    n_eval = min(max(1, round(len(rows) * eval_fraction)), len(rows) - 1)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
