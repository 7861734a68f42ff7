"""`rlcli envs ...`: list environments, and play or watch one episode in the terminal."""

from __future__ import annotations

import json
import random
import sys
from typing import Annotated

import typer
from rich.panel import Panel
from rich.text import Text

from rlcli.cli.common import JsonOpt, console
from rlcli.errors import UsageError

app = typer.Typer(help="Environments: list them, try one in the terminal.", no_args_is_help=True)

ADAPTER_NOTE = (
    "Adapters (pip install 'rlcli[envs]'): textarena:<GameId> (single-player TextArena games, e.g. "
    "textarena:GuessTheNumber-v0), reasoning_gym:<dataset> (e.g. reasoning_gym:chain_sum), "
    "gymnasium:<EnvId> (text observations, Discrete or Text actions, e.g. gymnasium:FrozenLake-v1). "
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
    name: Annotated[str, typer.Argument(help="Built-in name, envs/x.py, module:factory, or adapter URI.")],
    policy: Annotated[
        str, typer.Option(help="expert (the env's scripted solver), random, or human (stdin).")
    ] = "expert",
    seed: Annotated[int, typer.Option(help="Task seed.")] = 0,
    kwargs: Annotated[
        list[str] | None, typer.Option("--kwargs", "-k", help="Env keyword argument key=value; repeatable.")
    ] = None,
    max_turns: Annotated[int, typer.Option(help="Stop after this many turns.")] = 20,
) -> None:
    """Play or watch one episode, rendered turn by turn."""
    import yaml

    from rlcli.envs.loading import load_env
    from rlcli.envs.protocol import as_messages

    if policy not in ("expert", "random", "human"):
        raise UsageError(f"--policy must be expert, random or human, got {policy!r}.")
    env_kwargs = {}
    for item in kwargs or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--kwargs {item!r} is not of the form key=value.")
        env_kwargs[key] = yaml.safe_load(value)
    env = load_env(name, env_kwargs)()
    if policy == "expert" and not hasattr(env, "expert_action"):
        raise UsageError(f"Env {name!r} has no expert_action(); try --policy random or human.")
    rng = random.Random(seed)
    observation, info = env.reset(seed)
    _show(as_messages(observation))
    total, turn, info = 0.0, 0, {}
    while turn < max_turns:
        if policy == "expert":
            action = env.expert_action()
        elif policy == "random":
            action = rng.choice(RANDOM_ACTIONS)
        else:
            console.print("[bold]your action>[/bold] ", end="")
            action = sys.stdin.readline()
            if not action:
                break
            action = action.rstrip("\n")
        turn += 1
        console.print(Panel(Text(action), title=f"agent (turn {turn})", border_style="cyan", expand=False))
        observation, reward, terminated, truncated, info = env.step(action)
        total += reward
        _show(as_messages(observation), reward)
        if terminated or truncated:
            break
    success = info.get("success", total > 0)
    console.print(f"[bold]{'solved' if success else 'not solved'}[/bold] in {turn} turns, return {total:g}")


def _show(messages: list[dict], reward: float | None = None) -> None:
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = " ".join(p.get("text", "[image]") for p in content)
        title = message["role"] + (f" (reward {reward:g})" if reward is not None else "")
        style = {"system": "dim", "tool": "magenta"}.get(message["role"], "green")
        console.print(Panel(Text(str(content)), title=title, border_style=style, expand=False))
