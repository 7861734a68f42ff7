"""Errors that the CLI turns into one clear sentence and an exit code (no traceback without --debug)."""

import reprlib


class RlcliError(Exception):
    """A failure the user can act on; exit code 1."""

    exit_code = 1


class UsageError(RlcliError):
    """Bad input: a recipe, a file, a name, an argument; exit code 2."""

    exit_code = 2


# A message may quote what the user gave (a recipe value, an override, a -k argument), which may run to
# megabytes: a message is cut to this many characters, a quoted value to QUOTE_LIMIT.
MESSAGE_LIMIT = 2_000
QUOTE_LIMIT = 200


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """text, cut in the middle past `limit` characters, so that both the start (what is wrong) and the
    end (what was expected) stay."""
    if len(text) <= limit:
        return text
    cut = f" ... ({len(text) - limit:,} characters left out) ... "
    head = (limit - len(cut)) * 2 // 3
    tail = limit - len(cut) - head
    return text[:head] + cut + text[len(text) - tail :]


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """repr(value) for a message, at most `limit` characters, computed without walking all of a large value."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    return shorten(short.repr(value), limit)
