"""A stage is its name and its defining parameters: the same name asked with other ones is refused."""

from __future__ import annotations

import pytest

from helpers import make_ctx, write_recipe
from rlcli.engine.context import RunContext
from rlcli.engine.labelling import run_label_stage
from rlcli.engine.rollout import run_rollout_stage
from rlcli.errors import UsageError
from rlcli.recipe import Recipe, load_recipe
from rlcli.store.db import RunDB
from rlcli.store.run_store import RunStore
from rlcli.store.stages import run_stage


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # start_run looks for a git sha in the cwd


@pytest.fixture
def rundb(tmp_path):
    db = RunDB.open(tmp_path / "runs")
    db.start_run("r1", Recipe(), None)
    yield db
    db.close()


@pytest.fixture
def store(rundb):
    return RunStore(rundb, "r1")


def test_a_done_stage_asked_with_other_parameters_is_refused_naming_them(store):
    run_stage(
        store,
        "s",
        lambda: {"n": 1},
        identity={"policy": "base", "split": "train"},
        new_stage_hint="hint",
    )
    with pytest.raises(UsageError) as info:
        run_stage(store, "s", lambda: pytest.fail("ran again"), identity={"policy": "3", "split": "train"})
    message = str(info.value)
    assert "'s'" in message and "policy='base'" in message and "policy='3'" in message and "split" not in message


def test_an_interrupted_stage_resumed_with_other_parameters_is_refused(rundb, store):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage(store, "s", interrupted, identity={"split": "train"})
    with pytest.raises(UsageError, match="split='train'.*split='eval'.*use another"):
        run_stage(
            store,
            "s",
            lambda: {},
            identity={"split": "eval"},
            new_stage_hint="use another --stage name",
        )
    assert rundb.stage("r1", "s").status == "failed"  # untouched


def test_parameters_that_may_grow_do_not_count(store):
    run_stage(store, "s", lambda: {"n": 1}, {"tasks": 2}, identity={"policy": "base"})
    assert run_stage(store, "s", lambda: {"n": 2}, {"tasks": 4}, identity={"policy": "base"}) == {"n": 1}


# --- the stage commands ---------------------------------------------------------


@pytest.fixture
def ctx(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    yield ctx
    ctx.rundb.close()


def test_rollout_base_then_latest_on_one_stage_is_refused(ctx):
    run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    run_rollout_stage(ctx, stage="rollout", policy="latest", split="train")  # no checkpoint: latest is base
    # A checkpoint appears (as `train grpo` records one): `latest` now names other weights.
    ctx.rundb.db["checkpoints"].insert(
        {"run": ctx.run, "stage": "train/0", "iteration": 0, "path": "x", "kind": "lora", "created_at": "now"}
    )
    with pytest.raises(UsageError, match="policy='base'.*--stage"):
        run_rollout_stage(ctx, stage="rollout", policy="latest", split="train")


def test_a_killed_rollout_resumed_with_another_split_or_policy_is_refused(ctx):
    # What a rollout killed half way leaves: a running stage (and some of its episodes).
    ctx.rundb.mark_stage(ctx.run, "rollout", "running", params={"policy": "expert", "split": "train"})
    with pytest.raises(UsageError, match="split='train'"):
        run_rollout_stage(ctx, stage="rollout", policy="expert", split="eval")
    with pytest.raises(UsageError, match="policy='expert'"):
        run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert ctx.rundb.stage(ctx.run, "rollout").status == "running"


def test_labelling_a_label_set_again_with_changed_rewards_is_refused(ctx, tmp_path):
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    run_label_stage(ctx, label_set="v1")
    changed = write_recipe(tmp_path / "r2.yaml", rewards=[{"fn": "env_return", "weight": 2.0}])
    forced = RunContext(load_recipe(changed, []), ctx.rundb, ctx.run, ctx.runs_dir)  # as --force would
    with pytest.raises(UsageError, match="label set 'v1'.*rewards.*--label-set"):
        run_label_stage(forced, label_set="v1")
    [summary] = run_label_stage(forced, label_set="v2")  # another label set labels beside v1
    assert summary.label_set == "v2"


def test_a_label_set_keeps_its_rewards_whatever_their_time_limit(ctx, tmp_path):
    # rewards[i].timeout_s may change on resume, and label sets stored before it existed lack it.
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    run_label_stage(ctx, label_set="v1")
    row = ctx.rundb.stage(ctx.run, "label/v1/rollout")
    params = {
        **row.params,
        "rewards": [{k: v for k, v in r.items() if k != "timeout_s"} for r in row.params["rewards"]],
    }
    ctx.rundb.mark_stage(ctx.run, row.name, "pending", params=params)  # as an older rlcli stored it
    slower = write_recipe(tmp_path / "r2.yaml", rewards=[{"fn": "env_return", "timeout_s": 5}])
    [summary] = run_label_stage(RunContext(load_recipe(slower, []), ctx.rundb, ctx.run, ctx.runs_dir), label_set="v1")
    assert summary.label_set == "v1" and summary.episodes > 0


@pytest.mark.parametrize("stage", ["rollout/0", "train/1", "eval/base", "sft", "a/b"])
def test_user_stage_names_in_rlcli_namespaces_are_refused(ctx, stage):
    with pytest.raises(UsageError, match="--stage"):
        run_rollout_stage(ctx, stage=stage, policy="expert", split="train")
    assert ctx.rundb.stage(ctx.run, stage) is None


@pytest.mark.parametrize("label_set", ["grpo", "a/b"])
def test_grpo_label_set_and_slashes_are_refused(ctx, label_set):
    run_rollout_stage(ctx, stage="rollout", policy="expert", split="train")
    with pytest.raises(UsageError, match="--label-set"):
        run_label_stage(ctx, label_set=label_set)


def test_sft_resumed_on_other_data_is_refused(ctx):
    from rlcli.engine.sft import run_sft

    ctx.rundb.mark_stage(ctx.run, "sft", "running", params={"source": "expert", "demos": 4})  # killed half way
    ctx.recipe.sft.source, ctx.recipe.sft.demos = "expert", 8
    with pytest.raises(UsageError, match="demos=4, not demos=8; use another --run"):
        run_sft(ctx)


class _Trained(Exception):
    """Stands for SFT's training: raised where the stage's work would begin."""


@pytest.mark.parametrize("folder", [False, True])
def test_sft_resumed_on_a_changed_data_file_is_refused(ctx, tmp_path, monkeypatch, folder):
    # The data's path was the stage's identity, not its content: a resume after the file changed
    # went on, half the epochs on the old rows and half on the new ones.
    import json

    from rlcli.engine import sft

    def write(answer: str) -> None:
        row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}]}
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "part.jsonl").write_text(json.dumps(row) + "\n")
        (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n")

    def train(ctx):
        raise _Trained

    monkeypatch.setattr(sft, "train_sft", train)
    write("4")
    ctx.recipe.sft.source = str(tmp_path / ("data" if folder else "data.jsonl"))
    with pytest.raises(_Trained):  # killed half way through its epochs
        sft.run_sft(ctx)
    with pytest.raises(_Trained):  # the same data resumes
        sft.run_sft(ctx)
    write("5")
    with pytest.raises(
        UsageError, match=r"was run with data_sha256='[0-9a-f]{12}.*not data_sha256=.*use another --run"
    ):
        sft.run_sft(ctx)
