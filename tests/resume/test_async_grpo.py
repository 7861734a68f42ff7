"""Asynchronous GRPO (grpo.max_staleness, engine/grpo/worker.py): the synchronous loop unchanged at 0,
a rollout worker process sampling ahead at k > 0 with versions, staleness and decoupled-PPO weights,
and kill -9 of either process followed by a rerun."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import RLCLI, alive, cli_env, kill_when, make_ctx, run_in_process, sequence_logprobs, write_recipe
from rlcli.engine.grpo import sources, worker
from rlcli.engine.grpo.learner import GrpoTrainer
from rlcli.engine.grpo.loop import run_grpo
from rlcli.engine.grpo.staleness import STALE_EVENT, policy_version, staleness
from rlcli.engine.grpo.update import TrainSequence, update
from rlcli.engine.grpo.worker import thread_split
from rlcli.recipe import load_recipe
from rlcli.store.blobs import unpack_floats, unpack_ids
from rlcli.store.checkpoints import train_checkpoints
from rlcli.store.episodes import stage_episodes
from rlcli.store.events import list_events
from test_vllm_engine import needs_vllm, tiny64  # noqa: F401 (tiny64: a fixture)
from test_vllm_rollout import vllm_recipe

DIGITS = "def digits(completions, **kwargs):\n    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"
# Slow enough that a kill lands between stages, and that the worker is ahead of the trainer.
SLOW_DIGITS = "import time\n\n" + DIGITS.replace("    return", "    time.sleep(0.4)\n    return")


def _recipe(tmp_path, reward=DIGITS, **grpo):
    (tmp_path / "digit_reward.py").write_text(reward)
    return write_recipe(
        tmp_path / "r.yaml",
        # SYNC_TOKENS and SYNC_METRICS were recorded with the CPU's random streams; a GPU draws others.
        model={"device": "cpu"},
        rewards=[{"fn": f"{tmp_path / 'digit_reward.py'}:digits", "name": "digits"}],
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 8, "batch_size": 8, "temperature": 1.0},
        grpo={"iterations": 3, "lr": 3e-2, "epochs": 2, **grpo},
    )


def _query(db, sql: str, params=()) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def _metric(ctx, key: str) -> dict[int, float]:
    return {m.step: m.value for m in ctx.rundb.metrics(ctx.run, key)}


# --- max_staleness 0: today's loop -----------------------------------------------------------

# What `train grpo` produced on this recipe before asynchronous GRPO existed (commit f0197f3): a hash of
# every sampled token of every episode, and the update's statistics per iteration.
SYNC_TOKENS = "88560841ab16f46056bea161aa9ec465c9ee793ff8b74422d4c67cf5730bd230"
SYNC_METRICS = {
    "rollout/reward_mean": [0.06904761904761905, 0.062003968253968256, 0.027472527472527472],
    "train/loss": [-0.04150626063346863, -0.0090809166431427, -0.018230337649583817],
    "train/ratio_mean": [0.9934664368629456, 0.9923107326030731, 1.0003587007522583],
    "train/grad_norm": [0.24512630701065063, 0.31373539566993713, 0.1861482933163643],
    "train/entropy": [6.22331976890564, 6.224441766738892, 6.223953008651733],
    "train/clip_frac_low": [0.1015625, 0.09375, 0.0],
}


def _token_hash(ctx) -> str:
    rows = ctx.rundb.db.execute(
        "select e.stage, e.task_index, e.sample_index, e.policy, t.turn_index, hex(t.completion_ids) "
        "from episodes e join turns t on t.episode_id = e.id order by 1, 2, 3, 5"
    ).fetchall()
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_max_staleness_0_gives_the_synchronous_results(tmp_path, monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("max_staleness 0 must not start a rollout worker")

    monkeypatch.setattr(sources, "RolloutWorker", no_worker)
    ctx = make_ctx(_recipe(tmp_path, max_staleness=0), tmp_path / "runs")
    run_grpo(ctx)
    # If this fails after a change to sampling, the tiny model or the update, that change altered
    # synchronous GRPO's results: update the values only if it was meant to. The tokens are exact; the
    # statistics are float32 sums, which another processor adds in another order (the CPU of a lent
    # H100 machine put train/loss 3e-6 off, relatively), while a change to the update moves them more.
    assert _token_hash(ctx) == SYNC_TOKENS
    for key, values in SYNC_METRICS.items():
        assert [_metric(ctx, key)[i] for i in range(3)] == pytest.approx(values, rel=1e-4, abs=1e-7), key
    keys = {m.key for m in ctx.rundb.metrics(ctx.run)}
    assert not {"train/staleness_mean", "train/staleness_max", "train/discarded_episodes"} & keys


# --- k > 0 ------------------------------------------------------------------------------------


def test_async_run_samples_ahead_in_a_worker_and_records_versions(tmp_path):
    ctx = make_ctx(_recipe(tmp_path, max_staleness=1), tmp_path / "runs")
    run_grpo(ctx)

    # k = 1: rollout/j is played with train/j-2's weights, the starting point's for j <= 1.
    policies = {j: {e.policy for e in stage_episodes(ctx.store, f"rollout/{j}")} for j in range(3)}
    assert policies == {0: {"base"}, 1: {"base"}, 2: {"train/0"}}
    assert _metric(ctx, "train/staleness_mean") == {0: 0.0, 1: 1.0, 2: 1.0}
    assert _metric(ctx, "train/staleness_max") == {0: 0.0, 1: 1.0, 2: 1.0}
    # Decoupled PPO: fresh episodes weigh exactly 1, stale ones pi_prox / pi_behav (truncated at 2).
    weights = _metric(ctx, "train/tis_weight_mean")
    assert weights[0] == 1.0
    assert weights[1] != 1.0 and weights[2] != 1.0 and 0 < weights[1] <= 2

    stages = {s.name: s for s in ctx.rundb.stages(ctx.run)}
    assert all(stages[f"{kind}/{j}"].done for kind in ("rollout", "label", "train") for j in range(3))
    # The rollouts were played (and stored) by another process; the trainer labelled and trained.
    assert {stages[f"rollout/{j}"].pid for j in range(3)} != {os.getpid()}
    assert stages["train/0"].pid == os.getpid()
    for j in range(3):
        keys = [(e.task_index, e.sample_index) for e in stage_episodes(ctx.store, f"rollout/{j}")]
        assert sorted(keys) == [(t, s) for t in (2 * j, 2 * j + 1) for s in range(4)]
    assert not (ctx.run_dir / "policy").exists()  # weights-only pushes are removed at the end
    [first] = [c for c in train_checkpoints(ctx.store) if c.iteration == 0]
    assert _recorded_logprobs_match(ctx, "rollout/2", first.path)  # the worker loaded the pushed weights

    # The worker plays what the synchronous loop would with the same weights: rollout/0 is the same.
    (tmp_path / "sync").mkdir()
    sync = make_ctx(_recipe(tmp_path / "sync", iterations=1), tmp_path / "sync-runs")
    run_grpo(sync)
    tokens = (
        "select t.completion_ids from episodes e join turns t on t.episode_id = e.id "
        "where e.stage = 'rollout/0' order by e.task_index, e.sample_index, t.turn_index"
    )
    assert ctx.rundb.db.execute(tokens).fetchall() == sync.rundb.db.execute(tokens).fetchall()


def _recorded_logprobs_match(ctx, stage: str, weights) -> bool:
    """Whether `stage`'s stored logprobs are those of the weights in checkpoint folder `weights`."""
    from rlcli.models.loading import load_policy

    model, _ = load_policy(ctx.recipe.model, ctx.recipe.lora, ctx.recipe.quantization, adapter=weights, trainable=False)
    for episode in stage_episodes(ctx.store, stage):
        (turn,) = _query(
            ctx.rundb.path,
            "select prompt_ids, completion_ids, logprobs from turns where episode_id = ? and turn_index = 0",
            [episode.id],
        )
        prompt, completion = unpack_ids(turn[0]), unpack_ids(turn[1])
        recomputed = sequence_logprobs(model, prompt + completion, len(prompt))
        if not torch.allclose(recomputed, torch.tensor(unpack_floats(turn[2])), atol=1e-4):
            return False
    return True


