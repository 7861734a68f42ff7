"""The images of vision-language episodes: PNG bytes stored once each, by the sha256 of those bytes."""

from __future__ import annotations

import struct

from sqlite_utils import Database

from rlcli.store.db import RunDB, now


def insert_images(db: Database, pngs: dict[str, bytes]) -> None:
    """Store PNGs by hash inside the caller's transaction; one already stored is left as it is."""
    if pngs:
        db.table("images").insert_all(
            ({"sha256": sha, "png": data, **_png_size(data), "created_at": now()} for sha, data in pngs.items()),
            ignore=True,
        )


def load_images(rundb: RunDB, hashes: list[str]) -> dict[str, bytes]:
    """sha256 -> PNG bytes for the stored ones among `hashes`."""
    wanted = sorted(set(hashes))
    out: dict[str, bytes] = {}
    for start in range(0, len(wanted), 500):  # SQLite caps the number of parameters of one query
        part = wanted[start : start + 500]
        marks = ", ".join("?" * len(part))
        rows = rundb.db.execute(f"select sha256, png from images where sha256 in ({marks})", part)
        out.update(dict(rows.fetchall()))
    return out


def image_sizes(rundb: RunDB, hashes: list[str]) -> dict[str, tuple[int, int]]:
    """sha256 -> (width, height) for the stored ones among `hashes`, without reading their PNGs."""
    wanted = sorted(set(hashes))
    out: dict[str, tuple[int, int]] = {}
    for start in range(0, len(wanted), 500):  # SQLite caps the number of parameters of one query
        part = wanted[start : start + 500]
        marks = ", ".join("?" * len(part))
        rows = rundb.db.execute(f"select sha256, width, height from images where sha256 in ({marks})", part)
        out.update({sha: (width, height) for sha, width, height in rows.fetchall()})
    return out


def image_count(rundb: RunDB) -> int:
    (count,) = rundb.db.execute("select count(*) from images").fetchone()
    return count


def _png_size(data: bytes) -> dict[str, int]:
    # A PNG's IHDR chunk holds its width and height right after the 8-byte signature and chunk header.
    width, height = struct.unpack(">II", data[16:24])
    return {"width": width, "height": height}
