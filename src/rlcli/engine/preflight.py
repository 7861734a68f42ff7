"""What a stage command checks before it writes its run: every mistake found here leaves the run
database as it was, instead of a run marked failed by a command that did nothing."""

from __future__ import annotations

from pathlib import Path

from rlcli.recipe import Recipe


def check_recipe(recipe: Recipe, stages: list[str] | None = None) -> None:
    """Trackers installed, the model known, rewards resolvable, env loadable with its kwargs, a hub dataset
    for SFT loadable (cached, when offline), engine able to serve the model, and on a GPU machine the memory
    plan of `stages` (default: every stage the recipe runs) within the card. `rlcli recipes validate` runs it too.

    Only what is cheap is checked: no model is loaded and no env constructed (an env may start a browser).
    The recipe's tools are the exception: each MCP server is started, listed and stopped, since one that
    cannot start would otherwise fail every episode of the stage, and one env is made, to read its own
    tools: no tool name may come from two places (the env, env.tools, an MCP server).
    """
    from rlcli.engine.trackers import check_trackers
    from rlcli.envs.loading import load_env
    from rlcli.envs.tool_use import check_tool_names, tool_use_spec
    from rlcli.models.cache import check_model
    from rlcli.rewards.scoring import check_reward_fns

    check_trackers(recipe.run.trackers)
    check_model(recipe.model.name)
    check_reward_fns(recipe.rewards)
    factory = load_env(recipe.env.name, recipe.env.factory_kwargs())  # finds it and checks the kwargs it takes
    if recipe.env.tools or recipe.env.mcp_servers:
        check_tool_names(tool_use_spec(recipe.env, Path.cwd()), factory)
    if recipe.sft.source.startswith("hub:"):  # in the cache offline, known to the hub online: no rows read
        from rlcli.engine.sft_sources import check_hub_dataset

        check_hub_dataset(recipe.sft)
    if recipe.rollout.engine == "vllm":
        from rlcli.generation.engines import generation_engine

        generation_engine(recipe)
    from rlcli.engine.pipeline import planned_stages
    from rlcli.generation.memory_plan import check_fits

    check_fits(recipe, planned_stages(recipe) if stages is None else stages)