@pytest.mark.slow
@needs_vllm
def test_a_vllm_worker_samples_with_the_pushed_weights(tmp_path, tiny64):  # noqa: F811
    (tmp_path / "digit_reward.py").write_text(DIGITS)
    recipe = vllm_recipe(
        tmp_path,
        tiny64,
        env={"name": "arithmetic", "max_turns": 1},
        lora={"r": 8, "alpha": 16},
        rewards=[{"fn": f"{tmp_path / 'digit_reward.py'}:digits", "name": "digits"}],
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 8, "batch_size": 8, "temperature": 1.0},
        grpo={"iterations": 3, "lr": 3e-2, "max_staleness": 1},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)
    policies = {j: {e.policy for e in stage_episodes(ctx.store, f"rollout/{j}")} for j in range(3)}
    assert policies == {0: {"base"}, 1: {"base"}, 2: {"train/0"}}
    assert _metric(ctx, "train/tis_weight_mean")[0] == 1.0
    assert _metric(ctx, "train/engine_logprob_gap")[0] < 1e-4  # the same weights in both processes
    # rollout/2 was sampled by the worker's engine with train/0's weights, pushed after that update.
    [first] = [c for c in train_checkpoints(ctx.store) if c.iteration == 0]
    assert _recorded_logprobs_match(ctx, "rollout/2", first.path)
    assert not _recorded_logprobs_match(ctx, "rollout/2", None)


