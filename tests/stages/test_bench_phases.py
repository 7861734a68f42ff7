"""bench/phases.py's phases on a real run: the quickstart on the tiny model, SFT, GRPO and evals."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from helpers import REPO, run_in_process
from rlcli.store.db import RunDB


def _phases_module():
    spec = importlib.util.spec_from_file_location("bench_phases", REPO / "bench" / "phases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_phases_add_up_to_the_wall_clock(tmp_path):
    bench = _phases_module()
    runs = tmp_path / "runs"
    small = [
        "model.name=tiny-random",
        "sft.demos=4",
        "sft.batch_size=4",
        "sft.micro_batch_size=4",
        "grpo.iterations=2",
        "rollout.tasks=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        # The SFT and the best checkpoint are evaluated on 2 tasks during training, then again on 3 at the
        # end: stages run twice, whose rows span the GRPO iterations in between.
        "grpo.eval_every=1",
        "grpo.eval_tasks=2",
        "eval.tasks=3",
    ]
    start = time.perf_counter()
    done = run_in_process(["run", "-r", str(REPO / "recipes" / "quickstart.yaml"), *small], runs)
    wall_s = time.perf_counter() - start
    assert done.returncode == 0, done.stdout + done.stderr

    rundb = RunDB.open(runs)
    try:
        phases = {p.name: p.seconds for p in bench.phases(rundb, "quickstart", wall_s)}
        # From first start to last end: a stage run twice spans the GRPO iterations between its runs
        # (stages.elapsed_s, which duration_s now reads, does not).
        eval_spans_s = sum(
            bench._t(s.finished_at) - bench._t(s.started_at)
            for s in rundb.stages("quickstart")
            if s.name.startswith("eval/") and s.started_at and s.finished_at
        )
    finally:
        rundb.close()
    assert sum(phases.values()) == pytest.approx(wall_s)
    for name in ("SFT: expert demos", "SFT: training", "rollout: generation", "rollout: env steps", "update"):
        assert phases[name] > 0, (name, phases)
    assert {"labelling", "eval", "rollout: rest"} <= set(phases), phases
    assert "weight sync" not in phases  # the HF sampler: no vLLM engine to sync
    # Nothing overlaps in a synchronous run in one process: no row below zero, so the evals run twice
    # did not count the GRPO iterations between their two runs.
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert phases["eval"] < eval_spans_s  # the twice-run evals' spans, which hold GRPO iterations, were cut
    markdown = bench.markdown([bench.Phase(n, s) for n, s in phases.items()], wall_s, "t")
    assert markdown.count("\n| ") == len(phases) + 1  # the header and one line per phase
