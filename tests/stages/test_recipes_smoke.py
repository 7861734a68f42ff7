"""Every shipped recipe runs end to end (all its stages) on the tiny model, scaled down."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import require_chromium
from helpers import REPO, make_ctx
from rlcli.engine.evaluate import eval_opponents
from rlcli.engine.pipeline import run_all

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
SMALL = [
    "model.name=tiny-random",
    "model.device=auto",  # the GPU recipes name cuda devices; auto is the CPU here
    "rollout.device=null",  # the same device as the model
    "model.max_length=1024",
    "sft.demos=4",
    "sft.batch_size=4",
    "sft.micro_batch_size=4",
    "grpo.iterations=1",
    "rollout.tasks=1",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "eval.tasks=2",
    "grpo.eval_tasks=2",  # the held-out evals during training (the GPU recipes take 128)
    "eval.k=1",
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_on_the_tiny_model(recipe: Path, tmp_path):
    first_line = recipe.read_text().splitlines()[0]
    assert first_line.startswith("#"), f"{recipe.name} must start with a comment giving its command"
    assert f"recipes/{recipe.name}" in recipe.read_text().split("\nrun:")[0]
    if "textarena" in recipe.read_text():
        pytest.importorskip("textarena")
    if "reasoning_gym" in recipe.read_text():
        pytest.importorskip("reasoning_gym")
    if "miniwob:" in recipe.read_text():
        pytest.importorskip("miniwob")
        require_chromium()
    # Screenshot environments need a vision-language model: the tiny one of the recipe's family.
    small = SMALL
    if "env:\n  name: gui_click" in recipe.read_text() or "observation: screenshot" in recipe.read_text():
        family = "qwen2.5-vl" if "Qwen2.5-VL" in recipe.read_text() else "vlm"
        small = [*SMALL, f"model.name=tiny-random-{family}"]
    # A coding task's first prompt (a project's failing tests) is ~1,200 tokens of the tiny model's 512-token
    # vocabulary, its template writing the tools' specs out too, where SmolLM2 takes ~250.
    if "env:\n  name: repair_tests" in recipe.read_text():
        small = [*small, "model.max_length=2048"]
    # A distillation recipe's teacher is another shipped run's result (run:quickstart), which a fresh
    # database lacks: the run's own SFT checkpoint teaches instead, through the same stages.
    if "\ndistill:\n  teacher: run:" in recipe.read_text():
        small = [*small, "distill.teacher=sft"]
    ctx = make_ctx(recipe, tmp_path / "runs", small)
    run_all(ctx)
    stages = {s.name: s.status for s in ctx.rundb.stages(ctx.run)}
    assert stages and all(status == "done" for status in stages.values()), stages
    evals = ctx.rundb.db["evals"].count
    checkpoints = {c for c in ctx.recipe.eval.checkpoints if c != "sft" or ctx.recipe.sft.source != "none"}
    assert evals == len(checkpoints) * len(eval_opponents(ctx.recipe)), "one eval per checkpoint and opponent"
