"""A fixed GRPO run on the CPU gives, bit for bit, the episodes, losses and checkpoints it gave before
the GRPO path was rearranged (issue 50: behaviour does not change when code moves).

Three small runs cover the synchronous loop's features (grpo.dynamic_sampling with over-sampling and an
extra rollout round, turn advantages over two-turn episodes, epochs, checkpoint_every, held-out evals
during training; grpo.replay with dr_grpo advantages and a KL term) and the asynchronous one
(grpo.max_staleness 1). Their
fingerprint (every episode's tokens, logprobs and reward, every train/ metric, every checkpoint's
tensors) is compared with tests/golden/grpo_fixed_runs.json, written by the code before the move:

    .venv/bin/python tests/stages/test_grpo_golden.py --write    # only when a change of behaviour is intended

The figures depend on the numerical libraries: with other versions of torch, transformers or peft than
the file records (CI installs torch pinned, the others at their newest), the test says so and skips,
and the file is written again with --write on the code it was written from.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from pathlib import Path

# As conftest.py sets them, for `--write` too: one torch thread, no hub (before torch is imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for helpers (run as a script by --write)

from helpers import run_in_process, write_env_file, write_recipe  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "grpo_fixed_runs.json"

# Two turns per episode: a first answer that earns nothing, then one scored by the parity of its
# characters; tasks 0, 3, 6, ... always score 0, so some groups have equal rewards (dynamic sampling
# and replay have something to do).
TWO_TURN_ENV = """
class TwoTurns:
    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return f"Task {seed}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return "Again.", 0.0, False, False, {}
        reward = 0.0 if self.seed % 3 == 0 else float(sum(map(ord, action)) % 2)
        return "Done.", reward, True, False, {"success": reward > 0}

def make_env():
    return TwoTurns()
"""

RUNS = {
    "sync": {
        "env": {"tasks": [0, 7]},  # a pool drawn from at random, so tasks come back and replays exist
        "rollout": {"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 8},
        "grpo": {
            "iterations": 4,
            "epochs": 2,
            "checkpoint_every": 2,
            "gamma": 0.9,
            "dynamic_sampling": True,
            "sampling": "uniform",
            "oversample": 2,
            "max_rollout_rounds": 2,
            "eval_every": 2,
            "eval_tasks": 2,
        },
    },
    "replay": {
        "env": {"tasks": [0, 5]},
        "rollout": {"tasks": 3, "group_size": 2, "max_new_tokens": 6, "batch_size": 6},
        "grpo": {
            "iterations": 4,
            "sampling": "uniform",
            "advantage": "dr_grpo",
            "beta": 0.04,
            "replay": {"min_reward": 1.0, "max_per_group": 1},
        },
    },
    "async": {
        "rollout": {"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
        "grpo": {"iterations": 3, "max_staleness": 1},
    },
}


def versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def fixed_run(folder: Path, name: str) -> dict:
    """Run RUNS[name] (`rlcli train grpo`) in `folder` and return its fingerprint."""
    env = write_env_file(folder / "two_turns.py", TWO_TURN_ENV)
    sections = {k: v for k, v in RUNS[name].items() if k != "env"}
    recipe = write_recipe(
        folder / f"{name}.yaml",
        run={"name": name, "seed": 3},
        env={"name": str(env), "max_turns": 2, **RUNS[name].get("env", {})},
        **sections,
    )
    runs = folder / "runs"
    done = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert done.returncode == 0, done.stderr
    return fingerprint(runs / "rlcli.db", name)


def fingerprint(db_path: Path, run: str) -> dict:
    """Episodes (stage, task, sample, policy, reward, each turn's tokens and logprobs), the train/ and
    eval/ metrics (timings left out) and each checkpoint's tensors, as digests."""
    from safetensors.torch import load_file

    db = sqlite3.connect(db_path)
    try:
        episodes = {}
        rows = db.execute(
            "select id, stage, task_index, sample_index, policy, status, env_return from episodes "
            "where run = ? order by stage, task_index, sample_index",
            (run,),
        ).fetchall()
        for episode_id, stage, task, sample, policy, status, ret in rows:
            turns = db.execute(
                "select prompt_ids, completion_ids, logprobs from turns where episode_id = ? order by turn_index",
                (episode_id,),
            ).fetchall()
            digest = hashlib.sha256(b"".join(bytes(part) for turn in turns for part in turn)).hexdigest()[:16]
            episodes[f"{stage}|{task}|{sample}"] = [policy, status, ret, len(turns), digest]
        metrics = {
            f"{stage}|{step}|{key}": value
            for stage, step, key, value in db.execute(
                "select stage, step, key, value from metrics where run = ? order by stage, step, key", (run,)
            )
            if key.startswith(("train/", "eval/", "rollout/reward"))
        }
        checkpoints = {}
        for stage, path in db.execute("select stage, path from checkpoints where run = ? order by id", (run,)):
            tensors = load_file(db_path.parent / path / "adapter_model.safetensors")  # relative to the runs folder
            digest = hashlib.sha256()
            for key in sorted(tensors):
                digest.update(key.encode() + tensors[key].contiguous().view(-1).numpy().tobytes())
            checkpoints[stage] = digest.hexdigest()[:16]
    finally:
        db.close()
    return {"episodes": episodes, "metrics": metrics, "checkpoints": checkpoints}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_fixed_run_is_bit_identical_to_the_golden_one(tmp_path, name):
    golden = json.loads(GOLDEN.read_text())
    if golden["versions"] != versions():
        pytest.skip(f"{GOLDEN.name} was written with {golden['versions']}, this is {versions()}")
    got, want = fixed_run(tmp_path, name), golden["runs"][name]
    for part in ("episodes", "metrics", "checkpoints"):
        differ = sorted(k for k in set(got[part]) | set(want[part]) if got[part].get(k) != want[part].get(k))
        assert not differ, f"{name}: {part} differ from the golden run at {differ[:5]} ({len(differ)} in all)"
    # The golden runs exercise what they are meant to: trained sequences, a refill round, replays.
    assert any(k.endswith("|train/sequences") and v > 0 for k, v in got["metrics"].items())
    if name == "sync":
        assert any(k.endswith("|train/rollout_rounds") and v > 1 for k, v in got["metrics"].items())
    if name == "replay":
        assert any(k.endswith("|train/replayed") and v > 0 for k, v in got["metrics"].items())


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/stages/test_grpo_golden.py --write   (writes tests/golden/grpo_fixed_runs.json)")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("RLCLI_MODELS", str(Path(tmp) / "models"))
        runs = {}
        for name in sorted(RUNS):
            (Path(tmp) / name).mkdir()
            runs[name] = fixed_run(Path(tmp) / name, name)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"versions": versions(), "runs": runs}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
