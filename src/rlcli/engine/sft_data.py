"""SFT data: rows of JSONL, JSON, parquet, a `datasets` folder or a hub dataset, checked and made conversations.

Every malformed row ends with one sentence naming the file, the row and what was expected, before
any model loads. Hub datasets (`sft.source: hub:ORG/NAME`) are loaded in engine/sft_sources.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.errors import UsageError

ROLES = ("system", "user", "assistant", "tool")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
ROW_KEYS = ("messages", "prompt", "completion", "tools", "images")  # what a row may hold (sft.columns maps onto them)


@dataclass
class Conversation:
    """One SFT example: a chat transcript and which of its assistant replies are trained on."""

    messages: list[dict[str, Any]]
    origin: str  # where it came from, for error messages: "data.jsonl row 3", "episode 17"
    tools: list[dict[str, Any]] | None = None
    first_trained: int = 0  # assistant replies before this message index are context (a prompt's few-shot turns)


def map_columns(row: Any, columns: dict[str, str]) -> Any:
    """A row with its keys renamed by sft.columns ({dataset column: rlcli column}); a key that a
    mapped column replaces is dropped."""
    if not columns or not isinstance(row, dict):
        return row
    replaced = set(columns.values())
    kept = {k: v for k, v in row.items() if k not in columns and k not in replaced}
    return {**kept, **{new: row[old] for old, new in columns.items() if old in row}}


def read_conversations(path: Path, columns: dict[str, str] | None = None, split: str = "train") -> list[Conversation]:
    """Rows of a JSONL / JSON / parquet file or a `datasets` folder, checked and made conversations.

    A row holds `messages` (a chat), or `prompt` and `completion` (two strings, or two lists of
    messages), and optionally `tools`; `columns` renames its keys first (sft.columns). A message's
    content may be a list of text and image parts for a vision-language model; an image given as
    a relative path is found beside the file. Row numbers in errors are line numbers for JSONL and
    1-based positions otherwise. A folder holding a DatasetDict gives its `split`.
    """
    conversations = [
        conversation_from_row(map_columns(row, columns or {}), f"{path}: row {number}")
        for number, row in read_rows(path, split)
    ]
    folder = path if path.is_dir() else path.parent
    for conversation in conversations:
        for message in conversation.messages:
            for part in message["content"] if isinstance(message.get("content"), list) else []:
                if part["type"] == "image" and isinstance(part["image"], str):
                    part["image"] = str(folder / Path(part["image"]).expanduser())
    return conversations


def data_sha256(path: Path) -> str | None:
    """The SHA-256 of a data file's bytes, or of a folder's files (their paths and bytes, in order);
    None when there is no such file or folder (reading it says why)."""
    import hashlib

    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        return None
    digest = hashlib.sha256()
    for file in files:
        if file != path:  # a folder's file: its name and size first, so that no two folders read alike
            digest.update(f"{file.relative_to(path).as_posix()}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def check_data_path(path: Path, field: str = "sft.source") -> None:
    """Refuse a data source (the recipe's `field`) that names no data rlcli can read: neither a folder
    nor a file of a known suffix. Preflight runs it, so that the mistake costs no model load and leaves
    no failed stage."""
    if path.is_dir():
        return
    if not path.is_file():
        # `sft.source=null` on a command line is the text "null" (the field is text): meant as no SFT.
        if field != "sft.source":
            raise UsageError(f"{field}: {path} is neither an existing data file or folder nor hub:ORG/NAME.")
        hint = "; for no SFT, write sft.source=none" if str(path) in ("null", "~") else ""
        raise UsageError(
            f"sft.source: {path} is not none, expert, episodes, or an existing data file or folder "
            f"(nor hub:ORG/NAME, a hub dataset){hint}."
        )
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise UsageError(
            f"{field}: {path} has an unknown suffix; expected {', '.join(FILE_SUFFIXES)}, "
            "or a folder written by datasets' save_to_disk."
        )


def read_rows(
    path: Path, split: str = "train", field: str = "sft.source", split_field: str = "sft.dataset_split"
) -> list[tuple[int, Any]]:
    """A data file's or folder's rows with their numbers; `field` and `split_field` are the recipe fields
    that name the data and a folder's split, for the refusals' sentences."""
    check_data_path(path, field)
    if path.is_dir():
        return list(enumerate(_dataset_rows(path, split, field, split_field), 1))
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path, _read_text(path))
    if suffix == ".json":
        text = _read_text(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            # datasets' to_json writes one object per line, even into a .json file.
            return _jsonl_rows(path, text)
        return list(enumerate(data if isinstance(data, list) else [data], 1))
    import pyarrow  # .parquet, the last of FILE_SUFFIXES
    import pyarrow.parquet

    try:
        return list(enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1))
    except pyarrow.ArrowException as exc:
        raise UsageError(f"{path}: not a readable parquet file ({exc}).") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text; expected JSON (byte {exc.start} cannot be decoded).") from None


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: row {number}: expected one JSON object per line ({exc.msg}).") from None
    return rows


def _dataset_rows(path: Path, split: str, field: str, split_field: str) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError:
        raise UsageError(f"{field}: {path} is not a folder written by datasets' save_to_disk.") from None
    if isinstance(data, DatasetDict):
        if split not in data:
            raise UsageError(
                f"{field}: {path} is a DatasetDict without a {split} split (it has {', '.join(data)}); "
                f"set {split_field}."
            )
        data = data[split]
    return list(data)


def conversation_from_row(row: Any, where: str) -> Conversation:
    if not isinstance(row, dict):
        raise UsageError(
            f"{where}: expected an object with `messages`, or `prompt` and `completion`; got {_kind(row)}."
        )
    if row.get("messages") is not None:
        messages, first_trained = _check_messages(_fill_images(row, row["messages"]), where, "messages"), 0
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            # rlcli trains chat policies: a plain pair is one user turn and the reply to it.
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            first_trained = 1
        elif isinstance(prompt, list) and isinstance(completion, list):
            prompt_messages = _check_messages(_fill_images(row, prompt), where, "prompt")
            messages = prompt_messages + _check_messages(completion, where, "completion")
            first_trained = len(prompt_messages)
        else:
            raise UsageError(
                f"{where}: expected `prompt` and `completion` to be both strings or both lists of messages; "
                f"got {_kind(prompt)} and {_kind(completion)}."
            )
    else:
        raise UsageError(
            f"{where}: expected `messages`, or `prompt` and `completion`; found {', '.join(sorted(row)) or 'no keys'}."
        )
    if messages[0]["role"] == "assistant":
        raise UsageError(
            f"{where}: expected the conversation to open with a system or user message, not an assistant reply."
        )
    if not any(m["role"] == "assistant" for m in messages[first_trained:]):
        part = "the completion" if first_trained else "the messages"
        raise UsageError(f"{where}: expected an assistant message in {part} to train on.")
    return Conversation(messages, where, _check_tools(row.get("tools"), where), first_trained)


def _check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: expected `{field}` to be a non-empty list of messages; got {_kind(messages)}.")
    checked = []
    for number, message in enumerate(messages, 1):
        at = f"{where}: {field} message {number}"
        if not isinstance(message, dict):
            raise UsageError(f"{at}: expected an object with role and content; got {_kind(message)}.")
        # parquet and datasets fill keys that other rows have with None: they mean absent.
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in ROLES:
            raise UsageError(
                f"{at}: expected role {', '.join(ROLES[:-1])} or {ROLES[-1]}; got {message.get('role')!r}."
            )
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [_check_part(part, at) for part in content]
        elif not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise UsageError(f"{at}: expected `content` to be a string or a list of parts; got {_kind(content)}.")
        checked.append(message)
    return checked


def _check_part(part: Any, at: str) -> dict[str, Any]:
    """A content part as transformers' and TRL's chat convention writes it: text, or an image given
    as a path, encoded bytes or a PIL image (read when a vision-language model trains on it)."""
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        got = part.get("type") if isinstance(part, dict) else _kind(part)
        raise UsageError(f"{at}: expected parts of type text or image; got {got!r}.")
    part = {k: v for k, v in part.items() if v is not None}
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise UsageError(f"{at}: expected a text part's `text` to be a string; got {_kind(part.get('text'))}.")
    if part["type"] == "image":
        from PIL import Image

        image = part.get("image")
        if isinstance(image, dict):  # datasets' Image feature, as parquet and save_to_disk store it
            image = image.get("bytes") or image.get("path")
        if not isinstance(image, (str, bytes, Image.Image)):
            raise UsageError(
                f"{at}: expected an image part to hold `image` (a path, bytes or a PIL image), or the row an "
                f"`images` list with one image per image part; got {_kind(image)}."
            )
        part["image"] = image
    return part


def _fill_images(row: dict, messages: Any) -> Any:
    """TRL's layout: image parts without an image, and the row's `images` list filling them in order."""
    images = row.get("images")
    if not isinstance(images, list) or not isinstance(messages, list):
        return messages
    images = iter(images)
    filled = []
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = [
                {**part, "image": next(images, None)}
                if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None
                else part
                for part in message["content"]
            ]
            message = {**message, "content": parts}
        filled.append(message)
    return filled


def _check_tools(tools: Any, where: str) -> list[dict] | None:
    if isinstance(tools, str):  # TRL's convention: tools as a JSON string, which parquet stores easily
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: `tools` is a string but not JSON ({exc.msg}).") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UsageError(f"{where}: expected `tools` to be a list of tool schemas; got {_kind(tools)}.")
    return tools or None


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    if isinstance(value, list) and not value:
        return "an empty list"
    return names.get(type(value), f"a {type(value).__name__}")
