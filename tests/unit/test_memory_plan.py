"""The GPU memory plan (generation/memory_plan.py, `rlcli recipes plan`): the model's shape from its
config, the parts against what torch and bitsandbytes really allocate on this CPU, the choices it makes
for `auto`, the engine options it hands vLLM, and the refusals before any stage writes anything.

A GPU machine is imitated by a fake `nvidia-smi` on the PATH: the plan reads the card from it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from helpers import REPO, cli, write_recipe

GPU_RECIPES = [
    "gpu_1x",
    "gpu_2x",
    "gpu_7b_qlora",
    "gui_click_vlm",
    "miniwob_screenshot_gpu",
    "multihop_search_gpu",
    "repair_tests_gpu",
    "tictactoe_selfplay_gpu",
]


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """Put an `nvidia-smi` on the PATH that lists the given cards (name, MiB, compute capability)."""
    from rlcli.generation import memory_plan

    def install(*cards: tuple[str, int, str]) -> None:
        rows = "\n".join(f"{i}, GPU-{i:04d}, {name}, {mib}, {cap}" for i, (name, mib, cap) in enumerate(cards))
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        smi = folder / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{rows}\nEOF\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
        memory_plan.visible_gpus.cache_clear()

    yield install
    memory_plan.visible_gpus.cache_clear()


def load(path: Path, *overrides: str):
    from rlcli.recipe import load_recipe, recipe_file

    return load_recipe(recipe_file(path), list(overrides))


def card(gb: float = 24, capability: float | None = 8.9):
    from rlcli.generation.memory_plan import Card

    return Card(f"{gb:g} GB GPU", int(gb * 1e9), capability)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("smollm2-135m", 134.5e6),
        ("Qwen/Qwen2.5-1.5B-Instruct", 1.54e9),
        ("Qwen/Qwen2.5-3B-Instruct", 3.09e9),
        ("Qwen/Qwen2.5-7B-Instruct", 7.62e9),
        ("Qwen/Qwen2.5-VL-3B-Instruct", 3.75e9),
    ],
)
def test_known_shapes_have_their_published_parameter_counts(name, published):
    from rlcli.generation.memory_plan import KNOWN_SHAPES, ModelShape

    shape = ModelShape.from_config(KNOWN_SHAPES[name])
    assert shape.params == pytest.approx(published, rel=0.01)


def test_the_plan_s_weights_match_what_the_loaded_policy_holds(tmp_path):
    """Dense and 4-bit (bitsandbytes on this CPU), from the tiny model's config.json."""
    from rlcli.generation.memory_plan import _Layout, model_shape
    from rlcli.models.loading import load_policy

    for mode, dtype in (("none", "bfloat16"), ("4bit", "auto")):
        recipe = load(
            write_recipe(tmp_path / f"{mode}.yaml", model={"name": "tiny-random", "dtype": dtype}),
            f"quantization.mode={mode}",
        )
        model, _ = load_policy(recipe.model, recipe.lora, recipe.quantization)
        base = model.get_base_model()
        held = sum(
            t.numel() * t.element_size()
            for name, t in [*base.named_parameters(), *base.named_buffers()]
            if "lora_" not in name and "rotary" not in name
        )
        shape, _ = model_shape(recipe.model.name)
        planned = _Layout(recipe, shape, card(), 1).weights()
        assert planned == pytest.approx(held, rel=0.1), mode


def test_activations_per_token_match_what_autograd_keeps():
    """The plan's 37 x hidden + 10 x intermediate bytes a token a layer (bfloat16), against the tensors a
    Qwen2 layer with LoRA on every linear layer saves for its backward (bench/plan_calibration.py's count),
    at a width the suite can afford."""
    import importlib.util

    from rlcli.generation.memory_plan import ModelShape

    spec = importlib.util.spec_from_file_location("plan_calibration", REPO / "bench" / "plan_calibration.py")
    calibration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibration)
    hidden, inner, tokens = 256, 1024, 64
    shape = (hidden, inner, 4, 2)
    measured = (
        calibration.saved_bytes(shape, 3, tokens, False) - calibration.saved_bytes(shape, 2, tokens, False)
    ) / tokens
    config = dict(hidden_size=hidden, intermediate_size=inner, num_attention_heads=4, num_key_value_heads=2)
    planned = ModelShape.from_config({**config, "vocab_size": 1024, "num_hidden_layers": 1})
    assert planned.activation_bytes_per_token(2, checkpointing=False) == pytest.approx(measured, rel=0.15)


