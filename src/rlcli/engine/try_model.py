"""`rlcli envs try --policy model`: one episode played by a model through the same code as a rollout
(EpisodeRunner, or AgentRunner for an agent program, and the recipe's engine: token-exact prompts, chat
template, context budget), for the CLI to show turn by turn; and `--policy human` for an agent program,
with the user typing the replies its calls get. Nothing is stored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcli.engine.turns import EpisodeSpec, LiveEpisode
    from rlcli.envs.agents import AgentProgram
    from rlcli.generation.sampler import Sample, Sampler
    from rlcli.recipe import Recipe

# A person's episode has no time limit worth the name: a day.
BY_HAND_TIME_LIMIT_S = 86400.0


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
    from rlcli.engine.episode_runner import EpisodeRunner
    from rlcli.engine.turns import EpisodeSpec, RolloutLimits
    from rlcli.envs.agents import agent_program
    from rlcli.envs.loading import load_env
    from rlcli.envs.workers import InProcessEnvs
    from rlcli.generation.engines import generation_engine, make_sampler
    from rlcli.generation.sampler import sampling_config
    from rlcli.generation.seeds import derive_seed
    from rlcli.models.loading import load_policy
    from rlcli.recipe import is_agent

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
        episode = _agent_episode(
            recipe, program, sampler, tokenizer, env_kwargs, spec, max_turns, recipe.env.step_timeout_s
        )
        return TriedEpisode(episode, sampled_with)
    assert factory is not None
    with InProcessEnvs(factory, recipe.env.step_timeout_s) as envs:
        [episode] = EpisodeRunner(envs, limits, sampler, tokenizer).run([spec])
    return TriedEpisode(episode, sampled_with)


def play_agent_by_hand(
    recipe: Recipe, env: str, env_kwargs: dict, seed: int, max_turns: int, answer: Callable[[str], str]
) -> TriedEpisode:
    """Agent program `env` on task `seed` with a person behind the endpoint: `answer` is shown what each call
    adds to the conversation (rendered by the recipe's model's chat template) and returns the reply."""
    from rlcli.engine.turns import EpisodeSpec
    from rlcli.envs.agents import agent_program
    from rlcli.generation.sampler import sampling_config
    from rlcli.models.cache import resolve_model
    from rlcli.models.loading import load_tokenizer

    program = agent_program(env, recipe.env.command, Path.cwd())
    tokenizer = load_tokenizer(recipe.model, resolve_model(recipe.model.name))
    sampler = TypedReplies(tokenizer, answer, sampling_config(recipe.rollout))
    spec = EpisodeSpec(0, 0, env_seed=seed, sample_seed=seed)
    episode = _agent_episode(recipe, program, sampler, tokenizer, env_kwargs, spec, max_turns, BY_HAND_TIME_LIMIT_S)
    return TriedEpisode(episode, f"replies typed at the terminal; chat template of {recipe.model.name}")


class TypedReplies:
    """A Sampler whose replies a person types: for each call, `answer` gets the text the prompt adds to
    the one before it (all of it for the first), and its return value, then the end-of-turn token, is
    the reply."""

    def __init__(self, tokenizer: Any, answer: Callable[[str], str], config: Any) -> None:
        self.tokenizer, self.answer, self.config = tokenizer, answer, config
        self.seen: list[int] = []

    def start(self, seeds: list[int]) -> None:
        pass  # the endpoint starts each batch; the episode's text so far stays in self.seen

    def sample(self, rows: list[int], prompts: list[list[int]], budgets: list[int], images: Any = None) -> list[Sample]:
        from rlcli.generation.sampler import Sample

        samples = []
        for prompt in prompts:
            new = prompt[len(self.seen) :] if prompt[: len(self.seen)] == self.seen else prompt
            text = self.answer(self.tokenizer.decode(new, skip_special_tokens=False))
            ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
            self.seen = [*prompt, *ids]
            samples.append(Sample(ids, [0.0] * len(ids), True))
        return samples


def _agent_episode(
    recipe: Recipe,
    program: AgentProgram,
    sampler: Sampler,
    tokenizer: Any,
    env_kwargs: dict,
    spec: EpisodeSpec,
    max_turns: int,
    time_limit_s: float,
) -> LiveEpisode:
    """One episode of an agent program with `sampler` behind the endpoint, its calls capped at max_turns; the
    recipe's env.task_data gives its task when the recipe's env is this program."""
    from rlcli.engine.agent_runner import AgentRunner
    from rlcli.engine.task_data import task_rows
    from rlcli.envs.agents import AgentLimits

    agent = AgentRunner(
        program,
        sampler,
        tokenizer,
        model_name=recipe.model.name,
        task_kwargs=env_kwargs,
        task_rows=task_rows(recipe.env) if program.env_name == recipe.env.name else None,
        time_limit_s=time_limit_s,
        limits=AgentLimits(recipe.env.worker_memory_mb, recipe.env.worker_cpu_s),
        max_length=recipe.model.max_length,
        run_seed=recipe.run.seed,
        max_calls=max_turns,
        request_sampling=recipe.rollout.request_sampling == "request",
    )
    [episode] = agent.run([spec])
    return episode
