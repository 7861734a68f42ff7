"""`rlcli envs try --policy model`: one episode played by a model through the same code as a rollout
(EpisodeRunner, or AgentRunner for an agent program, and the recipe's engine: token-exact prompts, chat
template, context budget), for the CLI to show turn by turn. Nothing is stored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcli.engine.turns import LiveEpisode
    from rlcli.recipe import Recipe


@dataclass(frozen=True)
class TriedEpisode:
    """The episode a model played, and how it was sampled (the line the CLI prints above it)."""

    episode: LiveEpisode
    sampled_with: str  # model, checkpoint, engine, temperature and token cap


def play_with_model(
    recipe: Recipe, env: str, env_kwargs: dict, seed: int, max_turns: int, folder: Path | None
) -> TriedEpisode:
    """Env `env` (with `env_kwargs`) on task `seed`, played by the recipe's model (with the adapter in
    `folder`; None: the base model) for at most `max_turns` turns, sampled as rollouts sample."""
    from rlcli.engine.agent_runner import AgentRunner
    from rlcli.engine.episode_runner import EpisodeRunner
    from rlcli.engine.turns import EpisodeSpec, RolloutLimits
    from rlcli.envs.agents import agent_program, is_agent
    from rlcli.envs.loading import load_env
    from rlcli.envs.workers import InProcessEnvs
    from rlcli.generation.engines import generation_engine, make_sampler
    from rlcli.generation.sampler import sampling_config
    from rlcli.generation.seeds import derive_seed
    from rlcli.models.loading import load_policy

    # A bad env name, agent file or program fails before the model loads.
    program = agent_program(env, recipe.env.command, Path.cwd()) if is_agent(env) else None
    factory = None if program is not None else load_env(env, env_kwargs)
    policy, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=folder, trainable=False)
    sampling = sampling_config(recipe.rollout)
    sampler = make_sampler(recipe, policy, tokenizer, sampling, base=folder is None)
    sampled_with = (
        f"model {recipe.model.name}" + (f", checkpoint {folder}" if folder else "") + f"; engine "
        f"{generation_engine(recipe)}, temperature {sampling.temperature:g}, up to {sampling.max_new_tokens} "
        "tokens a turn"
    )
    keep_images = None if recipe.env.keep_images == "all" else recipe.env.keep_images
    limits = RolloutLimits(max_turns, recipe.model.max_length, recipe.env.step_timeout_s, keep_images)
    spec = EpisodeSpec(0, 0, env_seed=seed, sample_seed=derive_seed(recipe.run.seed, "envs try", seed))
    if program is not None:  # max_turns caps the agent's calls to the endpoint
        agent = AgentRunner(
            program,
            sampler,
            tokenizer,
            model_name=recipe.model.name,
            task_kwargs=env_kwargs,
            time_limit_s=recipe.env.step_timeout_s,
            max_length=recipe.model.max_length,
            run_seed=recipe.run.seed,
            max_calls=max_turns,
        )
        [episode] = agent.run([spec])
        return TriedEpisode(episode, sampled_with)
    assert factory is not None
    with InProcessEnvs(factory, recipe.env.step_timeout_s) as envs:
        [episode] = EpisodeRunner(envs, limits, sampler, tokenizer).run([spec])
    return TriedEpisode(episode, sampled_with)