def test_the_worker_takes_each_new_adapter_in_place_and_samples_as_a_fresh_load(tmp_path):
    from rlcli.models.loading import load_policy, save_checkpoint

    recipe = load_recipe(_recipe(tmp_path))
    # Two versions of the policy's adapter, as the trainer saves them after two updates.
    trained, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization)
    folders = []
    for version in range(2):
        torch.manual_seed(version)
        with torch.no_grad():
            for name, param in trained.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn_like(param) * 0.5)
        folders.append(str(save_checkpoint(trained, tokenizer, tmp_path / f"v{version}")))
    ids = torch.tensor([tokenizer("Compute 12 + 30.")["input_ids"]])

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()

    def fresh(folder):
        return load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=folder, trainable=False)[0]

    assert not torch.equal(logits(fresh(folders[0])), logits(fresh(folders[1])))
    loaded = worker.WorkerPolicy(recipe)
    loaded.load(None)
    base_model = loaded.model
    assert torch.equal(logits(base_model), logits(fresh(None)))
    for folder in [*folders, folders[0]]:  # back to the first: nothing of the second's merge is left
        loaded.load(folder)
        assert torch.equal(logits(loaded.model), logits(fresh(folder))), folder
        assert loaded.model.get_base_model() is base_model  # the adapter changed, the base model was not reloaded


def test_weights_between_checkpoints_reach_the_worker(tmp_path):
    ctx = make_ctx(_recipe(tmp_path, max_staleness=1, iterations=4, checkpoint_every=3), tmp_path / "runs")
    run_grpo(ctx)
    policies = {j: {e.policy for e in stage_episodes(ctx.store, f"rollout/{j}")} for j in range(4)}
    assert policies == {0: {"base"}, 1: {"base"}, 2: {"train/0"}, 3: {"train/1"}}
    assert [c.iteration for c in train_checkpoints(ctx.store)] == [2, 3]


def test_lowering_max_staleness_on_resume_sets_stale_rollouts_aside(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path, max_staleness=1)
    runs = tmp_path / "runs"
    real = GrpoTrainer.update

    def stop_at_2(trainer, batch):
        if batch.iteration == 2:  # rollout/2, sampled ahead with train/0's weights, is stored and not trained on
            raise RuntimeError("stopped")
        return real(trainer, batch)

    monkeypatch.setattr(GrpoTrainer, "update", stop_at_2)
    with pytest.raises(RuntimeError, match="stopped"):
        run_grpo(make_ctx(recipe, runs))
    monkeypatch.setattr(GrpoTrainer, "update", real)

    ctx = make_ctx(recipe, runs, ["grpo.max_staleness=0"])  # resume-safe: no --force needed
    before = {e.id for e in stage_episodes(ctx.store, "rollout/2")}
    run_grpo(ctx)
    aside = stage_episodes(ctx.store, "stale/rollout/2/1")
    assert {e.id for e in aside} == before and {e.policy for e in aside} == {"train/0"}
    replayed = stage_episodes(ctx.store, "rollout/2")
    assert len(replayed) == 8 and {e.policy for e in replayed} == {"train/1"}
    assert _metric(ctx, "train/discarded_episodes") == {2: 8.0}
    assert _metric(ctx, "train/sequences")[2] == 8  # the replayed episodes were labelled and trained on
    [event] = list_events(ctx.store, STALE_EVENT)
    assert event.iteration == 2 and event.details["episodes"] == 8


# --- the update's importance weights ----------------------------------------------------------


def _sequences(model, stale: bool, shift: float) -> list[TrainSequence]:
    """Two sequences of a 20-token prompt and 6 sampled tokens, whose recorded rollout logprobs are the
    model's own minus `shift` (as if sampled by weights that gave those tokens less probability)."""
    out = []
    for group, start in enumerate((30, 50)):
        ids = list(range(3, 23)) + list(range(start, start + 6))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, 19:-1].float()
        own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[20:], device=model.device)[:, None])[:, 0]
        mask = [0.0] * 20 + [1.0] * 6
        logps = [0.0] * 20 + (own - shift).tolist()
        seq = TrainSequence(group, group, ids, mask, logps, [0] * 26, advantage=[1.0 - 2 * group] * 26)
        seq.stale = stale
        out.append(seq)
    return out


