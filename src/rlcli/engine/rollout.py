"""Multi-turn rollout stages: which episodes, in which chunks, played where, stored how.

The episodes themselves are played by engine/episode_runner.py (one seat each) or, for two-player
games against a model, engine/games.py (both seats); the envs run in this process or in workers.

Durability: episode specs are cut into fixed chunks of `rollout.batch_size`; a chunk's episodes
are committed in one transaction when the chunk finishes. A resumed stage skips committed chunks
and replays the first missing one with the same composition and seeds, so resumed results are
identical to uninterrupted ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.engine.context import RunContext
from rlcli.engine.episode_runner import EpisodeRunner
from rlcli.engine.games import GameRunner, Opponent, recipe_opponent, stored_keys
from rlcli.engine.turns import EpisodeSpec, LiveEpisode, RolloutLimits
from rlcli.envs.sandbox import use_bwrap
from rlcli.envs.tool_use import ToolUseSpec, tool_use_spec
from rlcli.envs.tools import close_toolboxes
from rlcli.envs.workers import EnvHost, EnvWorkerPool, InProcessEnvs
from rlcli.errors import UsageError
from rlcli.generation.engines import make_sampler
from rlcli.generation.sampler import Sampler, sampling_config
from rlcli.generation.seeds import derive_seed
from rlcli.recipe import is_agent
from rlcli.store.checkpoints import resolve_checkpoint
from rlcli.store.episodes import episode_summary, store_episodes, stored_episode_keys
from rlcli.store.names import BASE, EXPERT, RESERVED_STAGES, PolicyRef, check_user_name
from rlcli.store.records import EpisodeSummary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.engine.agent_runner import AgentRunner
    from rlcli.models.loading import PolicyModel
    from rlcli.recipe import EnvSection


def env_host(env_cfg: EnvSection, kwargs: dict, factory: Callable[[], Any], tools: ToolUseSpec) -> EnvHost:
    """Where the recipe's envs run: this process (env.workers 0), a pool of worker processes, or Ray
    actors; kwargs: the env's factory kwargs (EnvSection.factory_kwargs); factory: this process's envs;
    tools: the tool settings workers build theirs with."""
    if env_cfg.workers == 0:
        return InProcessEnvs(factory, env_cfg.step_timeout_s)
    if env_cfg.workers_backend == "ray":
        from rlcli.envs.ray_workers import RayEnvHost  # Ray is optional: imported only when asked for

        return RayEnvHost(
            env_cfg.name,
            kwargs,
            env_cfg.workers,
            env_cfg.step_timeout_s,
            address=env_cfg.ray_address,
            cpu_s=env_cfg.worker_cpu_s,
            isolation=env_cfg.isolation,
            tools=tools,
        )
    return EnvWorkerPool(
        env_cfg.name,
        kwargs,
        env_cfg.workers,
        env_cfg.step_timeout_s,
        memory_mb=env_cfg.worker_memory_mb,
        cpu_s=env_cfg.worker_cpu_s,
        isolation=env_cfg.isolation,
        tools=tools,
        in_bwrap=use_bwrap(env_cfg.sandbox, "env.sandbox"),
    )


# --- the stage: which episodes, in which chunks, stored how ------------------------


def episode_specs(
    run_seed: int,
    stage: str,
    task_indices: list[int],
    group_size: int | dict[int, int],
    split: str,
    eval_seed_start: int,
) -> list[EpisodeSpec]:
    """group_size: samples per task, or per task index (rollout.group_size_hard)."""
    from rlcli.envs.protocol import task_seed

    return [
        EpisodeSpec(t, g, task_seed(split, t, eval_seed_start), derive_seed(run_seed, stage, t, g))
        for t in task_indices
        for g in range(group_size if isinstance(group_size, int) else group_size[t])
    ]


def chunks(specs: list[EpisodeSpec], size: int) -> Iterator[list[EpisodeSpec]]:
    for start in range(0, len(specs), size):
        yield specs[start : start + size]


def collect(
    ctx: RunContext,
    *,
    stage: str,
    policy: PolicyRef,
    sampler: Sampler | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    task_indices: list[int],
    group_size: int | dict[int, int],
    split: str,
    iteration: int | None = None,
    progress_label: str | None = None,
    opponent: Opponent | None = None,
) -> dict[str, Any]:
    """Roll out every missing episode of a stage and store it; return the stage's result.

    policy: the weights the sampler plays, recorded with every episode; sampler: the policy's Sampler
    (see `make_sampler`); None plays the env's expert. opponent: who plays a two-player game's other
    seat (engine/games.py); None: env.opponent's players inside the env, if any.
    """
    from rlcli.envs.loading import load_env

    recipe = ctx.recipe
    if opponent is None and recipe.env.model_opponent() is not None:
        raise AssertionError(f"{stage}: env.opponent {recipe.env.model_opponent()} is a model; collect needs it")
    seat = None if opponent is None else "caller" if opponent.by_model else opponent.name
    kwargs = recipe.env.factory_kwargs(seat)
    tools = tool_use_spec(recipe.env, Path.cwd(), tokenizer)
    # A GRPO iteration's rollouts follow env.max_turns's schedule; any other stage gets the final horizon.
    horizon = recipe.env.horizon(iteration if split == "train" else None)
    agent = agent_runner(ctx, sampler, tokenizer, stage, horizon) if is_agent(recipe.env.name) else None
    env_factory = load_env(recipe.env.name, kwargs, tools=tools) if agent is None else None
    # With a model opponent a spec is a game (sample index g), whose seats' episodes are stored together.
    specs = episode_specs(recipe.run.seed, stage, task_indices, group_size, split, recipe.env.eval_seed_start)
    self_play = opponent is not None and opponent.self_play
    have = stored_episode_keys(ctx.store, stage)
    # A killed stage never leaves a chunk half stored (one transaction per chunk); a chunk is only
    # partly stored when the stage was asked for more tasks (eval.tasks raised): play the missing ones.
    todo = []
    for chunk in chunks(specs, recipe.rollout.batch_size):
        missing = [spec for spec in chunk if not set(stored_keys(spec, self_play)) <= have]
        if missing:
            todo.append(missing)
    keep_images = None if recipe.env.keep_images == "all" else recipe.env.keep_images
    limits = RolloutLimits(
        horizon, recipe.model.max_length, recipe.env.step_timeout_s, keep_images, recipe.env.timeout_retries
    )
    done_before = len(specs) - sum(len(c) for c in todo)
    with _progress(ctx, progress_label or stage, len(specs), done_before) as advance:

        def play_chunks(play: Callable[..., list[LiveEpisode]]) -> None:
            for chunk in todo:
                episodes = play(chunk, on_turns=lambda n: advance(0, n))
                records = [ep.to_record(ctx.run, stage, iteration, split, str(policy)) for ep in episodes]
                store_episodes(ctx.rundb, records)
                advance(len(chunk), 0)

        if todo and agent is not None:
            play_chunks(agent.run)
        elif todo:
            assert env_factory is not None
            try:
                with env_host(recipe.env, kwargs, env_factory, tools) as envs:
                    if opponent is not None and opponent.by_model:
                        games = GameRunner(
                            envs, limits, sampler, tokenizer, opponent=opponent, run_seed=recipe.run.seed, stage=stage
                        )
                        play_chunks(games.run_games)
                    else:
                        play_chunks(EpisodeRunner(envs, limits, sampler, tokenizer).run)
            finally:
                close_toolboxes()  # the MCP servers that envs in this process started (env.workers 0)
    return asdict(episode_summary(ctx.store, stage))


def agent_runner(
    ctx: RunContext, sampler: Sampler | None, tokenizer: PreTrainedTokenizerBase | None, stage: str, max_calls: int
) -> AgentRunner:
    """The runner of env.name agent:... / agent-cmd: the policy behind an endpoint, the program per episode,
    each episode's calls capped at max_calls (env.max_turns)."""
    from rlcli.engine.agent_runner import AgentRunner
    from rlcli.engine.task_data import task_rows
    from rlcli.envs.agents import AgentLimits, agent_program
    from rlcli.envs.sandbox import use_bwrap

    env = ctx.recipe.env
    if sampler is None or tokenizer is None:
        raise UsageError(f"{stage}: env {env.name} is an agent program, played by a model; it has no expert policy.")
    return AgentRunner(
        agent_program(env.name, env.command, Path.cwd()),
        sampler,
        tokenizer,
        model_name=ctx.recipe.model.name,
        task_kwargs=dict(env.kwargs),
        task_rows=task_rows(env),
        time_limit_s=env.step_timeout_s,
        limits=AgentLimits(env.worker_memory_mb, env.worker_cpu_s),
        max_length=ctx.recipe.model.max_length,
        run_seed=ctx.recipe.run.seed,
        max_calls=max_calls,
        request_sampling=ctx.recipe.rollout.request_sampling == "request",
        timeout_retries=env.timeout_retries,
        sandbox_root=Path.cwd() if use_bwrap(env.sandbox, "env.sandbox") else None,
    )


