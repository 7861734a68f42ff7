"""Errors that the CLI turns into one clear sentence and an exit code (no traceback without --debug)."""


class RlcliError(Exception):
    """A failure the user can act on; exit code 1."""

    exit_code = 1


class UsageError(RlcliError):
    """Bad input: a recipe, a file, a name, an argument; exit code 2."""

    exit_code = 2
