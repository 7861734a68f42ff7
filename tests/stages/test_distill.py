"""`rlcli train distill`: on-policy distillation, GRPO's loop with a teacher's per-token logprobs as the signal."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from helpers import cli, kill_at_event, make_ctx, run_in_process, sequence_logprobs, write_recipe
from rlcli.engine.grpo.loop import run_distill
from rlcli.errors import UsageError
from rlcli.models import loading
from rlcli.recipe import ModelSection, QuantizationSection
from rlcli.store.checkpoints import checkpoints
from rlcli.store.episodes import episodes_for_training
from rlcli.store.teacher import teacher_logprobs

TINY = ModelSection(name="tiny-random", dtype="float32")
DISTILL = dict(
    rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 8, "batch_size": 4, "temperature": 1.0},
    grpo={"iterations": 2, "lr": 1e-2},
    eval={"tasks": 0},
)


def make_teacher(folder, scale: float = 0.05):
    """A full model of the tiny family whose weights differ from the base's: its logprobs are another's."""
    torch.manual_seed(3)
    model, tokenizer = loading.load_policy(TINY, None, QuantizationSection(), trainable=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_teach_stores_the_teachers_logprob_of_every_sampled_token(tmp_path):
    teacher = make_teacher(tmp_path / "teacher")
    recipe = write_recipe(tmp_path / "r.yaml", **DISTILL, distill={"teacher": str(teacher)})
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_distill(ctx)

    model, _ = loading.load_policy(
        TINY.model_copy(update={"name": str(teacher)}), None, QuantizationSection(), trainable=False
    )
    for it in (0, 1):
        episodes = [e.episode for e in episodes_for_training(ctx.store, f"rollout/{it}", "grpo")]
        scored = teacher_logprobs(ctx.store, [e.id for e in episodes])
        assert len(scored) == sum(len(e.turns) for e in episodes)
        for e in episodes:
            for turn in e.turns:
                stored = scored[(e.id, turn.turn_index)]
                assert len(stored) == len(turn.completion_ids)
                expected = sequence_logprobs(model, turn.prompt_ids + turn.completion_ids, len(turn.prompt_ids))
                torch.testing.assert_close(torch.tensor(stored), expected, atol=1e-4, rtol=0)
    kl = [m.value for m in ctx.store.metrics("train/teacher_kl")]
    assert len(kl) == 2 and all(abs(v) > 1e-3 for v in kl)
    stage = ctx.store.stage("distill/0")
    assert stage.done and stage.params["teacher"]["model"] == str(teacher)
    assert [c.stage for c in checkpoints(ctx.store)] == ["train/0", "train/1"]


def test_a_teacher_equal_to_the_student_gives_no_signal_and_phases_number_on(tmp_path):
    # The student starts from the base model and samples at temperature 1: the base as teacher scores
    # every token as the sampler did, so the reverse KL and every advantage are ~0.
    recipe = write_recipe(
        tmp_path / "r.yaml",
        **{**DISTILL, "grpo": {"iterations": 1}},
        run={"name": "t", "stages": ["distill", "grpo"]},
        distill={"teacher": "base"},
    )
    done = run_in_process(["run", "-r", str(recipe)], tmp_path / "runs")
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(tmp_path / "runs" / "rlcli.db") as db:
        stages = {name for (name,) in db.execute("select name from stages where status = 'done'")}
        (kl,) = db.execute("select value from metrics where key = 'train/teacher_kl'").fetchone()
        assert db.execute("select count(*) from metrics where key = 'train/teacher_kl'").fetchone()[0] == 1
    assert {"distill/0", "grpo/1", "teach/0", "train/0", "train/1"} <= stages and "teach/1" not in stages
    assert abs(kl) < 1e-3

    # Phase 0 distilled: `rlcli train grpo` on the run says so instead of training it again.
    again = run_in_process(["train", "grpo", "-r", str(recipe)], tmp_path / "runs")
    assert again.returncode == 2 and "rlcli train distill" in again.stderr and "Traceback" not in again.stderr


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_is_written(tmp_path):
    teacher = make_teacher(tmp_path / "teacher")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<not-the-students>"])
    tokenizer.save_pretrained(teacher)
    recipe = write_recipe(tmp_path / "r.yaml", **DISTILL, distill={"teacher": str(teacher)})
    done = run_in_process(["train", "distill", "-r", str(recipe)], tmp_path / "runs")
    assert done.returncode == 2, done.stderr
    assert "share the student's tokenizer" in done.stderr and "Traceback" not in done.stderr
    db = tmp_path / "runs" / "rlcli.db"
    assert not db.exists() or not sqlite3.connect(db).execute("select count(*) from stages").fetchone()[0]


def test_recipes_that_cannot_distill_are_refused_in_one_sentence(tmp_path):
    from rlcli.recipe import load_recipe

    no_teacher = write_recipe(tmp_path / "a.yaml", run={"name": "t", "stages": ["distill"]})
    with pytest.raises(UsageError, match="distill.teacher"):
        load_recipe(no_teacher)
    dynamic = write_recipe(
        tmp_path / "b.yaml",
        run={"name": "t", "stages": ["distill"]},
        distill={"teacher": "best"},
        grpo={"iterations": 1, "dynamic_sampling": True},
    )
    with pytest.raises(UsageError, match="grpo.dynamic_sampling"):
        load_recipe(dynamic)


def _trained(runs):
    with sqlite3.connect(runs / "rlcli.db") as db:
        scored = db.execute(
            "select e.stage, e.task_index, e.sample_index, t.turn_index, hex(t.logprobs) from teacher_logprobs t "
            "join episodes e on e.id = t.episode_id order by 1, 2, 3, 4"
        ).fetchall()
        path = db.execute("select path from checkpoints order by id desc limit 1").fetchone()[0]
    from safetensors.torch import load_file

    return scored, load_file(f"{runs / path}/adapter_model.safetensors")


def test_a_kill_inside_a_teach_stage_resumes_to_the_same_scores_and_weights(tmp_path):
    teacher = make_teacher(tmp_path / "teacher")
    recipe = write_recipe(tmp_path / "r.yaml", **DISTILL, distill={"teacher": str(teacher)})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_in_process(["train", "distill", "-r", str(recipe)], clean).returncode == 0
    # Stopped at the first write after teach/1 began: the commit that would store its scores.
    began = "select count(*) from stages where name = 'teach/1'"
    kill_at_event(["train", "distill", "-r", str(recipe)], killed, {"sql": began, "at_least": 1}, timeout=300)
    with sqlite3.connect(killed / "rlcli.db") as db:
        assert (
            db.execute(
                "select count(*) from teacher_logprobs t join episodes e on e.id = t.episode_id "
                "where e.stage = 'rollout/1'"
            ).fetchone()[0]
            == 0
        )
    done = run_in_process(["train", "distill", "-r", str(recipe)], killed)
    assert done.returncode == 0, done.stderr
    (scored_a, weights_a), (scored_b, weights_b) = _trained(clean), _trained(killed)
    assert scored_a and scored_a == scored_b
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), key


def test_a_4bit_teacher_scores_close_to_its_dense_weights(tmp_path):
    teacher = make_teacher(tmp_path / "teacher")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        **{**DISTILL, "grpo": {"iterations": 1}},
        distill={"teacher": str(teacher), "quantization": "4bit"},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_distill(ctx)
    episodes = [e.episode for e in episodes_for_training(ctx.store, "rollout/0", "grpo")]
    scored = teacher_logprobs(ctx.store, [e.id for e in episodes])
    dense, _ = loading.load_policy(
        TINY.model_copy(update={"name": str(teacher)}), None, QuantizationSection(), trainable=False
    )
    gaps = []
    for e in episodes:
        for turn in e.turns:
            expected = sequence_logprobs(dense, turn.prompt_ids + turn.completion_ids, len(turn.prompt_ids))
            gaps.append((torch.tensor(scored[(e.id, turn.turn_index)]) - expected).abs())
    gap = torch.cat(gaps)
    assert torch.isfinite(gap).all() and 0 < gap.mean() < 0.5  # quantised: near its dense weights, not equal


def test_runs_show_and_plot_put_the_teachers_held_out_beside_the_student(tmp_path, capsys):
    runs = tmp_path / "runs"
    teacher = write_recipe(
        tmp_path / "teacher.yaml", run={"name": "teacher"}, grpo={"iterations": 1, "eval_every": 1, "eval_tasks": 2}
    )
    assert run_in_process(["train", "grpo", "-r", str(teacher)], runs).returncode == 0
    student = write_recipe(
        tmp_path / "student.yaml",
        **{**DISTILL, "grpo": {"iterations": 1}},
        run={"name": "student"},
        distill={"teacher": "run:teacher"},
    )
    assert run_in_process(["train", "distill", "-r", str(student)], runs).returncode == 0

    code, out, _ = cli(capsys, "--runs-dir", runs, "runs", "show", "student")
    assert code == 0
    words = " ".join(out.split())  # rich wraps at the console's width
    assert (
        "teacher of distill/0: run:teacher checkpoint 1; its held-out" in words and "stages done: distill 1/1" in words
    )
    assert "t-kl" in out
    code, out, _ = cli(capsys, "--runs-dir", runs, "runs", "plot", "student", "--out", tmp_path / "s.png", "--json")
    assert code == 0 and (tmp_path / "s.png").stat().st_size > 0
    assert "train/teacher_kl" in json.loads(out)["series"]
