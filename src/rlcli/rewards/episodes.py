"""What reward functions read: an episode as a plain dict, and the text of its chat messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The dict view of a stored episode that every reward receives (its keys are listed in docs/rewards.md);
# built by the labelling stage, distinct from the store's Episode record.
EpisodeDict = dict[str, Any]
# A resolved reward: a batch of episodes in, one value per episode out (checked by RewardFn).
Scorer = Callable[[list[EpisodeDict]], Any]


def message_text(message: dict) -> str:
    """The text of a chat message; of multimodal content, the text parts."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def transcript(messages: list[dict]) -> str:
    """Messages as plain 'role: text' lines, for rubrics and for tokenizers without a chat template."""
    return "\n".join(f"{m.get('role')}: {message_text(m)}" for m in messages)