@pytest.mark.parametrize(
    ("stale", "tis_cap", "expected"),
    [(False, None, 1.0), (True, None, 1.3498588), (True, 1.2, 1.2), (False, 1.2, 1.2)],
)
def test_stale_sequences_weigh_pi_prox_over_pi_behaviour(stale, tis_cap, expected):
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    torch.manual_seed(0)
    model, _ = load_policy(
        ModelSection(name="tiny-random", dtype="float32"),
        LoraSection(r=4, alpha=8),
        QuantizationSection(),
        trainable=True,
    )
    model.eval()
    sequences = _sequences(model, stale, shift=0.3)
    model.train()
    cap = "null" if tis_cap is None else tis_cap
    recipe = load_recipe(None, ["model.name=tiny-random", "grpo.max_staleness=1", f"grpo.tis_cap={cap}"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = update(SimpleNamespace(recipe=recipe), model, optimizer, scheduler, sequences, 0)
    # exp(0.3) = 1.3499: the proximal policy gives the tokens 0.3 nats more than the behaviour policy did.
    assert stats["train/tis_weight_mean"] == pytest.approx(expected, abs=1e-4)


# --- small pieces -----------------------------------------------------------------------------


def test_versions_staleness_and_thread_split():
    assert [policy_version(x) for x in ("train/4", "base", "sft", "3", "expert")] == [4, -1, -1, None, None]
    assert staleness(5, "train/4") == 0 and staleness(5, "train/2") == 2 and staleness(1, "base") == 1
    assert staleness(7, "checkpoint 3") == 0  # a label from before versions were read: never set aside
    assert [thread_split(n) for n in (1, 2, 3, 8)] == [(1, 1), (1, 1), (2, 1), (4, 4)]


# --- kill -9 --------------------------------------------------------------------------------


def _check_complete(runs, iterations: int, bound: int) -> None:
    db = runs / "rlcli.db"
    assert _query(db, "select count(*) from stages where name like 'train/%' and status = 'done'") == [(iterations,)]
    for j in range(iterations):
        keys = _query(db, "select task_index, sample_index from episodes where stage = ?", [f"rollout/{j}"])
        assert len(keys) == len(set(keys)) == 8, j  # none lost, none twice
        [(sequences,)] = _query(db, "select value from metrics where step = ? and key = 'train/sequences'", [j])
        [(labelled,)] = _query(
            db,
            "select count(*) from rewards r join episodes e on e.id = r.episode_id "
            "where e.stage = ? and r.component = 'total'",
            [f"rollout/{j}"],
        )
        assert labelled == 8 and sequences <= 8
    stale = _query(db, "select max(value) from metrics where key = 'train/staleness_max'")
    assert stale[0][0] <= bound


@pytest.mark.slow
def test_kill_the_trainer_then_rerun_reuses_rollouts_sampled_ahead(tmp_path):
    recipe = _recipe(tmp_path, reward=SLOW_DIGITS, max_staleness=1, iterations=5)
    runs = tmp_path / "runs"
    args = ["train", "grpo", "-r", str(recipe)]
    kill_when(args, runs, "select count(*) from stages where name = 'rollout/2' and status = 'done'", 1)
    db = runs / "rlcli.db"
    trained = {n for (n,) in _query(db, "select name from stages where name like 'train/%' and status = 'done'")}
    assert "train/4" not in trained, "the kill must land mid-run"
    ahead = {
        name: _query(db, "select id from episodes where stage = ? order by id", [name])
        for (name,) in _query(db, "select name from stages where name like 'rollout/%' and status = 'done'")
        if f"train/{name.split('/')[1]}" not in trained
    }
    assert ahead, "rollout/2 was sampled ahead of train/2"
    workers = {pid for (pid,) in _query(db, "select pid from stages where name like 'rollout/%'")}
    deadline = time.time() + 30  # PR_SET_PDEATHSIG kills it at once; a loaded machine may reap it late
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers), "the rollout worker must die with the trainer"

    done = run_in_process(args, runs)
    assert done.returncode == 0, done.stderr
    _check_complete(runs, 5, bound=1)
    for name, ids in ahead.items():  # reused, not played again
        assert _query(db, "select id from episodes where stage = ? order by id", [name]) == ids, name
    assert _query(db, "select count(*) from episodes where stage like 'stale/%'") == [(0,)]


@pytest.mark.slow
def test_kill_the_worker_stops_the_trainer_and_a_rerun_resumes(tmp_path):
    recipe = _recipe(tmp_path, reward=SLOW_DIGITS, max_staleness=1, iterations=5)
    runs = tmp_path / "runs"
    args = ["train", "grpo", "-r", str(recipe)]
    proc = subprocess.Popen(
        RLCLI + args, env=cli_env(runs), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    worker, deadline = None, time.time() + 180
    while worker is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
        try:
            rows = _query(runs / "rlcli.db", "select pid from stages where name = 'rollout/1' and status = 'done'")
        except sqlite3.Error:
            continue
        worker = rows[0][0] if rows else None
    assert worker is not None and worker != proc.pid
    os.kill(worker, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert "rollout worker process died" in stderr

    done = run_in_process(args, runs)
    assert done.returncode == 0, done.stderr
    _check_complete(runs, 5, bound=1)
