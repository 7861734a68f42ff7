"""The VerIPO loop, run.stages [grpo, dpo, grpo]: the second GRPO phase numbers its iterations on from
the first, starts its first update from the DPO checkpoint's weights, and resumes after kill -9 to
the same result as a run that was never interrupted."""

from __future__ import annotations

import sqlite3

import pytest
import torch
from safetensors.torch import load_file

from helpers import kill_when, make_ctx, run_in_process, write_recipe
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe

PER_PHASE = 2


def _loop_recipe(tmp_path, **sections):
    # A reward that tells the random model's replies apart, so that GRPO's groups give DPO pairs.
    (tmp_path / "parity.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n"
    )
    return write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "seed": 0, "stages": ["grpo", "dpo", "grpo"]},
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16},
        rewards=[{"fn": f"{tmp_path / 'parity.py'}:score"}],
        grpo={"iterations": PER_PHASE, "lr": 1e-3},
        dpo={"batch_size": 2, "micro_batch_size": 2, "lr": 1e-3},
        **sections,
    )


def _adapter(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/adapter_model.safetensors")


def test_second_grpo_phase_starts_from_the_dpo_checkpoint_and_numbers_on(tmp_path, monkeypatch):
    import rlcli.engine.grpo.learner as learner
    from rlcli.engine.pipeline import run_all
    from rlcli.store.checkpoints import checkpoints

    # The trainable weights each iteration's first update starts from, as the checkpoint files name them.
    at_update: dict[int, dict[str, torch.Tensor]] = {}
    real_update = learner.update_policy

    def spying_update(ctx, model, optimizer, scheduler, sequences, it, *options):
        at_update[it] = {
            n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
        }
        return real_update(ctx, model, optimizer, scheduler, sequences, it, *options)

    monkeypatch.setattr(learner, "update_policy", spying_update)
    ctx = make_ctx(_loop_recipe(tmp_path), tmp_path / "runs")
    run_all(ctx)

    rows = {s.name: s for s in ctx.rundb.stages(ctx.run)}
    assert all(s.done for s in rows.values()), {n: s.status for n, s in rows.items()}
    for kind in ("rollout", "label", "train"):
        assert {n for n in rows if n.startswith(f"{kind}/")} == {f"{kind}/{i}" for i in range(2 * PER_PHASE)}
    dpo = rows["dpo"].result
    by_stage = {c.stage: c for c in checkpoints(ctx.store)}
    assert dpo["pairs"] > 0 and dpo["start"] == str(by_stage["train/1"].id)
    assert (
        rows["grpo/1"].params["first_iteration"] == PER_PHASE and rows["grpo/1"].params["start"] == dpo["checkpoint_id"]
    )
    # DPO mined the first phase's groups only: the second phase had not played yet.
    sources = ctx.rundb.db.execute("select distinct source_stage from dpo_pairs order by 1").fetchall()
    assert sources == [("rollout/0",), ("rollout/1",)]
    policies = dict(ctx.rundb.db.execute("select distinct stage, policy from episodes").fetchall())
    assert policies == {"rollout/0": "base", "rollout/1": "train/0", "rollout/2": "dpo", "rollout/3": "train/2"}

    # The second phase's first update starts from the DPO weights, not from the first phase's last.
    dpo_weights, grpo_last = _adapter(dpo["path"]), _adapter(by_stage["train/1"].path)
    assert at_update[PER_PHASE].keys() == dpo_weights.keys()
    for name, value in dpo_weights.items():
        assert torch.equal(at_update[PER_PHASE][name].cpu(), value), name
    assert any(not torch.equal(grpo_last[n], v) for n, v in dpo_weights.items()), "DPO must have moved the weights"
    assert sorted(at_update) == list(range(2 * PER_PHASE))

    # Run again: every stage is done, nothing is played or trained again.
    episodes = ctx.rundb.db["episodes"].count
    monkeypatch.setattr(learner, "update_policy", None)  # an update now would fail
    run_all(ctx)
    assert ctx.rundb.db["episodes"].count == episodes
    assert len(ctx.rundb.stages(ctx.run)) == len(rows)

    # The phases' iterations are fixed once the second has begun.
    ctx.recipe.grpo.iterations = 3
    with pytest.raises(UsageError, match=r"GRPO phase 1 runs iterations 2..3.*set grpo.iterations back to 2"):
        run_all(ctx)


def test_stage_lists_that_repeat(tmp_path):
    recipe = _loop_recipe(tmp_path)
    loop = load_recipe(recipe, ["run.stages=[grpo, dpo, grpo, dpo, grpo, eval]"])
    assert loop.run.stages.count("grpo") == 3
    with pytest.raises(UsageError, match="lists sft twice"):
        load_recipe(recipe, ["run.stages=[sft, grpo, sft]", "sft.source=expert"])
    with pytest.raises(UsageError, match="grpo more than once.*grpo.max_staleness: 0"):
        load_recipe(recipe, ["grpo.max_staleness=1"])
    from rlcli.store.names import dpo_stage

    assert [dpo_stage(k) for k in range(3)] == ["dpo", "dpo/2", "dpo/3"]


def _final_state(runs) -> dict[str, list]:
    """Everything the loop wrote that must not depend on a kill: weights, metrics, episodes, pairs."""
    with sqlite3.connect(runs / "rlcli.db") as conn:
        rows = {
            "stages": "select name, status from stages order by name",
            "checkpoints": "select stage, iteration from checkpoints order by id",
            "metrics": "select stage, step, key, value from metrics where key not like 'perf/%' order by 1, 2, 3",
            "episodes": "select e.stage, e.task_index, e.sample_index, e.policy, t.turn_index, t.completion_ids "
            "from episodes e join turns t on t.episode_id = e.id order by 1, 2, 3, 5",
            "pairs": "select stage, source_stage, task_index, turn_index, chosen_reward, rejected_reward from dpo_pairs "
            "order by 1, 2, 3",
        }
        state = {key: conn.execute(sql).fetchall() for key, sql in rows.items()}
        [(path,)] = conn.execute("select path from checkpoints order by id desc limit 1").fetchall()
    state["weights"] = _adapter(runs / path)
    return state


@pytest.fixture(scope="module")
def uninterrupted_loop(tmp_path_factory, session_models):
    """The loop's recipe and its run without a kill, which both kill tests compare with (read only)."""
    folder = tmp_path_factory.mktemp("loop")
    recipe = _loop_recipe(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLCLI_MODELS", str(session_models))
        done = run_in_process(["run", "-r", str(recipe)], folder / "clean")
        assert done.returncode == 0, done.stderr
    return recipe, folder / "clean"


@pytest.mark.parametrize(
    "kill_at",
    [
        # the second phase has begun (loading the DPO checkpoint, or playing its first rollout)
        "select count(*) from stages where name = 'grpo/1'",
        # in the middle of the second phase: its first iteration is trained, its second is not
        "select count(*) from stages where name = 'train/2' and status = 'done'",
    ],
    ids=["phase-start", "mid-phase"],
)
def test_kill_during_the_second_phase_resumes_to_the_uninterrupted_result(tmp_path, kill_at, uninterrupted_loop):
    recipe, clean = uninterrupted_loop
    killed = tmp_path / "killed"
    assert kill_when(["run", "-r", str(recipe)], killed, kill_at, 1) >= 1
    with sqlite3.connect(killed / "rlcli.db") as conn:
        left = conn.execute("select count(*) from stages where name = 'train/3' and status = 'done'").fetchone()[0]
    assert left == 0, "the kill must land before the second phase ends"
    done = run_in_process(["run", "-r", str(recipe)], killed)  # the resume: a new run of the command
    assert done.returncode == 0, done.stderr

    a, b = _final_state(clean), _final_state(killed)
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.allclose(a["weights"][name], b["weights"][name], atol=1e-6), name
    for key in ("stages", "checkpoints", "episodes", "pairs"):
        assert a[key] == b[key], key
    assert [m[:3] for m in a["metrics"]] == [m[:3] for m in b["metrics"]]
    for ma, mb in zip(a["metrics"], b["metrics"]):
        assert ma[3] == pytest.approx(mb[3], abs=1e-6), ma[:3]
