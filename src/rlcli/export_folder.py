"""The folders and files an export writes: never one rlcli did not write, and replaced whole or not at all.

An export is written into a temporary folder beside its target and renamed into place, so a kill
leaves either the old folder or the new one (plus a hidden temporary folder), never a mix. A marker
file tells rlcli's exports from the user's folders: only those may be replaced, and only when asked.
A single file (an HTML page, a plot) is staged the same way, and replaced only with --overwrite.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlcli.errors import UsageError

MARKER = ".rlcli-export"


def check_export_target(target: Path, option: str, overwrite: bool) -> None:
    """Refuse, with one sentence, a target that an export may not replace."""
    if target.exists() and not target.is_dir():
        raise UsageError(f"Cannot export into {target}: it is a file; give {option} a folder.")
    resolved = target.resolve()
    if resolved == Path.cwd() or resolved in Path.cwd().parents:
        raise UsageError(
            f"Cannot export into {target}: it is the current folder or holds it; give {option} a new folder."
        )
    if not target.exists() or not any(target.iterdir()):
        return
    if not (target / MARKER).is_file():
        raise UsageError(
            f"Cannot export into {target}: it is not empty and was not written by rlcli; "
            f"give {option} an empty or new folder."
        )
    if not overwrite:
        raise UsageError(f"{target} holds an earlier export; pass --overwrite to replace it.")


@contextmanager
def export_folder(target: Path, option: str, overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary folder to write the export into; when the block ends without an
    error it replaces `target`, otherwise it is removed and `target` is left as it was."""
    check_export_target(target, option, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield staging
        check_export_target(target, option, overwrite)  # the target may have changed while we wrote
        (staging / MARKER).write_text("Written by rlcli; `--overwrite` may replace this folder.\n")
        if target.exists():
            # The old folder (empty, or an earlier export) moves aside first: renaming over a
            # non-empty folder is not allowed, and the target must never hold a mix of both.
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            target.rename(retired / target.name)
            staging.rename(target)
            shutil.rmtree(retired)
        else:
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_file_target(path: Path, option: str, overwrite: bool) -> None:
    """Refuse, with one sentence, a file path that is a folder or an existing file not to replace."""
    if path.is_dir():
        raise UsageError(f"Cannot write {path}: it is a folder; give {option} a file name.")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise UsageError(f"{path} already exists; pass --overwrite to replace it.")


def write_file(path: Path, data: bytes, option: str, overwrite: bool) -> None:
    """Write `data` to `path` through a temporary file renamed into place: a kill leaves the old file
    or the new one.

    The temporary file gets an unguessable name and is created new, never through a link
    (O_EXCL|O_NOFOLLOW): a file or symlink planted beside the target is never written through. It
    gets the permissions any file the user writes gets (mkstemp's would be private to the owner).
    """
    check_file_target(path, option, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
