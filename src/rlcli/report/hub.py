"""Pushing a run to the Hugging Face Hub: `rlcli export --push-to-hub` (the merged model) and
`rlcli runs export --push-to-hub` (the run's tables as a dataset).

Both stage a folder first, the one `rlcli export --merge` or `rlcli runs export --out` writes plus a
card (README.md with YAML front matter) and the recipe, then upload it whole with huggingface_hub's
HfApi (create_repo, upload_folder). `--dry-run` stops after staging: the folder is exactly what
would be uploaded, less the `.rlcli-export` marker. A push is refused in one sentence, before
anything is written, when the machine is offline (HF_HUB_OFFLINE) or there is no token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from rlcli.errors import RlcliError, UsageError
from rlcli.export_folder import MARKER
from rlcli.recipe import Recipe
from rlcli.redaction import REDACTED, shareable_recipe, shareable_text
from rlcli.report.tables import eval_cells
from rlcli.report.views import HELDOUT_KEY, REWARD_KEY, SUCCESS_KEY, eval_view, metric_series
from rlcli.store.evals import eval_results
from rlcli.store.records import Checkpoint
from rlcli.store.run_store import RunStore

CARD = "README.md"
CURVES = "curves.png"
RECIPE = "rlcli-recipe.yaml"
# The hub models that rlcli's registered short names are made from (models/cache.py's REGISTRY): the
# card's base_model. The tiny test models are built locally and have none.
BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# The curves a card tabulates, as `runs plot` draws them by default.
CURVE_KEYS = (
    REWARD_KEY,
    SUCCESS_KEY,
    HELDOUT_KEY,
    "train/loss",
    "train/kl",
    "train/teacher_kl",
    "train/entropy",
    "sft/loss",
    "sft/eval_loss",
    "dpo/loss",
)
LICENSE_PLACEHOLDER = "other"
LICENSE_NOTE = (
    "The recipe sets no `run.license`, so the card says `license: other`, a placeholder: set run.license "
    "(e.g. apache-2.0) and push again, or edit the card on the hub."
)


# --- refusals, before anything is written ---------------------------------------------------------


def check_repo_id(repo_id: str) -> None:
    """Refuse in one sentence a --push-to-hub that is not ORG/NAME or NAME."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UsageError(
            f"--push-to-hub {repo_id!r} is not a hub repo id; expected ORG/NAME (or NAME, under your user)."
        ) from None


