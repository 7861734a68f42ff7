"""Seeds derived from their parts: the one source of randomness every stage replays from.

It imports nothing from rlcli, so any module may use it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (run seed, stage, indices): same parts, same seed."""
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
