"""A run's recipe as it may leave the machine: its secrets replaced by a marker.

Every artifact that copies a recipe for others to read takes it from `shareable_recipe`: the hub cards
and `rlcli-recipe.yaml` (`runs push`, `runs export --to-hub`), `run.json` (`runs export`), `report.html`
(`runs report`) and the trackers' run config (TensorBoard, trackio, W&B, MLflow). The run database keeps
the recipe whole: resuming a run starts its MCP servers again with their keys, and whether a recipe
changed is judged on the real values. The database stays on the machine (no export copies its `runs`
table).

Replaced by REDACTED:
- every value under `env:` of an MCP server (env.mcp_servers[].env, where docs/tools.md tells users to
  put a server's keys); the variables' names stay, so a reader knows what to set;
- the value of any key that names a secret: a word of the key (split at `_`, `-`, `.`, spaces and
  camelCase) that is key, auth, authorization, credential(s), cookie or bearer, or one that ends in
  token, secret, password, passwd or apikey, as may the words run together: `api_key`, `HF_TOKEN`,
  `clientSecret`, `secret_sauce`, `x-api-key`, but not `max_new_tokens`;
- in every string, a URL's password (`https://user:<redacted>@host`), the value after a command-line
  flag that names a secret (`--api-key VALUE`, `--token=VALUE`), and tokens of well-known shapes
  (Hugging Face `hf_...`, OpenAI and Anthropic `sk-...`, GitHub `ghp_...`, Slack `xoxb-...`, AWS `AKIA...`).

A secret written anywhere else (in a free-text description, a file the recipe names) is not found:
keep keys in a server's `env:` or in rlcli's own environment.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

_SECRET_WORDS = frozenset({"key", "auth", "authorization", "credential", "credentials", "cookie", "bearer"})
_SECRET_ENDINGS = ("token", "secret", "password", "passwd", "apikey")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # HFToken -> HF, Token; api_key -> api, key
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^/\s@]+(?=@)")
_FLAG_WITH_VALUE = re.compile(r"^(?P<flag>--?[A-Za-z0-9_.-]+)=(?P<value>.*)$", flags=re.S)
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})\b"
)


def shareable_recipe(resolved: dict[str, Any]) -> dict[str, Any]:
    """A copy of a resolved recipe (Recipe.to_dict(), or a run's stored recipe) with its secrets replaced
    by REDACTED (see the module docstring)."""
    shared = _redacted(resolved)
    env = shared.get("env")
    for server in (env.get("mcp_servers") if isinstance(env, dict) else None) or []:
        if isinstance(server, dict) and isinstance(server.get("env"), dict):
            server["env"] = dict.fromkeys(server["env"], REDACTED)
    return shared


def shareable_text(text: str) -> str:
    """text with URL passwords and tokens of well-known shapes replaced by REDACTED."""
    return _TOKEN_SHAPES.sub(REDACTED, _URL_PASSWORD.sub(rf"\g<head>{REDACTED}", text))


def names_secret(key: str) -> bool:
    """Whether a key (a recipe field, a variable, a flag) names a secret: see the module docstring."""
    words = [word.lower() for word in _WORD.findall(key)]
    joined = "".join(words)  # x-api-key -> xapikey
    return joined.endswith(_SECRET_ENDINGS) or any(
        word in _SECRET_WORDS or word.endswith(_SECRET_ENDINGS) for word in words
    )


def _redacted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: REDACTED if names_secret(str(key)) else _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return _redacted_list(value)
    if isinstance(value, str):
        return _redacted_flag(value)
    return value


def _redacted_list(items: list[Any]) -> list[Any]:
    """The items redacted, and in an argv the value after a flag that names a secret (`--token VALUE`)."""
    out: list[Any] = []
    for item in items:
        previous = out[-1] if out else None
        if isinstance(item, str) and isinstance(previous, str) and _is_secret_flag(previous):
            out.append(REDACTED)
        else:
            out.append(_redacted(item))
    return out


def _is_secret_flag(text: str) -> bool:
    return text.startswith("-") and "=" not in text and names_secret(text)


def _redacted_flag(text: str) -> str:
    """A string redacted: `--token=VALUE` loses its value, and any string its URL passwords and tokens."""
    flag = _FLAG_WITH_VALUE.match(text)
    if flag and names_secret(flag["flag"]):
        return f"{flag['flag']}={REDACTED}"
    return shareable_text(text)