def check_can_push() -> None:
    """Refuse in one sentence a push that cannot reach the hub: offline, or no token."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UsageError(
            "Cannot push to the Hugging Face Hub: HF_HUB_OFFLINE is set, so nothing may reach it; unset it, "
            "or add --dry-run to stage the folder only."
        )
    if get_token() is None:
        raise UsageError(
            "Cannot push to the Hugging Face Hub without a token: log in with `hf auth login` (or set HF_TOKEN), "
            "or add --dry-run to stage the folder only."
        )


# --- the upload ------------------------------------------------------------------------------------


def staged_files(folder: Path) -> list[str]:
    """The files of a staged folder that an upload sends, as paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def push_folder(folder: Path, repo_id: str, repo_type: str, private: bool, message: str) -> str:
    """Create the repo (or use the existing one) and upload the folder in one commit; return its URL.

    --private makes a new repo private; an existing public repo is refused rather than written to."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, repo_type=repo_type, private=True if private else None, exist_ok=True)
        if private and not api.repo_info(url.repo_id, repo_type=repo_type).private:
            raise UsageError(
                f"{url.repo_id} exists on the hub and is public, so --private cannot hold; make it private "
                "there, or push without --private."
            )
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=folder,
            repo_type=repo_type,
            ignore_patterns=[MARKER],
            commit_message=message,
        )
    except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RlcliError(f"Pushing {folder} to {repo_id} on the Hugging Face Hub failed: {detail}") from None
    return str(url)


# --- the model card --------------------------------------------------------------------------------


def base_model_id(name: str) -> str | None:
    """The hub id of a recipe's model.name, for the card's base_model: itself for a hub id, the source
    of a registered short name, None for a local folder or a model built locally."""
    from rlcli.models.cache import REGISTRY, models_dir

    if name in REGISTRY:
        return BASE_MODELS.get(name)
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return None
    return None if (models_dir() / name / "config.json").is_file() else name  # else a folder of rlcli's cache


def model_card_files(store: RunStore, repo_id: str, checkpoint: Checkpoint, folder: Path) -> dict[str, bytes]:
    """The card (README.md), the recipe and the curves' PNG for a merged model written in `folder`
    (whose config.json says whether it is a vision-language model)."""
    recipe = store.recipe()
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    vision = "vision_config" in config
    base = base_model_id(recipe.model.name)
    hub_data = recipe.sft.source.removeprefix("hub:") if recipe.sft.source.startswith("hub:") else None
    files = _run_files(store, recipe)
    front = _front_matter(
        "model",
        recipe,
        base_model=base,
        datasets=[hub_data] if hub_data else None,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if vision else "text-generation",
        tags=["rlcli", "reinforcement-learning", *_methods(store)],
    )
    auto = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    tokenizer = "AutoProcessor" if vision else "AutoTokenizer"
    stage = "the SFT checkpoint" if checkpoint.stage == "sft" else f"checkpoint #{checkpoint.id} ({checkpoint.stage})"
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        *([recipe.run.description, ""] if recipe.run.description else []),
        f"`{shareable_text(recipe.model.name)}`{f' ([{base}](https://huggingface.co/{base}))' if base else ''} "
        f"trained by rlcli run `{store.run}` on the `{shareable_text(recipe.env.name)}` environment: {stage}, "
        f"{'its LoRA adapter merged into the base model' if checkpoint.kind == 'lora' else 'every weight trained'}.",
        "",
        "## Use",
        "",
        "```python",
        f"from transformers import {auto}, {tokenizer}",
        "",
        f'model = {auto}.from_pretrained("{repo_id}")',
        f'{"processor" if vision else "tokenizer"} = {tokenizer}.from_pretrained("{repo_id}")',
        "```",
        "",
        *_evaluation(store),
        *_curves(store, CURVES in files),
        *_license(recipe),
        *_recipe_section(recipe),
    ]
    return {**files, CARD: _card(front, lines)}


# --- the dataset card ------------------------------------------------------------------------------


def dataset_card_files(store: RunStore, repo_id: str, fmt: str, counts: dict[str, int]) -> dict[str, bytes]:
    """The card (README.md, with one config per non-empty table, episodes the default) and the recipe,
    for a `runs export` folder of <table>.<fmt> files and run.json."""
    recipe = store.recipe()
    configs = [
        {
            "config_name": table,
            "data_files": [{"split": "train", "path": f"{table}.{fmt}"}],
            **({"default": True} if table == "episodes" else {}),
        }
        for table, rows in counts.items()
        if rows
    ]
    front = _front_matter(
        "dataset",
        recipe,
        pretty_name=f"rlcli run {store.run}",
        tags=["rlcli", "reinforcement-learning", "agent-trajectories"],
        configs=configs,
    )
    rows = [f"| `{table}.{fmt}` | {table if count else '(empty)'} | {count} |" for table, count in counts.items()]
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        *([recipe.run.description, ""] if recipe.run.description else []),
        f"The episodes of rlcli run `{store.run}`: `{shareable_text(recipe.model.name)}` acting in the "
        f"`{shareable_text(recipe.env.name)}` environment, with their turns (token ids and logprobs), reward "
        "components, metrics and evals. Each table is a config; `episodes` is the default:",
        "",
        "```python",
        "from datasets import load_dataset",
        "",
        f'episodes = load_dataset("{repo_id}", split="train")',
        f'turns = load_dataset("{repo_id}", "turns", split="train")  # joins episodes on episode_id',
        "```",
        "",
        "| file | config | rows |",
        "| --- | --- | ---: |",
        *rows,
        "",
        "`run.json` holds the run's details (stages, checkpoints, evals) and its recipe. Columns holding JSON "
        f"(messages, task, info, details) are {'nested JSON' if fmt == 'jsonl' else 'JSON text'}; rlcli's "
        "docs/database.md describes every column.",
        "",
        *_evaluation(store),
        *_license(recipe),
        *_recipe_section(recipe),
    ]
    return {RECIPE: _recipe_yaml(recipe), CARD: _card(front, lines)}


# --- the parts -------------------------------------------------------------------------------------


def _front_matter(kind: str, recipe: Recipe, **fields: Any) -> str:
    from huggingface_hub import DatasetCardData, ModelCardData

    license = recipe.run.license or LICENSE_PLACEHOLDER
    values = {k: v for k, v in fields.items() if v is not None}
    data = ModelCardData(license=license, **values) if kind == "model" else DatasetCardData(license=license, **values)
    text = data.to_yaml()
    if recipe.run.license is None:
        text = text.replace(
            f"license: {LICENSE_PLACEHOLDER}\n",
            f"license: {LICENSE_PLACEHOLDER}  # a placeholder: set run.license in the recipe, or the license here\n",
        )
    return text


def _card(front: str, lines: list[str]) -> bytes:
    return ("---\n" + front.rstrip("\n") + "\n---\n\n" + "\n".join(lines).rstrip("\n") + "\n").encode()


def _run_files(store: RunStore, recipe: Recipe) -> dict[str, bytes]:
    from rlcli.report import plot

    files = {RECIPE: _recipe_yaml(recipe)}
    try:
        figure, _, _ = plot.run_figure(store)
    except UsageError:  # nothing to plot yet: no metrics, no evals
        return files
    files[CURVES] = plot.figure_bytes(figure)
    return files


def _recipe_yaml(recipe: Recipe) -> bytes:
    """The recipe as it may be shared: its secrets (an MCP server's env values, API keys) redacted."""
    return yaml.safe_dump(shareable_recipe(recipe.to_dict()), sort_keys=False, allow_unicode=True).encode()


def _methods(store: RunStore) -> list[str]:
    """sft, grpo, dpo: the training stages the run finished, in that order, as hub tags."""
    done = [s.name for s in store.stages() if s.status == "done"]
    found = {
        "sft": any(n == "sft" for n in done),
        "grpo": any(n.startswith("train/") for n in done),
        "dpo": any(n == "dpo" or n.startswith("dpo/") for n in done),
    }
    return [tag for tag, present in found.items() if present]


def _evaluation(store: RunStore) -> list[str]:
    rows = [eval_view(r) for r in eval_results(store)]
    if not rows:
        return ["## Evaluation", "", "No held-out evaluation recorded (`rlcli eval` adds one).", ""]
    columns, cells = eval_cells(rows)
    return [
        "## Evaluation",
        "",
        "Held-out tasks, success with its 95% Wilson interval (as `rlcli runs show` prints it):",
        "",
        _row(columns),
        _row(["---" if c in ("checkpoint", "decoding") else "---:" for c in columns]),
        *(_row(cell) for cell in cells),
        "",
    ]


def _curves(store: RunStore, png: bool) -> list[str]:
    series = metric_series(store)
    present = [key for key in CURVE_KEYS if key in series]
    if not present and not png:
        return []
    lines = ["## Training curves", ""]
    if png:
        lines += [f"![Training curves of run {store.run}]({CURVES})", ""]
    if present:
        lines += [
            _row(["metric", "stage", "points", "first", "last", "min", "max"]),
            _row(["---", "---"] + ["---:"] * 5),
        ]
        for key in present:
            values = [v for v in series[key]["values"] if v is not None and math.isfinite(v)]
            numbers = [values[0], values[-1], min(values), max(values)] if values else []
            cells = [f"{v:.4g}" for v in numbers] or ["", "", "", ""]
            lines.append(_row([f"`{key}`", series[key]["stage"], str(len(series[key]["values"])), *cells]))
        lines.append("")
    return lines


def _license(recipe: Recipe) -> list[str]:
    if recipe.run.license:
        return []
    return ["## License", "", LICENSE_NOTE, ""]


def _recipe_section(recipe: Recipe) -> list[str]:
    return [
        "## Recipe",
        "",
        f"The run's recipe, also in `{RECIPE}` (`rlcli run -r {RECIPE}` runs it again, given the files it names; "
        f"values that look like secrets read `{REDACTED}`: put yours back):",
        "",
        "```yaml",
        _recipe_yaml(recipe).decode().rstrip("\n"),
        "```",
        "",
    ]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
