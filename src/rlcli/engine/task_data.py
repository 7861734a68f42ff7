"""An agent program's tasks from a dataset (env.task_data): a data file, a `datasets` folder or a hub dataset,
one row per task, for training and held-out tasks apart.

The task an agent is given is env.kwargs, then the row's keys, then the seed. A training seed s plays
train row s modulo the rows; held-out seed env.eval_seed_start + i plays eval row i modulo the rows. So
seeds keep their meaning (`--seed`, grpo.sampling's pools, resumes), and held-out rows never train.
Rows must be JSON objects (the task reaches the agent as JSON); a malformed one is refused in one
sentence, by preflight, before any stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.engine.sft_data import data_sha256, read_rows
from rlcli.engine.sft_sources import HUB_PREFIX, HubSplit, load_hub_split
from rlcli.errors import UsageError
from rlcli.recipe import EnvSection, TaskDataSection


@dataclass(frozen=True)
class TaskRows:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_seed_start: int

    def row(self, seed: int) -> dict[str, Any]:
        """The row that task `seed` plays."""
        if seed >= self.eval_seed_start:
            return self.eval[(seed - self.eval_seed_start) % len(self.eval)]
        return self.train[seed % len(self.train)]


def task_rows(env: EnvSection) -> TaskRows | None:
    """env.task_data's rows, checked; None when the recipe sets none."""
    data = env.task_data
    if data is None:
        return None
    train = _rows(data, data.train, data.train_split, "train")
    if data.eval is None and not _has_splits(data.train):
        raise UsageError(
            f"env.task_data.train {data.train} is a file, which has no held-out split; expected env.task_data.eval, "
            "a file (or dataset) of held-out tasks."
        )
    held_out = _rows(data, data.eval or data.train, data.eval_split, "eval")
    return TaskRows(train, held_out, env.eval_seed_start)


def task_for(kwargs: dict[str, Any], rows: TaskRows | None, seed: int) -> dict[str, Any]:
    """What the agent of task `seed` is given: env.kwargs, the task's row, and the seed."""
    return {**kwargs, **(rows.row(seed) if rows is not None else {}), "seed": seed}


def task_data_hashes(env: EnvSection) -> dict[str, str]:
    """SHA-256 of env.task_data's files and folders, by the names the recipe gives them, to be watched
    as env and reward files are: a resumed run whose tasks changed plays other rows under the same seeds.
    Hub datasets are left out (the datasets cache holds one version of each), as are missing paths."""
    data = env.task_data
    if data is None:
        return {}
    return {
        source: digest
        for source in sorted({data.train, data.eval or data.train})
        if not source.startswith(HUB_PREFIX) and (digest := data_sha256(Path(source).expanduser())) is not None
    }


def _has_splits(source: str) -> bool:
    return source.startswith(HUB_PREFIX) or Path(source).expanduser().is_dir()


def _rows(data: TaskDataSection, source: str, split: str, which: str) -> list[dict[str, Any]]:
    field = f"env.task_data.{which}"
    split_field = f"env.task_data.{which}_split"
    if source.startswith(HUB_PREFIX):
        hub = HubSplit(source[len(HUB_PREFIX) :], data.config, split, field, "env.task_data.config", split_field)
        where, numbered = f"{source} ({split})", list(enumerate(load_hub_split(hub), 1))
    else:
        path = Path(source).expanduser()
        where, numbered = str(path), read_rows(path, split, field, split_field)
    if not numbered:
        raise UsageError(f"{field}: {where} has no rows; expected one task per row.")
    for number, row in numbered:
        if not isinstance(row, dict):
            raise UsageError(
                f"{field}: {where}: row {number} is {type(row).__name__}; expected an object of task fields."
            )
        try:
            json.dumps(row)
        except (TypeError, ValueError) as exc:
            raise UsageError(
                f"{field}: {where}: row {number} cannot be given to the agent as JSON ({exc}); expected text, numbers, "
                "lists and objects."
            ) from None
    return [row for _, row in numbered]
