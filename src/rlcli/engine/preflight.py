"""What a stage command checks before it writes its run: every mistake found here leaves the run
database as it was, instead of a run marked failed by a command that did nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlcli.errors import UsageError
from rlcli.recipe import Recipe

if TYPE_CHECKING:
    from rlcli.envs.protocol import EnvFactory


def check_recipe(recipe: Recipe, stages: list[str] | None = None, *, sft_done: bool = False) -> None:
    """Trackers installed, the model known, rewards resolvable, env loadable with its kwargs, a hub dataset
    for SFT loadable (cached, when offline) or, when `stages` hold sft, its data file or folder there, engine
    able to serve the model, and on a GPU machine the memory plan of `stages` (default: every stage the recipe
    runs) within the card. `rlcli recipes validate` runs it too. sft_done: the run's SFT is done, so its
    data file is not read again (and a relative path to it need not resolve from this folder).

    Only what is cheap is checked: no model is loaded and no env constructed (an env may start a browser).
    The recipe's tools are the exception: each MCP server is started, listed and stopped, since one that
    cannot start would otherwise fail every episode of the stage, and one env is made, to read its own
    tools: no tool name may come from two places (the env, env.tools, an MCP server). And with grpo.branch,
    one training task is played twice with the same actions (`check_replays`).
    """
    from rlcli.engine.pipeline import planned_stages
    from rlcli.engine.sft_data import check_data_path
    from rlcli.engine.sft_sources import source_kind
    from rlcli.engine.trackers import check_trackers
    from rlcli.envs.loading import load_env
    from rlcli.envs.sandbox import use_bwrap
    from rlcli.envs.tool_use import check_tool_names, tool_use_spec
    from rlcli.generation.memory_plan import check_fits
    from rlcli.models.cache import check_model
    from rlcli.recipe import is_agent
    from rlcli.rewards.scoring import check_reward_fns

    planned = planned_stages(recipe) if stages is None else stages
    check_trackers(recipe.run.trackers)
    check_model(recipe.model.name)
    check_reward_fns(recipe.rewards)
    if is_agent(recipe.env.name):
        check_agent(recipe, planned)
    else:
        factory = load_env(recipe.env.name, recipe.env.factory_kwargs())  # finds it and checks the kwargs it takes
        tools = tool_use_spec(recipe.env, Path.cwd())  # env.code_sandbox bwrap where it cannot run: refused here
        if recipe.env.tools or recipe.env.mcp_servers:
            check_tool_names(tools, factory)
        if recipe.grpo.branch is not None and "grpo" in planned:
            check_replays(recipe, factory)
    if (recipe.env.workers or is_agent(recipe.env.name)) and recipe.env.sandbox != "none":
        if recipe.env.workers_backend == "ray":
            raise UsageError(
                f"env.sandbox is {recipe.env.sandbox}, but Ray actors cannot run in bubblewrap; expected "
                "env.workers_backend process (worker processes on this machine) or env.sandbox none."
            )
        use_bwrap(recipe.env.sandbox, "env.sandbox")  # where bubblewrap cannot run, bwrap is refused here
    if recipe.sft.source.startswith("hub:"):  # in the cache offline, known to the hub online: no rows read
        from rlcli.engine.sft_sources import check_hub_dataset, sft_hub_split

        check_hub_dataset(sft_hub_split(recipe.sft))
    elif source_kind(recipe.sft.source) in ("file", "folder") and "sft" in planned and not sft_done:
        # Only for a command that runs SFT: `train grpo` or `eval` of a run whose SFT is done may run
        # from another folder, where a relative path to the data finds nothing.
        check_data_path(Path(recipe.sft.source).expanduser())
    if recipe.rollout.engine == "vllm":
        from rlcli.generation.engines import generation_engine

        generation_engine(recipe)
    check_fits(recipe, planned)


def check_agent(recipe: Recipe, planned: list[str]) -> None:
    """env.name agent:... / agent-cmd: the callable or the program is there, and the recipe asks nothing of it
    that only an env can give (tools are the agent's own; its episodes cannot be replayed to a turn)."""
    from rlcli.engine.task_data import task_rows
    from rlcli.envs.agents import agent_program

    agent_program(recipe.env.name, recipe.env.command, Path.cwd())
    task_rows(recipe.env)  # env.task_data read and checked, its malformed rows refused here
    if recipe.env.tools or recipe.env.mcp_servers:
        raise UsageError(
            f"env.tools and env.mcp_servers give tools to an env's model; env {recipe.env.name} is an agent program, "
            "which passes its own tools in its requests. Expected neither set."
        )
    if recipe.grpo.branch is not None and "grpo" in planned:
        raise UsageError(
            f"grpo.branch replays stored episodes, and agent programs (env {recipe.env.name}) cannot be replayed "
            "to a turn; set grpo.branch: null."
        )


def check_replays(recipe: Recipe, factory: EnvFactory) -> None:
    """grpo.branch rebuilds a stored turn's state by replaying its episode's seed and actions: the audit's
    replay check (engine/audit.py) on the first training task refuses an env that does not replay, before
    any stage, instead of at its first branch."""
    from rlcli.engine.audit import has_expert, replay_check, settings_for
    from rlcli.envs.protocol import task_seed

    branch = recipe.grpo.branch
    if branch is not None and branch.choose == "expert" and not has_expert(factory):
        raise UsageError(
            f"grpo.branch.choose expert branches from the env's expert episodes, and env {recipe.env.name} has no "
            "expert_action(); expected an env with an expert, or choose failed, divergence or entropy."
        )
    seed = task_seed("train", 0, recipe.env.eval_seed_start)
    mismatch = replay_check(factory, seed, settings_for(recipe, episodes=1, train_tasks=1))
    if mismatch is not None:
        raise UsageError(
            f"grpo.branch replays stored episodes, and env {recipe.env.name} does not replay ({mismatch}); make its "
            "observations depend only on the seed and the actions, or set grpo.branch: null."
        )
