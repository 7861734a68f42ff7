"""The binary columns of `turns`: token ids as little-endian int32, logprobs as float32.

Fixed-width arrays keep a turn of thousands of tokens a few kilobytes and decode in one call.
"""

from __future__ import annotations

import numpy as np


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist() if blob else []


def pack_floats(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(blob: bytes | None) -> list[float]:
    return np.frombuffer(blob, dtype="<f4").tolist() if blob else []


# Column -> (dtype name, decoder): how `runs export` turns each blob column into a plain list.
BLOB_COLUMNS = {
    "prompt_ids": ("int32", unpack_ids),
    "completion_ids": ("int32", unpack_ids),
    "logprobs": ("float32", unpack_floats),
}
