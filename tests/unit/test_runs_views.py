"""What a newcomer reads first (issue 56): `runs list | show | compare` lead with model, env, stages done
and held-out success; `runs plot` overlays runs and explains its panels; `runs episodes` finds the
policy's episodes, ordered and named as a reader means them; `runs export` nests JSON in JSONL. On the
run database that tests/unit/test_report.py builds by hand."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import cli
from rlcli.recipe import Recipe
from rlcli.report.views import held_out
from rlcli.store.db import DB_NAME, RunDB
from rlcli.store.records import EvalResult
from rlcli.store.run_store import RunStore
from test_report import make_run, stamp


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """demo and other (test_report's), and `lr` (demo with grpo.lr and rollout.temperature changed), built once."""
    folder = tmp_path_factory.mktemp("template")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)  # start_run records the git commit of the working directory: not the repository's
        rundb = RunDB.open(folder)
        make_run(rundb, "demo")
        make_run(rundb, "other", scale=0.5)
        recipe = Recipe()
        recipe.grpo.lr = 3e-5
        recipe.rollout.temperature = 1.2
        recipe.run.description = "hand-built for the report tests"
        rundb.start_run("lr", recipe, None)
        rundb.close()
    return folder / DB_NAME


@pytest.fixture
def runs_dir(rlcli_home, template_db, tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    rlcli_home.mkdir()
    shutil.copy(template_db, rlcli_home / DB_NAME)
    return rlcli_home


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    from rlcli.cli.common import console

    monkeypatch.setattr(console, "width", 160)


def add_episodes(
    runs_dir: Path,
    run: str,
    stage: str,
    outcomes: list[tuple[float, bool]],
    *,
    policy: str = "base",
    iteration: int | None = None,
    labelled: bool = True,
) -> list[int]:
    """Episodes of `stage`, one per (return, success), stored in that order; labelled: with a grpo total
    equal to the return (eval stages are not labelled)."""
    rundb = RunDB.open(runs_dir)
    ids = []
    try:
        with rundb.transaction() as db:
            for i, (ret, success) in enumerate(outcomes):
                row = {
                    "run": run,
                    "stage": stage,
                    "iteration": iteration,
                    "split": "eval" if stage.startswith("eval/") else "train",
                    "task_index": i,
                    "sample_index": 0,
                    "seed": i,
                    "policy": policy,
                    "status": "ok",
                    "end_reason": "terminated",
                    "env_return": ret,
                    "success": int(success),
                    "num_turns": 1,
                    "num_tokens": 1,
                    "task": json.dumps({"i": i}),
                    "messages": json.dumps([{"role": "assistant", "content": f"{stage} {i}"}]),
                    "template_consistent": 1,
                    "created_at": stamp(50),
                }
                episode = db["episodes"].insert(row).last_pk
                ids.append(episode)
                if labelled:
                    db["rewards"].insert(
                        {"episode_id": episode, "label_set": "grpo", "component": "total", "value": ret, "weight": None}
                    )
    finally:
        rundb.close()
    return ids


# --- runs list / show / compare: what a run is and how it did on held-out tasks ----------------------


def test_list_leads_with_model_env_stages_and_held_out_success(capsys, runs_dir):
    code, out, err = cli(capsys, "runs", "list", "--json")
    assert code == 0, err
    demo = next(r for r in json.loads(out) if r["name"] == "demo")
    assert demo["model"] == "smollm2-135m" and demo["env"] == "guess_number"
    # train/3 failed: three GRPO iterations of the recipe's 10 are done
    assert demo["stages_done"]["summary"] == "sft, grpo 3/10, 2 evals"
    held_out = demo["held_out"]
    assert held_out["label"] == "latest (#2)" and held_out["success_rate"] == pytest.approx(0.6)
    assert (held_out["ci_low"], held_out["ci_high"]) == (pytest.approx(0.45), pytest.approx(0.75))
    code, out, _ = cli(capsys, "runs", "list")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if "status" in line)
    # The last training iteration's numbers read as the run's result: they are not in the table.
    assert "model" in header and "held-out" in header and "train/loss" not in header
    at = next(i for i, line in enumerate(lines) if line.lstrip("│ ").startswith("demo"))
    row = lines[at] + lines[at + 1]  # a run's row is two lines: name over status, model over env, ...
    assert "smollm2-135m" in row and "guess_number" in row and "60% [45–75%]" in row and "latest (#2)" in row
    lr = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("lr "))
    assert "–" in lr  # not evaluated


