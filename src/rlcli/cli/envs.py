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
from rlcli.console import err_console
from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import is_agent
from rlcli.report.text import literal

if TYPE_CHECKING:
    from rlcli.engine.audit import AuditReport
    from rlcli.engine.turns import LiveEpisode
    from rlcli.recipe import Recipe

app = typer.Typer(help="Environments: list them, try one in the terminal.", no_args_is_help=True)

ADAPTER_NOTE = (
    "Adapters (pip install 'rlcli[envs]'): textarena:<GameId> (TextArena games: single-player, e.g. "
    "textarena:GuessTheNumber-v0, and two-player against env.opponent, e.g. textarena:TicTacToe-v0), "
    "reasoning_gym:<dataset> (e.g. reasoning_gym:chain_sum), "
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
    name: Annotated[
        str,
        typer.Argument(
            help="Built-in name, envs/x.py, module:factory, adapter URI, or an agent program (agent:file.py:function, "
            "or agent-cmd with the recipe's env.command; --policy model or human)."
        ),
    ],
    policy: Annotated[
        str,
        typer.Option(
            help="expert (the env's scripted solver), random, human (stdin, a line a turn; for an agent program, "
            "the replies to its calls, rendered with the recipe's or --model's chat template), or model (the recipe's model, "
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
            help="--policy model: a hub id, local folder or short name instead of the recipe's model.name (for "
            "--policy human on an agent program: whose chat template renders its calls).",
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
    if policy not in ("expert", "random", "human", "model"):
        raise UsageError(f"--policy must be expert, random, human or model, got {policy!r}.")
    by_hand = is_agent(name) and policy == "human"  # the user behind the endpoint: a template, no weights
    if policy != "model" and (checkpoint or run or ((recipe or model) and not by_hand)):
        raise UsageError("--recipe, --model, --checkpoint and --run choose the model of --policy model.")
    if is_agent(name) and policy not in ("model", "human"):
        raise UsageError(
            f"{name} is an agent program, played behind rlcli's endpoint: use --policy model or --policy human."
        )
    env_kwargs = _env_kwargs(kwargs)
    if by_hand:
        _play_agent_by_hand(name, env_kwargs, seed, max_turns, recipe, model)
        return
    if policy == "model":
        _play_model(cli_ctx, name, env_kwargs, seed, max_turns, recipe, model, checkpoint, run)
        return
    _play_scripted(name, env_kwargs, policy, seed, max_turns)


def _env_kwargs(items: list[str] | None) -> dict:
    """--kwargs key=value items as env keyword arguments, each value read as YAML."""
    from yaml import YAMLError

    from rlcli.recipe import read_yaml

    env_kwargs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--kwargs {item!r} is not of the form key=value.")
        try:
            env_kwargs[key] = read_yaml(value)
        except YAMLError as exc:
            raise UsageError(
                f"--kwargs {item!r}: the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); expected "
                "key=value with a YAML value, e.g. -k low=3 or -k 'words=[a, b]' (quote text holding brackets)."
            ) from None
    return env_kwargs


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


def _play_agent_by_hand(
    name: str, env_kwargs: dict, seed: int, max_turns: int, recipe_path: Path | None, model: str | None
) -> None:
    """An agent program's episode with the user typing the replies to its calls (engine/try_model.py)."""
    from rlcli.engine.try_model import play_agent_by_hand
    from rlcli.recipe import load_recipe

    def answer(new_text: str) -> str:
        console.print(Panel(literal(new_text), title="the agent's call", border_style="magenta", expand=False))
        console.print("[bold]your reply>[/bold] ", end="")
        return sys.stdin.readline().rstrip("\n")

    recipe = load_recipe(recipe_path, [f"model.name={model}"] if model else [])
    tried = play_agent_by_hand(recipe, name, env_kwargs, seed, max_turns, answer)
    console.print(tried.sampled_with, highlight=False)
    _show_calls(tried.episode)
    _show_end(tried.episode)


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
    recipe, folder = model_checkpoint(cli_ctx, recipe, recipe_path is not None, model, checkpoint, run)
    tried = play_with_model(recipe, name, env_kwargs, seed, max_turns, folder)
    console.print(tried.sampled_with, highlight=False)
    episode = tried.episode
    if is_agent(name):
        _show_calls(episode)
    else:
        first_reply = next((i for i, m in enumerate(episode.messages) if m["role"] == "assistant"), None)
        _show(episode.messages[:first_reply])
        for turn in episode.turns:
            console.print(
                Panel(
                    literal(turn.text), title=f"agent (turn {turn.turn_index + 1})", border_style="cyan", expand=False
                )
            )
            _show(json.loads(turn.observation), turn.reward)
    _show_end(episode)


def _show_end(episode: LiveEpisode) -> None:
    """How a model's (or typed) episode ended: solved or not, its return and why it ended; an error raised."""
    if episode.error:
        raise RlcliError(f"The episode failed: {episode.error}")
    success = episode.success if episode.success is not None else episode.env_return > 0
    console.print(
        f"[bold]{'solved' if success else 'not solved'}[/bold] in {len(episode.turns)} turns, "
        f"return {episode.env_return:g} (ended: {episode.end_reason.value if episode.end_reason else 'unknown'})"
    )


def _show_calls(episode: LiveEpisode) -> None:
    """An agent program's episode: its transcript (the last call's messages and reply), then a line per
    call to the endpoint: its tokens, and whether it went on from the call before (one training sequence)."""
    _show(episode.messages)
    ids = {}
    for turn in episode.turns:
        call = json.loads(turn.info)
        ids[call["call"]] = turn.turn_index + 1
        if call["extends"] is not None:
            how = f"extends call {ids.get(call['extends'], '?')}"
        elif turn.turn_index == 0:
            how = "first call"
        else:
            how = "a new segment" + (" (the messages re-tokenise otherwise)" if call["retokenised"] else "")
        console.print(
            f"call {turn.turn_index + 1}: {len(turn.prompt_ids)} prompt tokens, {len(turn.completion_ids)} sampled "
            f"({call['finish_reason']}); {how}",
            highlight=False,
        )


def model_checkpoint(
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
        content = message.get("content") or ""  # an agent's assistant message may hold tool calls alone
        if isinstance(content, list):
            content = " ".join(p.get("text", "[image]") for p in content)
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            content += ("\n" if content else "") + f"tool call: {function.get('name')}({function.get('arguments')})"
        title = message["role"] + (f" (reward {reward:g})" if reward is not None else "")
        style = {"system": "dim", "tool": "magenta"}.get(message["role"], "green")
        console.print(Panel(literal(content), title=title, border_style=style, expand=False))


@app.command("audit")
def audit_env(
    name: Annotated[
        str | None,
        typer.Argument(help="The env to audit (as in `envs try`); default: the recipe's env.name.", show_default=False),
    ] = None,
    kwargs: Annotated[
        list[str] | None,
        typer.Option("--kwargs", "-k", help="Env keyword argument key=value; repeatable (default: the recipe's)."),
    ] = None,
    recipe: RecipeOpt = None,
    episodes: Annotated[
        int,
        typer.Option(min=1, help="Episodes per policy, on held-out tasks; also the held-out tasks checked for leaks."),
    ] = 32,
    train_tasks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Training seeds compared with the held-out ones. Default: the recipe's training pool (env.tasks, "
            "else rollout.tasks x grpo.iterations, or sft.demos if more), at most 2000.",
            show_default=False,
        ),
    ] = None,
    max_success: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of successes chance may give a knowing-nothing policy (never the empty reply).",
        ),
    ] = 0.25,
    as_json: JsonOpt = False,
) -> None:
    """Play an env with policies that know nothing and with its expert; check that it replays and that
    held-out tasks are not training tasks. Exit 1 when it finds a loophole, a crash, a replay that
    differs or a leak."""
    from dataclasses import replace

    from rlcli.engine.audit import audit, settings_for
    from rlcli.envs.loading import load_env
    from rlcli.recipe import load_recipe

    if name is None and recipe is None:
        raise UsageError("envs audit: name an env (e.g. rlcli envs audit guess_number) or give --recipe.")
    loaded = load_recipe(recipe, [])
    env_name = name or loaded.env.name
    env_kwargs = _env_kwargs(kwargs) if kwargs is not None or name is not None else dict(loaded.env.kwargs)
    settings = replace(settings_for(loaded, episodes, train_tasks), max_success=max_success)
    factory = load_env(env_name, env_kwargs)
    report = audit(env_name, factory, settings, on_policy=lambda policy: err_console.print(f"playing: {policy}"))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _show_audit(report, settings.train_tasks)
    if report.findings:
        raise RlcliError(f"envs audit: {len(report.findings)} finding(s) for {env_name} (above).")


def _show_audit(report: AuditReport, train_tasks: int) -> None:
    from rich.table import Table

    table = Table(title=f"{report.env}: {report.scores[0].episodes} held-out episodes per policy")
    for column in ("policy", "success", "95% interval", "mean return", "env errors"):
        table.add_column(column)
    for s in report.scores:
        low, high = s.success_interval
        table.add_row(s.policy, f"{s.success_rate:.2f}", f"{low:.2f}-{high:.2f}", f"{s.mean_return:.3g}", str(s.errors))
    console.print(table)
    replay = report.replay_mismatch or f"same observations, rewards and endings on {report.replays_checked} seeds"
    console.print(f"replay: {replay}", markup=False)
    console.print(
        f"held-out: {len(report.leaked)} of {report.held_out} tasks are training tasks "
        f"(compared with {train_tasks} training seeds)",
        markup=False,
    )
    for finding in report.findings:
        console.print(f"finding: {finding}", markup=False)
