"""`rlcli train dpo`: preference pairs mined from stored groups (the shared-prefix cut included),
training that raises the chosen-over-rejected margin, the recorded pairs, and resume after kill -9."""

from __future__ import annotations

import json
import random
import sqlite3

import pytest
import torch

from helpers import REPO, cli, kill_at_event, make_ctx, run_in_process, sequence_logprobs, write_recipe
from rlcli.engine.dpo import run_dpo
from rlcli.engine.pairs import continuation, first_difference, mine_pairs, source_stages
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe
from rlcli.store.db import now
from rlcli.store.episodes import store_episodes, store_rewards
from rlcli.store.pairs import stage_pairs
from rlcli.store.records import EndReason, Episode, RewardRow, Turn

PROMPT = [11, 12, 13, 14]


def _turns(actions: list[list[int]], replies: list[list[int]]) -> list[Turn]:
    """Token-consistent turns: each prompt is the previous prompt + its reply + the env's answer."""
    turns, prompt = [], list(PROMPT)
    for index, action in enumerate(actions):
        turns.append(Turn(index, list(prompt), list(action), [-1.0] * len(action)))
        prompt = prompt + action + (replies[index] if index < len(replies) else [])
    return turns


def _store(ctx, task, sample, actions, reward, replies=(), stage="rollout/0", status="ok", label_set="grpo"):
    turns = _turns(actions, list(replies))
    store_episodes(
        ctx.rundb,
        [
            Episode(
                id=None,
                run=ctx.run,
                stage=stage,
                iteration=0,
                split="train",
                task_index=task,
                sample_index=sample,
                seed=task,
                policy="base",
                status=status,
                end_reason=EndReason.TERMINATED,
                env_return=reward,
                success=reward > 0,
                num_turns=len(turns),
                num_tokens=sum(len(a) for a in actions),
                task={},
                messages=[],
                template_consistent=True,
                error=None,
                created_at=now(),
                turns=turns,
            )
        ],
    )
    (episode_id,) = ctx.rundb.db.execute(
        "select id from episodes where stage = ? and task_index = ? and sample_index = ?", [stage, task, sample]
    ).fetchone()
    if status == "ok" and label_set is not None:
        store_rewards(ctx.rundb, [RewardRow(episode_id, label_set, "total", reward, 1.0)])
    return episode_id


# --- mining -----------------------------------------------------------------------------------------


def test_continuation_masks_env_tokens_and_stops_where_the_template_rewrote():
    turns = _turns([[1, 2], [3], [4, 5]], [[90, 91], [92]])
    assert continuation(turns, 0) == ([1, 2, 90, 91, 3, 92, 4, 5], [1, 1, 0, 0, 1, 0, 1, 1])
    assert continuation(turns, 1) == ([3, 92, 4, 5], [1, 0, 1, 1])
    rewritten = [*turns[:2], Turn(2, [99, *turns[2].prompt_ids[1:]], [4, 5], [0.0, 0.0])]
    assert continuation(rewritten, 0) == ([1, 2, 90, 91, 3], [1, 1, 0, 0, 1])
    assert first_difference(turns, _turns([[1, 2], [3], [7]], [[90, 91], [92]])) == 2
    assert first_difference(turns, _turns([[1, 2], [3], [4, 5]], [[90, 95], [92]])) is None  # the env parted first
    assert first_difference(turns, turns[:2]) is None  # the same actions, one episode shorter


