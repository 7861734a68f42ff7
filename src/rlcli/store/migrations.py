"""The run database's schema: named, append-only migrations applied on every open.

Never edit or reorder a migration that has shipped; add a new one at the end.
"""

from sqlite_utils import Database, Migrations

migrations = Migrations("rlcli")


@migrations(name="001_initial")
def initial(db: Database) -> None:
    db.table("runs").create(
        {
            "name": str,
            "status": str,  # created | running | done | failed
            "recipe": str,  # resolved recipe, JSON
            "recipe_sha256": str,
            "recipe_path": str,
            "seed": int,
            "created_at": str,
            "updated_at": str,
            "versions": str,  # JSON: rlcli, python, torch, transformers, trl, peft
            "git_sha": str,
            "hostname": str,
        },
        pk="name",
    )
    db.table("stages").create(
        {
            "id": int,
            "run": str,
            "name": str,  # sft, rollout/0, train/3, eval/final, ...
            "status": str,  # pending | running | done | failed
            "params": str,  # JSON
            "result": str,  # JSON summary
            "error": str,
            "started_at": str,
            "finished_at": str,
            "pid": int,
        },
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("stages").create_index(["run", "name"], unique=True)
    db.table("episodes").create(
        {
            "id": int,
            "run": str,
            "stage": str,
            "iteration": int,
            "split": str,  # train | eval
            "task_index": int,
            "sample_index": int,
            "seed": int,
            "policy": str,  # base | expert | checkpoint id
            "status": str,  # ok | failed
            "end_reason": str,  # terminated | truncated | max_turns | context | length | error
            "env_return": float,
            "success": int,
            "num_turns": int,
            "num_tokens": int,  # generated tokens
            "task": str,  # JSON task fields from the env
            "messages": str,  # JSON chat transcript
            "template_consistent": int,  # 1 when each turn's prompt extends the previous turn's tokens
            "error": str,
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("episodes").create_index(["run", "stage", "task_index", "sample_index"], unique=True)
    db.table("turns").create(
        {
            "id": int,
            "episode_id": int,
            "turn_index": int,
            "prompt_ids": bytes,  # int32 token ids the model saw for this turn
            "completion_ids": bytes,  # int32 sampled token ids
            "logprobs": bytes,  # float32 sampling-time logprobs of completion_ids
            "text": str,  # decoded completion
            "observation": str,  # JSON messages the env answered with
            "reward": float,
            "terminated": int,
            "truncated": int,
            "info": str,  # JSON
            "gen_time_s": float,
            "env_time_s": float,
        },
        pk="id",
        foreign_keys=[("episode_id", "episodes", "id")],
    )
    db.table("turns").create_index(["episode_id", "turn_index"], unique=True)
    db.table("rewards").create(
        {
            "id": int,
            "episode_id": int,
            "label_set": str,
            "component": str,  # a reward function's name, or "total" for the weighted sum
            "value": float,
            "weight": float,
            "error": str,  # why the value is a fallback (e.g. a judge reply with no score)
        },
        pk="id",
        foreign_keys=[("episode_id", "episodes", "id")],
    )
    db.table("rewards").create_index(["episode_id", "label_set", "component"], unique=True)
    db.table("metrics").create(
        {"id": int, "run": str, "stage": str, "step": int, "key": str, "value": float, "created_at": str},
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("metrics").create_index(["run", "stage", "step", "key"], unique=True)
    db.table("checkpoints").create(
        {
            "id": int,
            "run": str,
            "stage": str,
            "iteration": int,
            "path": str,
            "kind": str,  # lora | full
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("evals").create(
        {
            "id": int,
            "run": str,
            "stage": str,
            "checkpoint": str,  # base | sft | latest | id, as asked
            "checkpoint_id": int,  # resolved checkpoint row, NULL for the base model
            "split": str,
            "tasks": int,
            "k": int,
            "success_rate": float,
            "ci_low": float,
            "ci_high": float,
            "mean_return": float,
            "pass_at_k": float,
            "avg_at_k": float,
            "mean_turns": float,
            "mean_tokens": float,
            "details": str,  # JSON
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )


@migrations(name="002_episode_attempts")
def episode_attempts(db: Database) -> None:
    # A failed episode whose error may not recur (an env call timed out) is played again when its
    # stage is resumed; the row it replaces leaves its count behind.
    db.table("episodes").add_column("attempts", int, not_null_default=1)  # times this episode was played
    db.table("episodes").add_column("transient", int, not_null_default=0)  # 1: failed in a way worth retrying


@migrations(name="003_run_recipes")
def run_recipes(db: Database) -> None:
    # Every recipe a run has used, and the hashes of the code files it names: --force and edited
    # env or reward files leave a trace instead of overwriting the only record.
    db.table("run_recipes").create(
        {
            "id": int,
            "run": str,
            "recipe": str,  # the resolved recipe, JSON
            "recipe_sha256": str,
            "code": str,  # JSON: {path as the recipe names it: SHA-256 of the file}
            "reason": str,  # created | recipe changed ... | code changed: <files>
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("run_recipes").create_index(["run", "id"])
    # Runs of an older rlcli start their history with the recipe they have now.
    db.execute(
        "insert into run_recipes (run, recipe, recipe_sha256, code, reason, created_at) "
        "select name, recipe, recipe_sha256, '{}', 'recorded before recipe history', updated_at from runs"
    )


@migrations(name="004_run_events")
def run_events(db: Database) -> None:
    # Warnings raised while a run trains (engine/guardrails.py), kept so that `runs show` lists them
    # after the fact. One per (run, kind, iteration): a resumed iteration does not repeat them.
    db.table("run_events").create(
        {
            "id": int,
            "run": str,
            "stage": str,  # the stage that was running, e.g. train/7
            "iteration": int,  # the GRPO iteration it concerns
            "kind": str,  # e.g. entropy_collapse, no_signal (see docs/reporting.md)
            "message": str,
            "details": str,  # JSON: the numbers behind the warning
            "created_at": str,
        },
        pk="id",
        not_null={"run", "iteration", "kind"},
        foreign_keys=[("run", "runs", "name")],
    )
    db.table("run_events").create_index(["run", "kind", "iteration"], unique=True)


@migrations(name="005_task_stats")
def task_stats(db: Database) -> None:
    # Per-task statistics of a run's training tasks (store/tasks.py), recomputed from the episodes
    # and their labels after every labelled GRPO rollout; the curriculum and `runs tasks` read them.
    db.table("task_stats").create(
        {
            "run": str,
            "label_set": str,  # the labels the rewards come from (grpo: GRPO's own)
            "task_index": int,  # the training task, which is its env seed
            "attempts": int,  # finished, labelled episodes of the task
            "successes": int,
            "reward_mean": float,  # mean total reward under the label set
            "last_iteration": int,  # the last GRPO iteration that played it
            "updated_at": str,
        },
        pk=("run", "label_set", "task_index"),
        foreign_keys=[("run", "runs", "name")],
    )


@migrations(name="006_dpo_pairs")
def dpo_pairs(db: Database) -> None:
    # The preference pairs a DPO stage mined from a run's labelled groups (engine/pairs.py) and
    # trained on: which episodes, from which turn on, and their rewards.
    db.table("dpo_pairs").create(
        {
            "id": int,
            "run": str,
            "stage": str,  # the DPO stage that trains on the pair (dpo)
            "source_stage": str,  # the rollout stage of the group, e.g. rollout/3
            "task_index": int,
            "chosen_episode_id": int,
            "rejected_episode_id": int,
            "turn_index": int,  # the first turn at which the two differ: the shared prompt ends there
            "chosen_reward": float,
            "rejected_reward": float,
            "prompt_tokens": int,
            "chosen_tokens": int,  # tokens of the continuation, env tokens in it included
            "rejected_tokens": int,
            "created_at": str,
        },
        pk="id",
        foreign_keys=[
            ("run", "runs", "name"),
            ("chosen_episode_id", "episodes", "id"),
            ("rejected_episode_id", "episodes", "id"),
        ],
    )
    db.table("dpo_pairs").create_index(["run", "stage", "chosen_episode_id", "rejected_episode_id"], unique=True)


@migrations(name="007_images")
def images(db: Database) -> None:
    # The images of vision-language episodes (store/images.py): each stored once, as PNG, named by
    # the sha256 of those bytes; a turn lists the hashes of the images in its prompt, in order.
    db.table("images").create(
        {"sha256": str, "png": bytes, "width": int, "height": int, "created_at": str},
        pk="sha256",
    )
    db.table("turns").add_column("images", str)  # JSON list of sha256; null for turns without images


@migrations(name="008_replays")
def replays(db: Database) -> None:
    # grpo.replay (store/replays.py): a stored successful episode that a later GRPO iteration trained
    # on again, in a group whose own episodes had no success.
    db.table("replays").create(
        {"id": int, "run": str, "iteration": int, "episode_id": int, "task_index": int, "created_at": str},
        pk="id",
        foreign_keys=[("run", "runs", "name"), ("episode_id", "episodes", "id")],
    )
    db.table("replays").create_index(["run", "iteration", "episode_id"], unique=True)


@migrations(name="009_run_error")
def run_error(db: Database) -> None:
    # Why the run's last command failed (`rlcli runs show`); null while it runs and once it is done.
    db.table("runs").add_column("error", str)


@migrations(name="010_episode_losses")
def episode_losses(db: Database) -> None:
    # An episode whose env was lost with a worker killed during another episode's call is played again
    # in its stage (engine/rollout.py): how many of its attempts were lost so, and how each earlier
    # attempt ended.
    db.table("episodes").add_column("lost", int, not_null_default=0)
    db.table("episodes").add_column("earlier_errors", str)


@migrations(name="011_tracker_steps")
def tracker_steps(db: Database) -> None:
    # The last step of each metrics series sent to run.trackers (engine/trackers.py): a step committed
    # here but not sent when a kill came (GRPO commits an iteration's metrics before its held-out eval,
    # and sends them after it) is sent when the series resumes.
    db.table("tracker_steps").create(
        {"run": str, "stage": str, "step": int},
        pk=("run", "stage"),
        foreign_keys=[("run", "runs", "name")],
    )


@migrations(name="012_stage_elapsed")
def stage_elapsed(db: Database) -> None:
    # The seconds a stage worked, summed over its runs: an eval stage asked again for more tasks at
    # the end of a run, or a stage resumed after Ctrl-C, spans hours of other work between its first
    # start and its last end. Null on rows of an older rlcli, whose duration is that span.
    db.table("stages").add_column("elapsed_s", float)


@migrations(name="013_branches")
def branches(db: Database) -> None:
    # grpo.branch (engine/grpo/branches.py): an episode played from a stored turn of another one, its
    # parent's actions before that turn replayed; null on every other episode.
    db.table("episodes").add_column("parent_episode_id", int)
    db.table("episodes").add_column("branch_turn", int)
    db.table("episodes").create_index(["parent_episode_id"])


@migrations(name="014_teacher_logprobs")
def teacher_logprobs(db: Database) -> None:
    # A distill phase's teacher judgement (engine/grpo/teacher.py): the teacher's logprob of every token a
    # turn sampled, in the context the student saw, written by stage teach/<i>; what train/<i> trains on.
    db.table("teacher_logprobs").create(
        {"episode_id": int, "turn_index": int, "stage": str, "logprobs": bytes},
        pk=("episode_id", "turn_index"),
        foreign_keys=[("episode_id", "episodes", "id")],
    )