def test_a_7b_qlora_recipe_fits_24gb_only_with_vllm_in_fp8(tmp_path, capsys):
    code, out, err = cli(capsys, "recipes", "plan", "gpu_7b_qlora", "--gpu-gb", "24", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["choices"]["vllm_quantization"] == "fp8"
    rollout = next(s for s in plan["stages"] if s["stage"] == "rollout")
    assert rollout["peak_gb"] <= 24 and rollout["parts_gb"]["vLLM weights"] < 9

    code, out, err = cli(
        capsys,
        "recipes",
        "plan",
        "gpu_7b_qlora",
        "--gpu-gb",
        "24",
        "rollout.engine=vllm",
        "rollout.vllm_quantization=none",
    )
    assert code == 2
    refusals = [line for line in err.splitlines() if line.startswith("✗")]
    assert refusals[0].startswith("✗ rollout: vLLM needs") and "rollout.vllm_quantization: fp8" in refusals[0]
    assert "Traceback" not in err
    assert "peak" in out  # the table still shows where the memory goes


@pytest.mark.parametrize("gb", [24, 80])
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_shipped_gpu_recipe_fits_24_and_80_gb_cards(capsys, name, gb):
    code, out, err = cli(capsys, "recipes", "plan", name, "--gpu-gb", str(gb), "--gpus", "2", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["fits"], plan["problems"]
    for stage in plan["stages"]:
        assert 0 < stage["peak_gb"] <= gb * 0.95
        assert stage["peak_gb"] == pytest.approx(sum(stage["parts_gb"].values()), abs=0.05)


def test_the_plan_without_a_gpu_asks_for_the_card(capsys, fake_gpus):
    fake_gpus()  # nvidia-smi lists no GPU
    code, _, err = cli(capsys, "recipes", "plan", "gpu_1x")
    assert code == 2 and "--gpu-gb" in err and "Traceback" not in err


def test_a_kv_cache_in_bytes_becomes_the_share_vllm_is_given():
    """rollout.vllm_memory above 1 used to reach vLLM as gpu_memory_utilization 0.9, which fails its
    free-memory check beside a resident trainer."""
    from rlcli.generation.memory_plan import plan_memory

    plan = plan_memory(load("gpu_1x", "rollout.vllm_memory=2000000000"), ["grpo"], card(24))
    engine = next(s for s in plan.stages if s.stage == "rollout").parts
    share = plan.choices.vllm_memory
    assert plan.fits and plan.choices.kv_cache_bytes == 2_000_000_000
    fixed = engine["vLLM weights"] + engine["vLLM profiling peak"] + engine["vLLM CUDA graphs"]
    assert (fixed + 2e9) / 24e9 <= share < 0.5


def test_a_share_beyond_what_is_free_beside_the_trainer_is_refused_with_the_largest_that_fits():
    from rlcli.generation.memory_plan import plan_memory

    plan = plan_memory(load("gpu_7b_qlora", "rollout.vllm_memory=0.9"), ["grpo"], card(24))
    assert not plan.fits
    assert "rollout.vllm_memory 0.9 asks vLLM for" in plan.problems[0] and "at most 0.67" in plan.problems[0]


def test_auto_settings_follow_the_card_and_the_sync_mode():
    from rlcli.generation.memory_plan import plan_memory

    merged = plan_memory(load("gpu_1x"), ["grpo"], card(80, 9.0)).choices
    assert (merged.engine, merged.vllm_quantization, merged.sleep_level) == ("vllm", "fp8", 2)
    adapter = plan_memory(load("gpu_1x", "rollout.vllm_sync=adapter"), ["grpo"], card(80, 9.0)).choices
    assert adapter.sleep_level == 1  # adapter sync serves LoRA over the base weights: they must come back
    ampere = plan_memory(load("gpu_1x"), ["grpo"], card(24, 8.6)).choices
    assert ampere.vllm_quantization == "none" and any("no FP8" in why for why in ampere.why)
    forced = plan_memory(load("gpu_1x", "rollout.vllm_quantization=fp8"), ["grpo"], card(24, 8.6))
    assert "no FP8 arithmetic" in forced.problems[0]
    two = plan_memory(load("gpu_2x"), ["grpo"], card(24), gpus=2)
    assert two.choices.sleep_level is None  # the engine has cuda:0 to itself
    assert {(s.stage, s.device) for s in two.stages} == {
        ("rollout", "cuda:0"),
        ("rollout", "cuda:1"),
        ("update", "cuda:1"),
    }
    one = plan_memory(load("gpu_2x"), ["grpo"], card(24), gpus=1)
    assert "cuda:1: the recipe uses cuda:1 but the plan has 1 GPU" in one.problems[0]


def test_auto_engine_is_the_hf_sampler_where_vllm_cannot_fit():
    from rlcli.generation.memory_plan import plan_memory

    plan = plan_memory(
        load("gpu_7b_qlora", "rollout.vllm_quantization=none", "rollout.batch_size=16"), ["grpo"], card(24)
    )
    assert (
        plan.choices.engine == "hf" and "the HF sampler, because vLLM's 16.92 GB (dense weights" in plan.choices.why[0]
    )
    assert plan.fits


def test_nvidia_smi_gives_the_cards_cuda_visible_devices_chooses(fake_gpus, monkeypatch):
    from rlcli.generation.memory_plan import visible_gpus

    fake_gpus(("NVIDIA H100 80GB HBM3", 81559, "9.0"), ("NVIDIA L4", 23034, "8.9"))
    assert [c.name for c in visible_gpus()] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    for visible, names in (("1", ["NVIDIA L4"]), ("GPU-0001,0", ["NVIDIA L4", "NVIDIA H100 80GB HBM3"]), ("", [])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        visible_gpus.cache_clear()
        assert [c.name for c in visible_gpus()] == names
    visible_gpus.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus()[0].total_bytes == 23034 * 2**20 and visible_gpus()[0].capability == 8.9


def test_vllm_gets_the_plan_s_share_weights_sleep_level_and_bounds_on_a_gpu(tmp_path, fake_gpus):
    from rlcli.generation.memory_plan import plan_memory, visible_gpus
    from rlcli.generation.vllm_engine import VLLM_FP8, engine_options

    fake_gpus(("NVIDIA L4", 23034, "8.9"))
    recipe = load(
        write_recipe(tmp_path / "r.yaml", model={"name": "tiny-random", "dtype": "bfloat16", "device": "cuda"}),
        "quantization.mode=4bit",
    )
    options = engine_options(recipe, "cuda", "unused", sleep_mode=True)
    planned = plan_memory(recipe, [], visible_gpus()[0]).choices
    assert options["gpu_memory_utilization"] == planned.vllm_memory < 0.9
    assert options["kv_cache_memory_bytes"] is None
    assert options["quantization"] == VLLM_FP8 and options["sleep_level"] == 2
    assert options["max_num_seqs"] == recipe.rollout.batch_size
    assert options["max_num_batched_tokens"] >= recipe.model.max_length
    in_bytes = recipe.model_copy(deep=True)
    in_bytes.rollout.vllm_memory = 2e9  # bytes of KV cache: once gpu_memory_utilization 0.9 beside the trainer
    options = engine_options(in_bytes, "cuda", "unused", sleep_mode=True)
    assert options["kv_cache_memory_bytes"] == 2_000_000_000 and options["gpu_memory_utilization"] < 0.2
    on_cpu = engine_options(recipe, "cpu", "unused", sleep_mode=False)
    assert on_cpu["kv_cache_memory_bytes"] == 1 << 30 and "quantization" not in on_cpu


def test_fp8_on_vllm_s_cpu_build_is_refused_in_one_sentence(tmp_path, capsys):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": "tiny-random", "device": "cpu"},
        rollout={"engine": "vllm", "vllm_quantization": "fp8"},
    )
    code, out, _ = cli(capsys, "recipes", "validate", str(recipe))
    assert code == 2 and "rollout.vllm_quantization fp8: vLLM quantises to FP8 on CUDA GPUs only" in out


def test_a_stage_that_cannot_fit_the_card_is_refused_before_anything_is_written(tmp_path, capsys, fake_gpus):
    from rlcli.generation.memory_plan import KNOWN_SHAPES

    fake_gpus(("NVIDIA L4", 23034, "8.9"))
    folder = tmp_path / "qwen7b"  # the 7B's config alone: the plan loads no weights
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_SHAPES["Qwen/Qwen2.5-7B-Instruct"]))
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": str(folder), "max_length": 2048},
        quantization={"mode": "4bit"},
        grpo={"iterations": 1, "micro_batch_size": 16},
    )
    runs = tmp_path / "runs"
    code, _, err = cli(capsys, "--runs-dir", runs, "train", "grpo", "-r", recipe)
    assert code == 2 and "Traceback" not in err
    assert "update on cuda:0: needs about" in err and "set grpo.gradient_checkpointing: true" in err
    assert not (runs / "rlcli.db").exists()
    code, out, _ = cli(capsys, "recipes", "validate", str(recipe))
    assert code == 2 and "update on cuda:0" in out