def test_show_leads_with_model_env_stages_and_held_out_success(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "show", "demo", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"] == "smollm2-135m" and data["env"] == "guess_number"
    assert data["held_out"]["label"] == "latest (#2)" and data["stages_done"]["grpo_iterations"] == 3
    code, out, _ = cli(capsys, "runs", "show", "demo")
    lead = out.splitlines()[:3]
    assert any("smollm2-135m" in line and "guess_number" in line and "sft, grpo 3/10" in line for line in lead), lead
    assert any("held-out 60% [45–75%]" in line and "latest (#2)" in line for line in lead), lead


def test_a_run_whose_recorded_recipe_this_version_cannot_read_is_one_sentence(capsys, runs_dir):
    """A run recorded by another rlcli (a key since removed): `runs show` said "unexpected ValidationError"."""
    rundb = RunDB.open(runs_dir)
    recorded = json.loads(rundb.db.execute("select recipe from runs where name = 'demo'").fetchone()[0])
    recorded["grpo"]["old_knob"] = 1
    rundb.db.execute("update runs set recipe = ? where name = 'demo'", [json.dumps(recorded)])
    rundb.db.conn.commit()
    rundb.close()
    code, out, err = cli(capsys, "runs", "show", "demo")
    message = " ".join(err.split())
    assert code == 2 and not out and "Traceback" not in err and "unexpected" not in err, err
    assert message.startswith("Error: the recipe recorded with run 'demo': unknown key grpo.old_knob"), message
    assert "this version of rlcli cannot read it" in message
    assert "expected a run recorded by a compatible version" in message


def test_compare_shows_the_recipe_fields_that_differ_and_held_out_side_by_side(capsys, runs_dir):
    code, out, err = cli(capsys, "runs", "compare", "demo", "lr", "--json")
    assert code == 0, err
    demo, lr = json.loads(out)
    assert demo["recipe_differs"] == {"grpo.lr": 1e-5, "rollout.temperature": 1.0}
    assert lr["recipe_differs"] == {"grpo.lr": 3e-5, "rollout.temperature": 1.2}
    assert demo["held_out"]["success_rate"] == pytest.approx(0.6) and lr["held_out"] is None
    code, out, _ = cli(capsys, "runs", "compare", "demo", "lr")
    assert code == 0 and "recipe sha256" not in out
    lines = out.splitlines()
    lr_row = next(line for line in lines if "grpo.lr" in line)
    assert "1e-05" in lr_row and "3e-05" in lr_row
    assert any("rollout.temperature" in line and "1.2" in line for line in lines)
    held = next(line for line in lines if "held-out" in line)
    assert "60% [45–75%]" in held and "–" in held
    assert not any("run.name" in line or "run.description" in line for line in lines)  # the same in both


def test_plot_overlays_two_runs(capsys, runs_dir, tmp_path):
    png = tmp_path / "both.png"
    code, out, err = cli(capsys, "runs", "plot", "demo", "other", "--out", png, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["files"] == [str(png)] and [r["run"] for r in data["runs"]] == ["demo", "other"]
    demo, other = data["runs"]
    assert demo["series"]["rollout/reward_mean"]["values"] == pytest.approx([0.1, 0.4, 0.7])
    assert other["series"]["rollout/reward_mean"]["values"] == pytest.approx([0.05, 0.2, 0.35])
    assert [e["label"] for e in other["evals"]] == ["base", "latest (#4)"]
    assert png.read_bytes().startswith(b"\x89PNG")
    code, out, _ = cli(capsys, "runs", "plot", "demo", "other")  # default: beside the first run's curves
    assert code == 0 and Path(out.strip()) == runs_dir / "demo" / "vs-other.png"


# --- runs plot: panels that explain themselves -----------------------------------------------------


def test_plot_orders_eval_bars_base_sft_then_checkpoints(capsys, runs_dir, tmp_path):
    rundb = RunDB.open(runs_dir)
    try:
        latest = next(rundb.db["evals"].rows_where("run = 'demo' and checkpoint = 'latest'"))
        sft_id = next(rundb.db["checkpoints"].rows_where("run = 'demo' and stage = 'sft'"))["id"]
        # Stored after latest and base, as a later `rlcli eval -c sft` stores it.
        sft = {**latest, "stage": f"eval/ckpt-{sft_id}", "checkpoint": "sft", "checkpoint_id": sft_id}
        rundb.db["evals"].insert({k: v for k, v in sft.items() if k != "id"})
        rundb.db.execute("delete from evals where run = 'demo' and checkpoint = 'base'")
        base = {**latest, "stage": "eval/base", "checkpoint": "base", "checkpoint_id": None}
        rundb.db["evals"].insert({k: v for k, v in base.items() if k != "id"})
        rundb.db.conn.commit()
    finally:
        rundb.close()
    code, out, _ = cli(capsys, "runs", "plot", "demo", "--out", tmp_path / "p.png", "--json")
    assert code == 0 and [e["label"] for e in json.loads(out)["evals"]] == ["base", f"sft (#{sft_id})", "latest (#2)"]


def test_plot_leaves_out_the_kl_panel_without_a_kl_term(capsys, runs_dir, tmp_path):
    rundb = RunDB.open(runs_dir)
    try:
        rundb.db.execute("update metrics set value = 0 where run = 'demo' and key = 'train/kl'")  # grpo.beta 0
        rundb.db.conn.commit()
    finally:
        rundb.close()
    code, out, _ = cli(capsys, "runs", "plot", "demo", "--out", tmp_path / "p.png", "--json")
    series = json.loads(out)["series"]
    assert code == 0 and "train/kl" not in series and "train/loss" in series
    code, out, _ = cli(capsys, "runs", "plot", "other", "--out", tmp_path / "o.png", "--json")
    assert code == 0 and "train/kl" in json.loads(out)["series"]  # measured: drawn


def test_plot_marks_the_iterations_that_made_no_update(runs_dir):
    from rlcli.report.plot import run_figure

    rundb = RunDB.open(runs_dir)
    try:
        # Iteration 2 trained on nothing (every group had equal rewards): no loss, KL or entropy.
        rundb.db.execute("delete from metrics where run = 'demo' and step = 2 and key like 'train/%'")
        rundb.db.conn.commit()
        rundb.log_metrics("demo", "grpo", 2, {"train/skipped": 1.0})
        fig, drawn, _ = run_figure(RunStore(rundb, "demo"))
    finally:
        rundb.close()
    assert drawn["train/loss"]["steps"] == [0, 1]
    loss = next(ax for ax in fig.axes if ax.get_title() == "Policy loss")
    assert loss.get_xlim()[1] >= 2  # the axis reaches the last iteration, not the last that trained
    assert any("no update" in label for label in loss.get_legend_handles_labels()[1])


# --- runs episodes: the policy's, best and worst by what they scored, short stage names ------------


def test_episodes_default_to_the_policys_not_the_experts(capsys, rlcli_home):
    rundb = RunDB.open(rlcli_home)
    try:
        rundb.start_run("fresh", Recipe(), None)
    finally:
        rundb.close()
    add_episodes(rlcli_home, "fresh", "sft/demos", [(1.0, True)] * 6, policy="expert")
    mine = add_episodes(rlcli_home, "fresh", "rollout/0", [(0.0, False), (1.0, True)], iteration=0)
    code, out, err = cli(capsys, "runs", "episodes", "fresh", "--json")
    assert code == 0, err
    episodes = json.loads(out)
    assert {e["policy"] for e in episodes} == {"base"} and sorted(e["id"] for e in episodes) == mine
    code, out, _ = cli(capsys, "runs", "episodes", "fresh", "--stage", "sft/demos", "--json")
    assert code == 0 and {e["policy"] for e in json.loads(out)} == {"expert"}  # asked for by name
    rundb = RunDB.open(rlcli_home)
    try:
        rundb.start_run("demos-only", Recipe(), None)  # `rlcli rollout --policy expert` alone
    finally:
        rundb.close()
    add_episodes(rlcli_home, "demos-only", "demos", [(1.0, True)] * 2, policy="expert")
    code, out, _ = cli(capsys, "runs", "episodes", "demos-only", "--json")
    assert code == 0 and len(json.loads(out)) == 2  # the run has no others


def test_episodes_best_and_worst_break_ties_by_recency(capsys, runs_dir):
    # Four more iterations whose episodes all score 1.0: --best shows the newest of them, not iteration 3's.
    by_iteration = {
        it: add_episodes(runs_dir, "demo", f"rollout/{it}", [(1.0, True)] * 2, iteration=it) for it in range(3, 7)
    }
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--best", "-n", "2", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)] == by_iteration[6][::-1]
    low = {it: add_episodes(runs_dir, "demo", f"rollout/{it}", [(-1.0, False)], iteration=it) for it in (7, 8)}
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--worst", "-n", "2", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)] == [*low[8], *low[7]]


def test_worst_on_an_eval_stage_shows_failures_first(capsys, runs_dir):
    # Eval episodes are not labelled: they rank by their return, then success.
    ids = add_episodes(
        runs_dir, "demo", "eval/ckpt-2@t0.8-k1", [(1.0, True), (1.0, True), (0.0, False)], labelled=False
    )
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--stage", "eval/ckpt-2@t0.8-k1", "--worst", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)] == [ids[2], ids[1], ids[0]]
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--stage", "eval/ckpt-2@t0.8-k1", "--best", "-n", "1")
    assert code == 0 and "success yes" in out


def test_episodes_take_short_stage_names(capsys, runs_dir):
    base = add_episodes(runs_dir, "demo", "eval/base@t0.8-k1", [(0.0, False)], labelled=False)
    newest = add_episodes(runs_dir, "demo", "eval/ckpt-2@t0.8-k1", [(1.0, True)], labelled=False)
    code, out, err = cli(capsys, "runs", "episodes", "demo", "--stage", "eval", "--json")
    assert code == 0, err
    assert [e["id"] for e in json.loads(out)] == newest
    # Which stage a short name chose is said on stderr, and stdout stays JSON.
    assert "eval/ckpt-2@t0.8-k1" in err and "newest" in err
    code, out, err = cli(capsys, "runs", "episodes", "demo", "--stage", "eval/base", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)] == base and "eval/base@t0.8-k1" in err
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--stage", "rollout", "--json")
    assert code == 0 and {e["stage"] for e in json.loads(out)} == {"rollout/2"}
    # A prefix ends where a name's part does: eval/ckpt-2 is not eval/ckpt-25.
    add_episodes(runs_dir, "demo", "eval/ckpt-25", [(1.0, True)], labelled=False)
    code, out, err = cli(capsys, "runs", "episodes", "demo", "--stage", "eval/ckpt-2", "--json")
    assert code == 0 and {e["stage"] for e in json.loads(out)} == {"eval/ckpt-2@t0.8-k1"}
    code, _, err = cli(capsys, "runs", "episodes", "demo", "--stage", "evil")
    assert code == 2 and "stages with episodes: rollout/0" in err and len(err.strip().splitlines()) == 1


def test_stage_names_tab_complete(runs_dir, monkeypatch, capfd):
    """As bash asks for them (the script `rlcli --show-completion bash` prints): the run's stages with
    episodes, and the short names they begin."""
    from rlcli.cli.app import main

    add_episodes(runs_dir, "demo", "eval/base@t0.8-k1", [(0.0, False)], labelled=False)

    def complete(words: str) -> list[str]:
        monkeypatch.setenv("_RLCLI_COMPLETE", "complete_bash")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", str(len(words.split(" ")) - 1))
        with pytest.raises(SystemExit) as exit_:
            main([])
        out, err = capfd.readouterr()
        assert exit_.value.code == 0, err
        return out.split()

    assert complete("rlcli runs episodes demo --stage ev") == ["eval", "eval/base", "eval/base@t0.8-k1"]
    assert complete("rlcli runs episodes demo --stage rollout/") == ["rollout/0", "rollout/1", "rollout/2"]
    assert complete("rlcli runs episodes ghost --stage ") == []  # no such run: nothing, and no error
    monkeypatch.setenv("RLCLI_HOME", os.fspath(runs_dir / "nowhere"))
    assert complete("rlcli runs episodes demo --stage ") == []


# --- runs export, runs list without a database ---------------------------------------------------------


def test_jsonl_export_nests_the_json_columns(capsys, runs_dir, tmp_path):
    code, _, err = cli(capsys, "runs", "export", "demo", "--out", tmp_path / "x")
    assert code == 0, err
    episode = json.loads((tmp_path / "x" / "episodes.jsonl").read_text().splitlines()[0])
    assert episode["messages"][0] == {"role": "system", "content": "Answer with a number."}
    assert episode["task"] == {"a": 0, "b": 0}
    turn = json.loads((tmp_path / "x" / "turns.jsonl").read_text().splitlines()[0])
    assert turn["observation"] == [] and turn["info"] == {}
    evals = [json.loads(line) for line in (tmp_path / "x" / "evals.jsonl").read_text().splitlines()]
    assert evals[0]["details"] == {"failed_episodes": 0}


def test_list_without_a_database_creates_none(capsys, tmp_path):
    code, out, err = cli(capsys, "--runs-dir", tmp_path / "nowhere", "runs", "list")
    assert code == 0 and out == "" and "No runs in" in err
    assert not (tmp_path / "nowhere").exists()


def _eval(checkpoint: str, checkpoint_id: int, success: float, eval_id: int) -> EvalResult:
    return EvalResult(
        id=eval_id,
        run="r",
        stage=f"eval/{checkpoint}@t0.8-k1",
        checkpoint=checkpoint,
        checkpoint_id=checkpoint_id,
        split="eval",
        tasks=96,
        k=1,
        success_rate=success,
        ci_low=success - 0.1,
        ci_high=success + 0.1,
        mean_return=success,
        pass_at_k=success,
        avg_at_k=success,
        mean_turns=1.0,
        mean_tokens=1.0,
        details={},
        created_at=stamp(eval_id),
    )


def test_the_held_out_result_of_a_keep_best_run_is_its_best_checkpoint():
    # With grpo.keep_best the run's result is `best` (#25), which `rlcli run` evaluates beside `latest`
    # (#33): the newer, larger checkpoint id must not win the run's headline.
    results = [_eval("best", 25, 0.79, 1), _eval("latest", 33, 0.55, 2)]
    assert held_out(results, keep_best=True).label == "best (#25)"
    assert held_out(results, keep_best=False).label == "latest (#33)"
