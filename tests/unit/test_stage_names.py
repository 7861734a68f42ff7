"""store/names.py: every stage name and policy reference rlcli writes is built and parsed in one place.

The literal names here are the stored form: existing run databases hold them, so they must not change.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import make_ctx, write_recipe
from rlcli.errors import UsageError
from rlcli.store.names import (
    BASE,
    BEST,
    EXPERT,
    LATEST,
    SFT,
    STAGE_FORMS,
    BranchStage,
    DpoStage,
    EvalStage,
    GrpoLabelStage,
    GrpoStage,
    LabelStage,
    PolicyRef,
    RolloutStage,
    SftStage,
    StageNameError,
    StaleStage,
    SupersededStage,
    TrainStage,
    UserStage,
    check_user_name,
    dpo_stage,
    eval_stage,
    grpo_label_stage,
    grpo_phase_stage,
    label_stage,
    parse_stage,
    rollout_stage,
    stage_family,
    stale_stage,
    train_stage,
    try_parse_stage,
)

# Every kind of stage: (stored name, typed record).
STAGES = [
    ("sft", SftStage()),
    ("sft/demos", SftStage(demos=True)),
    ("dpo", DpoStage()),
    ("dpo/2", DpoStage("2")),
    ("dpo/mine", DpoStage("mine")),
    ("grpo", GrpoStage()),
    ("grpo/3", GrpoStage(3)),
    ("rollout/0", RolloutStage(0)),
    ("rollout/12+2", RolloutStage(12, 2)),
    ("label/4", GrpoLabelStage(4)),
    ("label/4+1", GrpoLabelStage(4, 1)),
    ("label/default/rollout/3", LabelStage("default", "rollout/3")),
    ("label/7/mine", LabelStage("7", "mine")),
    ("label/x/eval/ckpt-7@t0.8-k4", LabelStage("x", "eval/ckpt-7@t0.8-k4")),
    ("label/default/stale/rollout/3/2", LabelStage("default", "stale/rollout/3/2")),
    ("train/9", TrainStage(9)),
    ("branch/4", BranchStage(4)),
    ("superseded/branch/4/1", SupersededStage("branch/4", 1)),
    ("eval/base", EvalStage(BASE)),
    ("eval/expert", EvalStage(EXPERT)),
    ("eval/ckpt-12", EvalStage(PolicyRef.checkpoint(12))),
    ("eval/ckpt-7@t0.8-k1", EvalStage(PolicyRef.checkpoint(7), 0.8, 1)),
    ("eval/base@t0-k4", EvalStage(BASE, 0.0, 4)),
    ("eval/base@t1e-05-k2", EvalStage(BASE, 1e-05, 2)),
    ("stale/rollout/3/1", StaleStage("rollout/3", 1)),
    ("mine", UserStage("mine")),
    ("rollout", UserStage("rollout")),
]


@pytest.mark.parametrize(("name", "record"), STAGES, ids=[name for name, _ in STAGES])
def test_every_stage_kind_round_trips(name, record):
    assert parse_stage(name) == record
    assert record.name == name


def test_the_builders_write_the_stored_names():
    assert rollout_stage(3) == "rollout/3" and rollout_stage(3, 2) == "rollout/3+2"
    assert grpo_label_stage(3) == "label/3" and grpo_label_stage(3, 1) == "label/3+1"
    assert label_stage("default", "rollout/3") == "label/default/rollout/3"
    assert train_stage(0) == "train/0"
    assert eval_stage(BASE) == "eval/base" and eval_stage(EXPERT, 0.0, 1) == "eval/expert"
    assert eval_stage(PolicyRef.checkpoint(7), 0.8, 1) == "eval/ckpt-7@t0.8-k1"
    assert eval_stage(PolicyRef.checkpoint(7), 1.0, 4) == "eval/ckpt-7@t1-k4"
    assert grpo_phase_stage(2) == "grpo/2"
    assert [dpo_stage(k) for k in range(3)] == ["dpo", "dpo/2", "dpo/3"]
    assert stale_stage("rollout/3", 1) == "stale/rollout/3/1"


MALFORMED = [
    "",
    "/",
    "rollout/",
    "rollout/x",
    "rollout/01",
    "rollout/-1",
    "rollout/1+0",
    "rollout/1+",
    "train/",
    "train/1+1",
    "grpo/0",
    "grpo/x",
    "dpo/",
    "dpo/a/b",
    "sft/x",
    "label/",
    "label/x",
    "label/x/",
    "label/x/a/b",
    "eval/",
    "eval/latest",
    "eval/ckpt-",
    "eval/ckpt-x",
    "eval/base@t0-k1",  # the greedy eval is eval/base
    "eval/base@tx-k1",
    "eval/base@t1-k0",
    "stale/1",
    "stale/rollout/3/0",
    "a/b",
]


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_name_is_rejected_with_one_clear_message(name):
    with pytest.raises(StageNameError) as info:
        parse_stage(name)
    assert str(info.value) == f"{name!r} is not a stage name rlcli writes; expected {STAGE_FORMS}."
    assert try_parse_stage(name) is None


# --- policy references --------------------------------------------------------------------------

POLICIES = [
    ("base", BASE),
    ("expert", EXPERT),
    ("sft", SFT),
    ("train/4", PolicyRef.train(4)),
    ("dpo", PolicyRef("dpo", stage="dpo")),
    ("dpo/2", PolicyRef("dpo", stage="dpo/2")),
    ("17", PolicyRef.checkpoint(17)),
]


@pytest.mark.parametrize(("stored", "ref"), POLICIES, ids=[s for s, _ in POLICIES])
def test_every_stored_policy_form_round_trips(stored, ref):
    assert PolicyRef.parse(stored) == ref
    assert str(ref) == stored


@pytest.mark.parametrize("stored", ["", "latest", "best", "train/x", "train/", "ckpt-3", "3/4", "rollout/0", "-1"])
def test_a_malformed_stored_policy_is_rejected(stored):
    with pytest.raises(StageNameError, match="is not a policy reference rlcli writes; expected base, expert, sft"):
        PolicyRef.parse(stored)


def test_the_cli_form_and_its_resolution():
    assert [PolicyRef.from_cli(s) for s in ("base", "sft", "latest", "best", "expert", "7")] == [
        BASE,
        SFT,
        LATEST,
        BEST,
        EXPERT,
        PolicyRef.checkpoint(7),
    ]
    assert not LATEST.resolved and not BEST.resolved and PolicyRef.checkpoint(7).resolved
    for text in ("train/3", "ckpt-7", "newest", ""):
        with pytest.raises(
            UsageError, match="Unknown checkpoint .*: expected base, sft, latest, best or a checkpoint id"
        ):
            PolicyRef.from_cli(text)


def test_the_weights_a_checkpoint_stage_wrote():
    assert PolicyRef.written_by("sft") == SFT
    assert PolicyRef.written_by("train/3") == PolicyRef.train(3)
    assert str(PolicyRef.written_by("dpo/2")) == "dpo/2"
    with pytest.raises(StageNameError, match="not a checkpoint's stage"):
        PolicyRef.written_by("rollout/3")


def test_reserved_names_and_families():
    for name in ("sft", "dpo", "grpo", "a/b", ""):
        with pytest.raises(UsageError, match="belong to rlcli's own stages"):
            check_user_name("--stage", name, reserved=("sft", "dpo", "grpo"))
    assert check_user_name("--stage", "mine", reserved=("sft", "dpo", "grpo")) == "mine"
    assert stage_family("rollout/3") == ("rollout", 3) and stage_family("label/x/rollout/3") == ("label/x/rollout", 3)
    assert stage_family("rollout/3+1") is None and stage_family("mine") is None


def test_no_other_module_builds_a_stage_name():
    """Stage names are built in store/names.py only (update.py's f"train/{k}" is a metric key)."""
    built = re.compile(r'f"(rollout|train|label|eval|grpo|dpo|stale|superseded|sft)/\{')
    src = Path(__file__).resolve().parents[2] / "src" / "rlcli"
    found = [
        f"{path.relative_to(src)}:{number}: {line.strip()}"
        for path in sorted(src.rglob("*.py"))
        if path.name != "names.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if built.search(line) and 'f"train/{k}"' not in line
    ]
    assert not found, "build these with rlcli.store.names:\n" + "\n".join(found)


# --- what a real run writes ------------------------------------------------------------------------


def test_every_name_a_short_run_writes_parses(tmp_path, monkeypatch):
    """A user rollout, `rlcli label`, GRPO (dynamic sampling, held-out evals sampled k=2) and an eval:
    every stage name in every table, and every episode's policy, parses."""
    from rlcli.engine.evaluate import run_eval
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.engine.labelling import run_label_stage
    from rlcli.engine.rollout import run_rollout_stage

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        grpo={"iterations": 2, "eval_every": 1, "dynamic_sampling": True, "max_rollout_rounds": 2},
        eval={"tasks": 1, "k": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    try:
        run_rollout_stage(ctx, stage="mine", policy="expert", split="train")
        run_grpo(ctx)
        run_label_stage(ctx, label_set="default")
        run_eval(ctx, ["base", "latest", "expert"])
        db = ctx.rundb.db
        names = {name for (name,) in db.execute("select name from stages")}
        for table in ("episodes", "checkpoints", "run_events", "metrics", "evals"):
            names |= {stage for (stage,) in db.execute(f"select stage from {table}")}
        policies = {policy for (policy,) in db.execute("select policy from episodes")}
    finally:
        ctx.rundb.close()
    parsed = {name: parse_stage(name) for name in names}
    kinds = {type(record) for record in parsed.values()}
    assert {UserStage, RolloutStage, GrpoLabelStage, LabelStage, TrainStage, EvalStage, GrpoStage} <= kinds, names
    assert any(isinstance(r, EvalStage) and r.k == 2 for r in parsed.values())
    assert {"mine", "rollout/0", "label/0", "train/1", "label/default/rollout/0", "grpo"} <= names
    refs = {PolicyRef.parse(policy) for policy in policies}  # the held-out evals play checkpoints by id
    assert {EXPERT, BASE, PolicyRef.train(0), PolicyRef.checkpoint(1)} <= refs, policies