def test_sft_trains_with_gradient_checkpointing(tmp_path, capsys):
    """sft.gradient_checkpointing: what lets the VL recipes' SFT fit a 24 GB card (the plan's figures)."""
    recipe = write_recipe(
        tmp_path / "r.yaml",
        sft={"source": "expert", "demos": 4, "batch_size": 2, "micro_batch_size": 2, "gradient_checkpointing": True},
        run={"name": "t", "seed": 0, "stages": ["sft"]},
    )
    code, _, err = cli(capsys, "--runs-dir", tmp_path / "runs", "sft", "-r", recipe)
    assert code == 0, err
    from safetensors.torch import load_file

    adapter = next((tmp_path / "runs").rglob("adapter_model.safetensors"))
    lora_b = [t for name, t in load_file(adapter).items() if "lora_B" in name]
    assert lora_b and all(torch.isfinite(t).all() for t in lora_b)
    assert any(t.abs().sum() > 0 for t in lora_b)  # lora_B starts at zero: it trained


def test_recipe_comments_of_the_7b_recipe_quote_the_plan(capsys):
    """The header's figures come from the plan; a change to the plan must update them."""
    header = (REPO / "recipes" / "gpu_7b_qlora.yaml").read_text()
    code, out, _ = cli(capsys, "recipes", "plan", "gpu_7b_qlora", "--gpu-gb", "24", "--json")
    plan = json.loads(out)
    rollout = next(s for s in plan["stages"] if s["stage"] == "rollout")
    update = next(s for s in plan["stages"] if s["stage"] == "update")
    for figure in (rollout["peak_gb"], update["peak_gb"], rollout["parts_gb"]["vLLM weights"]):
        assert f"{figure:.1f} GB" in header, figure


def test_a_model_whose_config_the_plan_cannot_read_runs_unplanned(tmp_path, fake_gpus, capsys):
    from rlcli.generation.memory_plan import check_fits

    fake_gpus(("NVIDIA L4", 23034, "8.9"))
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12}))
    recipe = load(write_recipe(tmp_path / "r.yaml", model={"name": str(folder)}))
    check_fits(recipe, ["grpo"])  # no refusal
    assert "no memory plan for this run" in capsys.readouterr().err
    code, _, err = cli(capsys, "recipes", "plan", str(tmp_path / "r.yaml"), "--gpu-gb", "24")
    assert code == 2 and "config.json has no usable 'hidden_size'" in err
