"""A run's tables as plain rows, for `rlcli runs export`: token blobs decoded into lists."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlcli.store.blobs import BLOB_COLUMNS
from rlcli.store.run_store import RunStore

SQL_DTYPES = {"INTEGER": "int64", "FLOAT": "float64", "REAL": "float64", "TEXT": "string"}
# Each table's rows for one run, in a stable order.
TABLE_QUERIES = {
    "episodes": "select * from episodes where run = ? order by id",
    "turns": "select t.* from turns t join episodes e on e.id = t.episode_id where e.run = ? "
    "order by t.episode_id, t.turn_index",
    "rewards": "select r.* from rewards r join episodes e on e.id = r.episode_id where e.run = ? order by r.id",
    "metrics": "select * from metrics where run = ? order by stage, step, key",
    "evals": "select * from evals where run = ? order by id",
    "run_events": "select * from run_events where run = ? order by id",
    "task_stats": "select * from task_stats where run = ? order by label_set, task_index",
    "replays": "select * from replays where run = ? order by id",
    "dpo_pairs": "select * from dpo_pairs where run = ? order by id",
}


# The columns that hold JSON text (docs/database.md), per exported table.
JSON_COLUMNS = {
    "episodes": frozenset({"task", "messages"}),
    "turns": frozenset({"observation", "info", "images"}),
    "evals": frozenset({"details"}),
    "run_events": frozenset({"details"}),
}


@dataclass
class TableDump:
    name: str
    dtypes: dict[str, str]  # column -> int64 | float64 | string, or a list column's element dtype
    list_columns: frozenset[str]  # the columns whose values are lists (token ids, logprobs)
    json_columns: frozenset[str]  # the columns whose values are JSON text (messages, task, info, details)
    rows: Iterator[dict[str, Any]]  # streamed: a long run's turns need not fit in memory


def run_tables(store: RunStore) -> Iterator[TableDump]:
    """One dump per table, as in the database (turns join episodes on episode_id); columns holding
    JSON text (messages, task, info, details) stay text."""
    for table, sql in TABLE_QUERIES.items():
        columns = store.rundb.db[table].columns
        dtypes = {
            c.name: BLOB_COLUMNS[c.name][0] if c.name in BLOB_COLUMNS else SQL_DTYPES[c.type.upper()] for c in columns
        }
        lists = frozenset(c.name for c in columns if c.name in BLOB_COLUMNS)
        json_text = JSON_COLUMNS.get(table, frozenset())
        yield TableDump(table, dtypes, lists, json_text, _decoded(store.rundb.db.query(sql, [store.run])))


def _decoded(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for row in rows:
        yield {k: BLOB_COLUMNS[k][1](v) if k in BLOB_COLUMNS else v for k, v in row.items()}
