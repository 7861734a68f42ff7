"""`rlcli envs ...`: list environments, and play or watch one episode in the terminal."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.panel import Panel

from rlcli.cli.common import JsonOpt, RecipeOpt, RunOpt, console, open_existing
from rlcli.errors import RlcliError, UsageError
from rlcli.report.text import literal

if TYPE_CHECKING:
    from rlcli.recipe import Recipe

app = typer.Typer(help="Environments: list them, try one in the terminal.", no_args_is_help=True)

ADAPTER_NOTE = (
    "Adapters (pip install 'rlcli[envs]'): textarena:<GameId> (single-player TextArena games, e.g. "
    "textarena:GuessTheNumber-v0), reasoning_gym:<dataset> (e.g. reasoning_gym:chain_sum), "
    "gymnasium:<EnvId> (text observations, Discrete or Text actions, e.g. gymnasium:FrozenLake-v1); "
    "openenv:<url-or-module> (an OpenEnv server; pip install 'rlcli[openenv]') and verifiers:<env-id> "
    "(an installed verifiers environment; pip install 'rlcli[verifiers]'); miniwob:<task> (a MiniWoB++ web "
    "task in headless Chromium, e.g. miniwob:click-button; pip install 'rlcli[web]', make browser). "
    "See docs/environments.md."
)
RANDOM_ACTIONS = ["My guess: 7", "42", "up", "left", "hello", "<answer>3</answer>", "I don't know", "right", "down"]


@app.command("list")
def list_envs(as_json: JsonOpt = False) -> None:
    """List the built-in environments (and the adapter URIs)."""
    from rlcli.envs.loading import list_builtin_envs

    envs = list_builtin_envs()
    if as_json:
        print(json.dumps([{"name": n, "description": d} for n, d in envs], indent=2))
        return
    from rich.table import Table

    table = Table(title="Built-in environments")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, doc in envs:
        table.add_row(name, doc.split(": ", 1)[-1])
    console.print(table)
    console.print(ADAPTER_NOTE, markup=False)


@app.command("try")
def try_env(
    cli_ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Built-in name, envs/x.py, module:factory, or adapter URI.")],
    policy: Annotated[
        str,
        typer.Option(
            help="expert (the env's scripted solver), random, human (stdin), or model (the recipe's model, "
            "sampling as rollouts do: rollout.engine, temperature and token cap)."
        ),
    ] = "expert",
    seed: Annotated[int, typer.Option(help="Task seed.")] = 0,
    kwargs: Annotated[
        list[str] | None, typer.Option("--kwargs", "-k", help="Env keyword argument key=value; repeatable.")
    ] = None,
    max_turns: Annotated[int, typer.Option(help="Stop after this many turns.")] = 20,
    recipe: RecipeOpt = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="--policy model: a hub id, local folder or short name instead of the recipe's model.name.",
            show_default=False,
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            "-c",
            help="--policy model: a checkpoint folder, or base, sft, latest, best or a checkpoint id of --run "
            "(whose recipe is then used unless --recipe is given). Default: base.",
            show_default=False,
        ),
    ] = None,
    run: RunOpt = None,
) -> None:
    """Play or watch one episode, rendered turn by turn."""
    import yaml

    if policy not in ("expert", "random", "human", "model"):
        raise UsageError(f"--policy must be expert, random, human or model, got {policy!r}.")
    if policy != "model" and (recipe or model or checkpoint or run):
        raise UsageError("--recipe, --model, --checkpoint and --run choose the model of --policy model.")
    env_kwargs = {}
    for item in kwargs or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--kwargs {item!r} is not of the form key=value.")
        env_kwargs[key] = yaml.safe_load(value)
    if policy == "model":
        _play_model(cli_ctx, name, env_kwargs, seed, max_turns, recipe, model, checkpoint, run)
        return
    _play_scripted(name, env_kwargs, policy, seed, max_turns)


def _play_scripted(name: str, env_kwargs: dict, policy: str, seed: int, max_turns: int) -> None:
    """One episode played by the env's expert, random actions or the user at stdin, shown as it goes."""
    from rlcli.envs.loading import load_env
    from rlcli.envs.protocol import as_messages

    env = load_env(name, env_kwargs)()
    expert: Callable[[], str] | None = getattr(env, "expert_action", None)  # optional in the Env contract
    if policy == "expert" and expert is None:
        raise UsageError(f"Env {name!r} has no expert_action(); try --policy random or human.")
    rng = random.Random(seed)
    observation, info = env.reset(seed)
    _show(as_messages(observation))
    total, turn, info = 0.0, 0, {}
    while turn < max_turns:
        if policy == "expert" and expert is not None:
            action = expert()
        elif policy == "random":
            action = rng.choice(RANDOM_ACTIONS)
        else:
            console.print("[bold]your action>[/bold] ", end="")
            action = sys.stdin.readline()
            if not action:
                break
            action = action.rstrip("\n")
        turn += 1
        console.print(Panel(literal(action), title=f"agent (turn {turn})", border_style="cyan", expand=False))
        observation, reward, terminated, truncated, info = env.step(action)
        total += reward
        _show(as_messages(observation), reward)
        if terminated or truncated:
            break
    success = info.get("success", total > 0)
    console.print(f"[bold]{'solved' if success else 'not solved'}[/bold] in {turn} turns, return {total:g}")


