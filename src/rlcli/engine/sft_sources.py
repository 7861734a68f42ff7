"""Where SFT's rows come from when sft.source names data: a data file or folder (engine/sft_data.py),
or a Hugging Face hub dataset (`sft.source: hub:ORG/NAME`), read with `datasets.load_dataset`.

A hub dataset is named as TRL's scripts name one: an id, a config (subset, `sft.dataset_config`), a
split (`sft.dataset_split`, default train), and a column mapping (`sft.columns`) onto the columns
rlcli reads (`messages`, or `prompt` and `completion`; `tools`, `images`). Its rows become
conversations exactly as a data file's do (sft_data.conversation_from_row).

Offline (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1), `datasets` reads a dataset that an earlier
online load prepared in its cache (`$HF_DATASETS_CACHE`, by default ~/.cache/huggingface/datasets,
as `<org>___<name>/<config>/<version>/<hash>/`); one that is not there is refused in one sentence
by check_hub_dataset, which preflight runs before a stage writes anything.

`datasets` is imported inside the functions: preflight imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.engine.sft_data import (
    ROW_KEYS,
    Conversation,
    conversation_from_row,
    data_sha256,
    map_columns,
    read_conversations,
)
from rlcli.errors import UsageError

if TYPE_CHECKING:
    from datasets import Dataset

    from rlcli.recipe import SftSection

HUB_PREFIX = "hub:"
# The recipe fields that choose the SFT data besides sft.source, per kind of source (source_kind).
SFT_DATA_FIELDS = {
    "expert": ("demos",),
    "episodes": ("from_run", "min_reward"),
    "hub": ("dataset_config", "dataset_split", "columns"),
    "file": ("columns",),
    "folder": ("dataset_split", "columns"),
}


@dataclass(frozen=True)
class HubSplit:
    """One split of a hub dataset, and the recipe fields that name it (for the refusals' sentences):
    SFT's rows (sft.source, sft.dataset_config, sft.dataset_split) or an agent's tasks (env.task_data)."""

    name: str  # ORG/NAME
    config: str | None
    split: str
    source_field: str
    config_field: str
    split_field: str


def sft_hub_split(cfg: SftSection) -> HubSplit:
    name = hub_id(cfg.source)
    assert name is not None  # only called for a hub source
    return HubSplit(
        name, cfg.dataset_config, cfg.dataset_split, "sft.source", "sft.dataset_config", "sft.dataset_split"
    )


def source_kind(source: str) -> str:
    """none, expert, episodes, hub (hub:ORG/NAME), folder (a `datasets` folder) or file."""
    if source in ("none", "expert", "episodes"):
        return source
    if source.startswith(HUB_PREFIX):
        return "hub"
    return "folder" if Path(source).expanduser().is_dir() else "file"


def hub_id(source: str) -> str | None:
    """The dataset id of an `sft.source: hub:ORG/NAME`, or None for any other source."""
    return source[len(HUB_PREFIX) :] if source.startswith(HUB_PREFIX) else None


def data_identity(cfg: SftSection) -> dict[str, Any]:
    """What SFT trains on, as the sft stage's identity: the source, the fields that choose its rows, and
    the data's content (a file's or folder's SHA-256, a hub dataset's fingerprint), so that a resume on
    other rows is refused."""
    kind = source_kind(cfg.source)
    data = {"source": cfg.source, **{f: getattr(cfg, f) for f in SFT_DATA_FIELDS.get(kind, ())}}
    if kind == "hub":
        data["data_fingerprint"] = hub_fingerprint(cfg)
    elif kind in ("file", "folder"):
        digest = data_sha256(Path(cfg.source).expanduser())
        if digest is not None:  # else reading it says why, unless the stage is done
            data["data_sha256"] = digest
    return data


def read_data_source(cfg: SftSection) -> list[Conversation]:
    """The conversations of a data file or folder, or of a hub dataset (sft.source hub:ORG/NAME)."""
    if source_kind(cfg.source) == "hub":
        return hub_conversations(cfg)
    return read_conversations(Path(cfg.source).expanduser(), cfg.columns, cfg.dataset_split)


# --- hub datasets -------------------------------------------------------------------------------------


def check_hub_dataset(hub: HubSplit) -> None:
    """Refuse in one sentence a hub dataset that cannot be loaded: not in the cache on an offline
    machine, unknown to the hub, no such config or split. Cheap: it resolves the dataset's builder
    (offline: a look in the cache; online: the hub's metadata of the repo) and reads no rows."""
    builder = _builder(hub)
    splits = builder.info.splits  # known for a cached dataset; a hub repo's may be known only once prepared
    if splits:
        for part in _split_names(hub.split):
            if part not in splits:
                raise UsageError(
                    f"{hub.split_field}: hub dataset {hub.name} has no split {part!r} (it has {', '.join(splits)})."
                )


def load_hub_split(hub: HubSplit) -> Dataset:
    """The split of the hub dataset, as `datasets.load_dataset` gives it (a cached one offline)."""
    import datasets

    builder = _builder(hub)  # the one-sentence refusals, also when the cache changed since preflight
    try:
        with _quiet():
            # The builder's resolved config: offline, a dataset cached with one config loads without naming it.
            return datasets.load_dataset(hub.name, builder.config.name, split=hub.split)
    except ValueError as exc:  # an unknown split or slice ("Unknown split "test". Should be one of ['train'].")
        raise UsageError(f"{hub.split_field}: hub dataset {hub.name}: {_first_line(exc)}.") from None


def load_hub_dataset(cfg: SftSection) -> Dataset:
    """The recipe's split of SFT's hub dataset, its sft.columns checked."""
    data = load_hub_split(sft_hub_split(cfg))
    missing = [column for column in cfg.columns if column not in data.column_names]
    if missing:
        raise UsageError(
            f"sft.columns: hub dataset {hub_id(cfg.source)} has no column {missing[0]!r} (its columns: "
            f"{', '.join(data.column_names)})."
        )
    return data


def hub_fingerprint(cfg: SftSection) -> str:
    """What identifies the rows SFT trains on: the fingerprint `datasets` gives the loaded split (a
    hash of the dataset, its config, the cached version's hash (the hub commit) and the split)."""
    return str(load_hub_dataset(cfg)._fingerprint)


def hub_conversations(cfg: SftSection) -> list[Conversation]:
    """The split's rows, columns mapped, checked and made conversations as a data file's rows are."""
    data = load_hub_dataset(cfg)
    # Only the columns rlcli reads are decoded (a dataset may carry images or long texts beside them).
    keep = [c for c in data.column_names if cfg.columns.get(c, c) in ROW_KEYS]
    if not keep:
        raise UsageError(
            f"sft.columns: hub dataset {hub_id(cfg.source)} has none of the columns SFT reads (its columns: "
            f"{', '.join(data.column_names)}); map one to messages, or two to prompt and completion, e.g. "
            "sft.columns: {conversations: messages}."
        )
    data = data.select_columns(keep)
    where = f"{cfg.source} ({cfg.dataset_split})"
    return [
        conversation_from_row(map_columns(row, cfg.columns), f"{where}: row {number}")
        for number, row in enumerate(data, 1)
    ]


def _builder(hub: HubSplit) -> Any:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    name = hub.name
    config = f" (config {hub.config})" if hub.config else ""
    try:
        with _quiet():
            return datasets.load_dataset_builder(name, hub.config)
    except DatasetNotFoundError:
        raise UsageError(
            f"{hub.source_field}: hub dataset {name} does not exist on the Hugging Face Hub or cannot be accessed "
            "(a gated or private one needs `hf auth login` or HF_TOKEN)."
        ) from None
    except ConnectionError:
        if datasets.config.HF_HUB_OFFLINE:
            raise UsageError(
                f"{hub.source_field}: hub dataset {name}{config} is not in the local datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}) and the machine is offline (HF_HUB_OFFLINE or "
                "HF_DATASETS_OFFLINE is set); load it once online, or give a data file."
            ) from None
        raise UsageError(
            f"{hub.source_field}: hub dataset {name}{config} is not in the local datasets cache and the Hugging Face Hub "
            "cannot be reached; try again online, or give a data file."
        ) from None
    except ValueError as exc:
        # An unknown config, or several cached and none named: datasets' message says which there are.
        lines = str(exc).strip().splitlines()
        cached = next((line.split(":", 1)[1] for line in lines if line.startswith("Available configs")), None)
        if cached is not None:  # offline: "Couldn't find cache for ORG/NAME for config 'x'"
            configs = ", ".join(c.strip(" '\"") for c in cached.strip(" []").split(","))
            raise UsageError(
                f"{hub.config_field}: hub dataset {name}{config} is not in the local datasets cache, which holds "
                f"its config {configs} only, and the machine is offline; set {hub.config_field} to one of them."
            ) from None
        raise UsageError(
            f"{hub.config_field}: hub dataset {name}: {_first_line(exc)}; set {hub.config_field}."
        ) from None
    except OSError as exc:  # FileNotFoundError among them: no data files where the id points
        raise UsageError(f"{hub.source_field}: hub dataset {name} cannot be loaded: {_first_line(exc)}.") from None


def _split_names(split: str) -> list[str]:
    """The split names in a datasets split expression: "train", "train[:100]", "train+validation"."""
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """datasets' warnings off for a moment: offline, every cached load logs "Using the latest cached
    version ..." and "Found the latest cached dataset configuration ...", which say nothing wrong."""
    from datasets.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
