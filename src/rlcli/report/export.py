"""`rlcli runs export`: a run's tables as JSONL or parquet files, plus run.json."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlcli.export_folder import export_folder
from rlcli.redaction import shareable_recipe
from rlcli.report.views import run_details
from rlcli.store.dump import TableDump, run_tables
from rlcli.store.run_store import RunStore

CHUNK_ROWS = 1000


def export_run(
    store: RunStore,
    fmt: str,
    out: Path,
    overwrite: bool = False,
    extra: Callable[[dict[str, int]], dict[str, bytes]] | None = None,
) -> dict[str, int]:
    """Write a run's tables to `out` as <table>.jsonl or <table>.parquet, plus run.json (with the recipe's
    secrets redacted: rlcli.redaction); return row counts.

    One file per table, as in the database (turns join episodes on episode_id): token ids and
    logprobs become lists. Columns holding JSON text (messages, task, info, details) are nested JSON in
    JSONL, and stay text in parquet, where a column has one type and a message's content varies (text,
    or a list of text and image parts).
    `out` may be new, empty, or (with `overwrite`) an earlier export; any other folder is refused.

    Every table and run.json are read in one read transaction, so the export of a run that another
    process is writing to is one moment of it, never a table from before a write and one from after.
    `extra(counts)` gives more files (name -> bytes: a dataset card) to write beside them, in that moment too.
    """
    store.require_run()  # before the folder is made
    counts = {}
    with export_folder(out, "--out", overwrite) as staging, store.rundb.snapshot():
        run = store.require_run()
        for table in run_tables(store):
            path = staging / f"{table.name}.{fmt}"
            counts[table.name] = _write_jsonl(path, _nested(table)) if fmt == "jsonl" else _write_parquet(path, table)
        details = run_details(store)
        details["recipe"] = shareable_recipe(run.recipe)  # the database keeps the secrets; run.json is shared
        (staging / "run.json").write_text(json.dumps(details, indent=2))
        for file, data in (extra(counts) if extra else {}).items():
            (staging / file).write_bytes(data)
    return counts


def _nested(table: TableDump) -> Iterator[dict[str, Any]]:
    """The table's rows with its JSON text parsed, so that a JSONL line holds JSON, not JSON in a string."""
    for row in table.rows:
        yield {k: json.loads(v) if k in table.json_columns and v else v for k, v in row.items()}


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    count = 0
    with path.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            count += 1
    return count


def _write_parquet(path: Path, table: TableDump) -> int:
    import datasets

    datasets.disable_progress_bars()  # else to_parquet draws a bar on stderr for every table
    # Explicit features from the SQLite schema: a chunk whose column is all NULL must not turn
    # that column's type into null, and an empty table still gets its columns.
    features = datasets.Features(
        {
            name: datasets.Sequence(datasets.Value(dtype)) if name in table.list_columns else datasets.Value(dtype)
            for name, dtype in table.dtypes.items()
        }
    )
    # Chunks bound the Python objects alive at once; Arrow holds the rows compactly.
    parts = []
    iterator = iter(table.rows)
    while chunk := list(itertools.islice(iterator, CHUNK_ROWS)):
        parts.append(datasets.Dataset.from_dict({k: [r[k] for r in chunk] for k in features}, features=features))
    dataset = (
        datasets.concatenate_datasets(parts)
        if parts
        else datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    )
    dataset.to_parquet(str(path))
    return len(dataset)