def test_pairs_are_best_vs_worst_cut_at_the_first_differing_turn(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    env = [[80], [81]]
    # Task 0: the best (1.0) and the worst (0.0) play the same first turn, then part.
    best = _store(ctx, 0, 0, [[1, 2], [3, 4], [5]], 1.0, env)
    worst = _store(ctx, 0, 1, [[1, 2], [6]], 0.0, env)
    _store(ctx, 0, 2, [[7], [8]], 0.5, env)
    _store(ctx, 0, 3, [[9]], -1.0, status="failed")  # failed: never in a pair
    _store(ctx, 0, 4, [[9]], -1.0, label_set="other")  # not labelled under dpo.label_set
    # Task 1: rewards closer than the margin.
    _store(ctx, 1, 0, [[1]], 1.0)
    _store(ctx, 1, 1, [[2]], 0.8)
    # Task 2: a single episode is no group.
    _store(ctx, 2, 0, [[1]], 1.0)
    # Task 3: ties go to the lowest sample index; the pair differs at once.
    tie_best = _store(ctx, 3, 0, [[4]], 1.0)
    _store(ctx, 3, 1, [[5]], 1.0)
    tie_worst = _store(ctx, 3, 2, [[6]], 0.0)
    _store(ctx, 3, 3, [[7]], 0.0)
    # Task 4: the same action, answered differently by the env: nothing to prefer.
    _store(ctx, 4, 0, [[1], [2]], 1.0, [[80]])
    _store(ctx, 4, 1, [[1], [2]], 0.0, [[81]])
    # Another stage's group, which the source patterns below leave out.
    _store(ctx, 0, 0, [[1]], 1.0, stage="probe")
    _store(ctx, 0, 1, [[2]], 0.0, stage="probe")

    stages = source_stages(ctx.store, ["rollout/*"])
    assert stages == ["rollout/0"]
    report = mine_pairs(ctx.store, stages, "grpo", margin=0.5, max_pairs=None)
    assert (report.groups, report.below_margin, report.no_shared_prompt) == (4, 1, 1)
    first, second = report.pairs
    assert (first.task_index, first.chosen_episode_id, first.rejected_episode_id, first.turn_index) == (
        0,
        best,
        worst,
        1,
    )
    assert (first.chosen_reward, first.rejected_reward, first.source_stage) == (1.0, 0.0, "rollout/0")
    # The prompt is turn 1's: the shared first turn and the env's answer to it.
    assert first.prompt_tokens == len(PROMPT + [1, 2, 80])
    assert (first.chosen_tokens, first.rejected_tokens) == (len([3, 4, 81, 5]), len([6]))
    assert (second.task_index, second.chosen_episode_id, second.rejected_episode_id, second.turn_index) == (
        3,
        tie_best,
        tie_worst,
        0,
    )
    capped = mine_pairs(ctx.store, stages, "grpo", margin=0.5, max_pairs=1)
    assert capped.pairs == [first]
    assert len(mine_pairs(ctx.store, stages, "grpo", margin=0.1, max_pairs=None).pairs) == 3
    with pytest.raises(UsageError, match=r"dpo.source \['train/\*'\] matches no stage .* rollout/0, probe"):
        source_stages(ctx.store, ["train/*"])


# --- training -------------------------------------------------------------------------------------------


def _single_turn_groups(ctx, tasks: int) -> None:
    """Groups of two one-turn episodes with random replies, the first of each group rewarded."""
    rng = random.Random(0)
    for task in range(tasks):
        for sample in range(2):
            _store(ctx, task, sample, [[rng.randrange(20, 500) for _ in range(6)]], 1.0 - sample)


def _margins(model, ctx) -> float:
    """Mean log-likelihood margin of the chosen over the rejected continuation on the stage's pairs."""
    from rlcli.engine.dpo import pair_examples

    total = 0.0
    examples = pair_examples(ctx, stage_pairs(ctx.store, "dpo"))
    for e in examples:
        chosen = sequence_logprobs(model, e.prompt_ids + e.chosen_ids, len(e.prompt_ids)).sum()
        rejected = sequence_logprobs(model, e.prompt_ids + e.rejected_ids, len(e.prompt_ids)).sum()
        total += float(chosen - rejected)
    return total / len(examples)


def test_dpo_raises_the_chosen_over_rejected_margin_and_records_its_pairs(tmp_path):
    from rlcli.models.loading import load_policy

    recipe = write_recipe(
        tmp_path / "r.yaml", dpo={"lr": 5e-3, "epochs": 8, "batch_size": 4, "micro_batch_size": 2, "beta": 0.1}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    _single_turn_groups(ctx, 4)
    summary = run_dpo(ctx)
    assert (summary.stage, summary.start, summary.pairs, summary.steps) == ("dpo", "base", 4, 8)
    assert len(stage_pairs(ctx.store, "dpo")) == 4

    r = ctx.recipe
    base, _ = load_policy(r.model, r.lora, r.quantization, trainable=False)
    tuned, _ = load_policy(r.model, r.lora, r.quantization, adapter=summary.path, trainable=False)
    before, after = _margins(base, ctx), _margins(tuned, ctx)
    assert after > before + 1.0, (before, after)
    assert {m.key for m in ctx.rundb.metrics(ctx.run)} >= {"dpo/loss", "dpo/reward_margin", "dpo/lr"}
    # `latest` is now the DPO checkpoint; the stage is done and gives back its summary.
    from rlcli.store.checkpoints import resolve_checkpoint

    assert resolve_checkpoint(ctx.store, "latest").id == summary.checkpoint_id
    assert run_dpo(ctx) == summary
    # A second DPO stage starts from the first one's checkpoint.
    second = run_dpo(ctx, "dpo/2")
    assert second.start == str(summary.checkpoint_id) and second.pairs == 4


def test_no_pairs_leave_the_policy_as_it_is(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    _store(ctx, 0, 0, [[1]], 1.0)
    _store(ctx, 0, 1, [[2]], 0.75)  # closer than the margin
    summary = run_dpo(ctx)
    assert (summary.pairs, summary.steps, summary.checkpoint_id) == (0, 0, None)
    assert ctx.rundb.stage(ctx.run, "dpo").done and ctx.rundb.db["checkpoints"].count == 0


def test_dpo_mistakes_are_one_sentence(tmp_path):
    runs = tmp_path / "runs"
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), runs)
    with pytest.raises(UsageError, match="matches no stage of run 't' with episodes"):
        run_dpo(ctx)
    ctx.recipe.dpo.micro_batch_size = 3
    with pytest.raises(UsageError, match=r"dpo.batch_size \(8\) must be a multiple"):
        run_dpo(ctx)
    result = run_in_process(["train", "dpo", "-r", str(tmp_path / "r.yaml"), "--stage", "train/0"], runs)
    assert result.returncode == 2 and "expected dpo or dpo/<name>" in result.stderr


def test_nothing_to_mine_leaves_a_finished_run_as_it_was(tmp_path):
    """`train dpo` on a finished run with no episodes used to mark the run, and a dpo stage, failed."""
    runs = tmp_path / "runs"
    recipe = write_recipe(tmp_path / "r.yaml")
    ctx = make_ctx(recipe, runs)
    ctx.store.set_status("done")
    ctx.rundb.close()

    def rows() -> dict[str, list[tuple]]:
        with sqlite3.connect(runs / "rlcli.db") as conn:
            return {
                table: conn.execute(f"select * from {table} order by 1").fetchall()
                for table in ("runs", "run_recipes", "stages")
            }

    before = rows()
    result = run_in_process(["train", "dpo", "-r", str(recipe)], runs)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "dpo.source ['rollout/*'] matches no stage of run 't' with episodes" in lines[0]
    assert rows() == before


def test_dpo_on_a_vision_language_model_is_refused_before_any_stage_runs(tmp_path):
    """It used to train on the pairs' image tokens as plain tokens, the pixels never seen."""
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": "tiny-random-vlm"},
        env={"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2}},
        run={"name": "t", "seed": 0, "stages": ["sft", "dpo"]},
        sft={"source": "expert", "demos": 4},
    )
    runs = tmp_path / "runs"
    for args in (["run", "-r", str(recipe)], ["train", "dpo", "-r", str(recipe)]):
        result = run_in_process(args, runs)
        assert result.returncode == 2 and "rlcli's DPO trains text models only" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (runs / "t" / "checkpoints" / "sft").exists()  # refused before SFT ran


def test_kill_during_dpo_resumes_from_its_checkpoint(tmp_path, capsys, monkeypatch):
    # Two epochs of 8 steps. (Six, when the kill was a poll's and needed the time to land.)
    recipe = write_recipe(
        tmp_path / "r.yaml", dpo={"epochs": 2, "batch_size": 1, "micro_batch_size": 1, "save_steps": 3}
    )
    runs = tmp_path / "runs"
    ctx = make_ctx(recipe, runs)
    _single_turn_groups(ctx, 8)
    ctx.rundb.close()
    args = ["train", "dpo", "-r", str(recipe), "--json"]
    # Killed at its first database write after its first complete checkpoint (trainer_state.json last).
    checkpoint = {"glob": "checkpoint-*/trainer_state.json", "root": str(runs / "t" / "dpo")}
    kill_at_event(args, runs, checkpoint, timeout=300, cwd=REPO)

    monkeypatch.setenv("RLCLI_HOME", str(runs))
    code, out, err = cli(capsys, *args)  # the resume: a new run of the command, in this process
    assert code == 0, err
    assert "dpo: resuming from" in err
    summary = json.loads(out)
    assert summary["steps"] == 8 * 2 and summary["resumed_from_step"] == 3  # the first checkpoint's
    with sqlite3.connect(runs / "rlcli.db") as conn:
        pairs = conn.execute("select count(*) from dpo_pairs where stage = 'dpo'").fetchone()[0]
        loss_steps = [s for (s,) in conn.execute("select step from metrics where key = 'dpo/loss' order by step")]
        rows = conn.execute("select count(*) from checkpoints where stage = 'dpo'").fetchone()[0]
    assert pairs == 8 and rows == 1
    assert loss_steps == list(range(1, 17))  # steps redone after the kill overwrite their rows


def test_full_fine_tuning_dpo_trains_and_saves_a_full_model(tmp_path):
    """lora: null: the reference is a second, frozen copy of the starting model."""
    recipe = write_recipe(
        tmp_path / "r.yaml", lora=None, dpo={"lr": 1e-3, "epochs": 2, "batch_size": 2, "micro_batch_size": 2}
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    _single_turn_groups(ctx, 2)
    summary = run_dpo(ctx)
    assert summary.steps == 2
    from rlcli.store.checkpoints import checkpoints

    assert checkpoints(ctx.store)[-1].kind == "full"
    assert torch.isfinite(torch.tensor(summary.final_loss))


def test_the_collator_scores_only_the_sampled_tokens():
    from rlcli.engine.dpo import MaskedPreferenceCollator

    batch = MaskedPreferenceCollator(pad_token_id=0, max_length=6)(
        [
            {
                "prompt_ids": [5, 6],
                "chosen_ids": [1, 90, 2],
                "chosen_mask": [1, 0, 1],
                "rejected_ids": [3],
                "rejected_mask": [1],
            },
            {
                "prompt_ids": [7],
                "chosen_ids": [4, 91, 92, 8, 9, 9],
                "chosen_mask": [1, 0, 0, 1, 1, 1],
                "rejected_ids": [3],
                "rejected_mask": [1],
            },
        ]
    )
    assert batch["input_ids"].tolist()[0] == [5, 6, 1, 90, 2, 0]
    assert batch["completion_mask"].tolist() == [
        [0, 0, 1, 0, 1, 0],
        [0, 1, 0, 0, 1, 1],  # cut at max_length like the ids
        [0, 0, 1, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
    ]


def test_run_follows_run_stages_and_evaluates_the_dpo_checkpoint(tmp_path):
    from rlcli.engine.pipeline import run_all

    # A reward that tells the random model's replies apart, so that GRPO's groups give pairs.
    (tmp_path / "parity.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "seed": 0, "stages": ["grpo", "dpo", "eval"]},
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16},
        rewards=[{"fn": f"{tmp_path / 'parity.py'}:score"}],
        dpo={"batch_size": 2, "micro_batch_size": 2},
        eval={"tasks": 2, "checkpoints": ["latest"]},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    ending = run_all(ctx)
    names = [s.name for s in ctx.rundb.stages(ctx.run)]
    assert names.index("train/0") < names.index("dpo") < max(i for i, n in enumerate(names) if n.startswith("eval/"))
    dpo = ctx.rundb.stage(ctx.run, "dpo").result
    assert dpo["pairs"] > 0 and ending.latest.id == dpo["checkpoint_id"]
    [evaluated] = ctx.rundb.db.execute("select checkpoint_id from evals").fetchall()
    assert evaluated[0] == dpo["checkpoint_id"]
    with pytest.raises(UsageError, match="put dpo after grpo"):
        load_recipe(recipe, ["run.stages=[dpo, grpo]"])