class _progress:
    """A rich progress bar over episodes that also shows generated tokens per second."""

    def __init__(self, ctx: RunContext, label: str, total: int, completed: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            # markup=False: the description is a stage name the user chose, e.g. mine[red]
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("episodes"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=ctx.console,
            transient=False,
        )
        self.task = self.progress.add_task(label, total=total, completed=completed, rate="")
        self.tokens = 0
        self.start = time.perf_counter()

    def __enter__(self) -> Callable[[int, int], None]:
        self.progress.start()

        def advance(episodes: int, tokens: int) -> None:
            self.tokens += tokens
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.progress.update(self.task, advance=episodes, rate=f"{rate:.1f} tok/s" if self.tokens else "")

        return advance

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


# --- policies -------------------------------------------------------------------


def load_rollout_policy(
    ctx: RunContext, policy: str
) -> tuple[PolicyRef, PolicyModel | None, PreTrainedTokenizerBase | None]:
    """Resolve base / sft / latest / best / expert / a checkpoint id (the CLI form) into (the
    PolicyRef resolved: base, expert or a checkpoint id; model; tokenizer)."""
    ref = PolicyRef.from_cli(policy)
    if ref == EXPERT:
        return EXPERT, None, None
    from rlcli.models.loading import load_policy

    row = resolve_checkpoint(ctx.store, ref)
    recipe = ctx.recipe
    model, tokenizer = load_policy(
        recipe.model, recipe.lora, recipe.quantization, adapter=row.path if row else None, trainable=False
    )
    return PolicyRef.of_checkpoint(row), model, tokenizer


def run_rollout_stage(ctx: RunContext, *, stage: str, policy: str, split: str) -> EpisodeSummary:
    """`rlcli rollout`: tasks x group size episodes with one policy, stored token by token."""
    if split not in ("train", "eval"):
        raise UsageError(f"--split must be train or eval, got {split!r}.")
    check_user_name("--stage", stage, reserved=RESERVED_STAGES)
    recipe = ctx.recipe
    asked = PolicyRef.from_cli(policy)
    # The weights, resolved now, define the stage: `latest` after more training is another policy.
    checkpoint = resolve_checkpoint(ctx.store, asked) if asked != EXPERT else None
    weights = EXPERT if asked == EXPERT else PolicyRef.of_checkpoint(checkpoint)

    def load_and_collect() -> dict[str, Any]:
        resolved, model, tokenizer = load_rollout_policy(ctx, str(weights))
        sampler: Sampler | None = None
        if model is not None:
            assert tokenizer is not None  # loaded with the model
            folder = checkpoint.path if checkpoint is not None else None
            sampling = sampling_config(recipe.rollout)
            sampler = make_sampler(recipe, model, tokenizer, sampling, base=resolved == BASE, checkpoint_folder=folder)
        summary = collect(
            ctx,
            stage=stage,
            policy=resolved,
            sampler=sampler,
            tokenizer=tokenizer,
            task_indices=list(range(recipe.rollout.tasks)),
            group_size=recipe.rollout.group_size,
            split=split,
            opponent=recipe_opponent(ctx, sampler, stage=stage),
        )
        return {"policy": str(resolved), **summary}

    ctx.stage(
        stage,
        load_and_collect,
        {"policy_asked": policy},
        identity={"policy": str(weights), "split": split},
        new_stage_hint="use another --stage name for a new stage",
    )
    return episode_summary(ctx.store, stage)