def _play_model(
    cli_ctx: typer.Context,
    name: str,
    env_kwargs: dict,
    seed: int,
    max_turns: int,
    recipe_path: Path | None,
    model: str | None,
    checkpoint: str | None,
    run: str | None,
) -> None:
    """One episode played by a model (engine/try_model.py), shown turn by turn."""
    from rlcli.engine.try_model import play_with_model
    from rlcli.recipe import load_recipe

    recipe = load_recipe(recipe_path, [f"model.name={model}"] if model else [])
    recipe, folder = _checkpoint(cli_ctx, recipe, recipe_path is not None, model, checkpoint, run)
    tried = play_with_model(recipe, name, env_kwargs, seed, max_turns, folder)
    console.print(tried.sampled_with, highlight=False)
    episode = tried.episode
    first_reply = next((i for i, m in enumerate(episode.messages) if m["role"] == "assistant"), None)
    _show(episode.messages[:first_reply])
    for turn in episode.turns:
        console.print(
            Panel(literal(turn.text), title=f"agent (turn {turn.turn_index + 1})", border_style="cyan", expand=False)
        )
        _show(json.loads(turn.observation), turn.reward)
    if episode.error:
        raise RlcliError(f"The episode failed: {episode.error}")
    success = episode.success if episode.success is not None else episode.env_return > 0
    console.print(
        f"[bold]{'solved' if success else 'not solved'}[/bold] in {len(episode.turns)} turns, "
        f"return {episode.env_return:g} (ended: {episode.end_reason.value if episode.end_reason else 'unknown'})"
    )


def _checkpoint(
    cli_ctx: typer.Context,
    recipe: Recipe,
    recipe_given: bool,
    model: str | None,
    checkpoint: str | None,
    run: str | None,
) -> tuple[Recipe, Path | None]:
    """The recipe to load the model with and the checkpoint folder (None: the base model)."""
    from rlcli.store.checkpoints import require_folder, resolve_checkpoint
    from rlcli.store.run_store import RunStore

    if checkpoint is None or checkpoint == "base":
        return recipe, None
    if Path(checkpoint).is_dir():
        return recipe, Path(checkpoint)
    run_name = run or recipe.run.name
    store = RunStore(open_existing(cli_ctx, "--checkpoint"), run_name)
    try:
        if store.rundb.get_run(run_name) is None:
            raise UsageError(f"--checkpoint {checkpoint}: no folder of that name, and no run {run_name!r} (see --run).")
        if not recipe_given:  # the run's own model, LoRA and quantisation, with --model's name if given
            recipe = store.recipe()
            if model:
                recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name": model})})
        row = resolve_checkpoint(store, checkpoint)
        return recipe, None if row is None else require_folder(row)
    finally:
        store.rundb.close()


def _show(messages: list[dict], reward: float | None = None) -> None:
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = " ".join(p.get("text", "[image]") for p in content)
        title = message["role"] + (f" (reward {reward:g})" if reward is not None else "")
        style = {"system": "dim", "tool": "magenta"}.get(message["role"], "green")
        console.print(Panel(literal(content), title=title, border_style=style, expand=False))
