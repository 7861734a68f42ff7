"""4-bit and 8-bit (bitsandbytes) vision-language models with LoRA, on the CPU: every stage of a run
(SFT on gui_click expert demos, GRPO, eval) on the tiny Idefics3 and Qwen2-VL, with the language
model's linear layers quantised and the vision tower and projector left in full precision."""

from __future__ import annotations

import pytest
import torch

from helpers import make_ctx, write_recipe

IDEFICS3, QWEN2_VL, QWEN2_5_VL = "tiny-random-vlm", "tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl"
GUI_CLICK = {"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2, "attempts": 2}, "max_turns": 2}
# The mean |recorded - recomputed| logprob the GRPO update logs. Quantised, sampler and trainer differ
# by more than unquantised (< 1e-6 there): 4-bit computes in bfloat16, whose rounding depends on the
# batch's shapes; and on a CPU, bitsandbytes' 8-bit multiplies int8-quantised activations in eval mode
# (the sampler) but dequantised weights in train mode (the update). Measured (2 iterations): text
# tiny-random 4-bit 1-3e-4, 8-bit 5-6e-4; the tiny VLMs 4-bit 2e-5 to 1e-4, 8-bit 4-5e-4.
GAP = 2e-3

pytest.importorskip("bitsandbytes")


def quantized_modules(model) -> dict[str, str]:
    """Each bitsandbytes layer's module name -> its class name."""
    import bitsandbytes as bnb

    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    }


def is_pixel_module(name: str) -> bool:
    return any(part in name for part in (".vision_model.", ".connector.", ".visual."))


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
@pytest.mark.parametrize("name", [IDEFICS3, QWEN2_VL])
def test_quantized_lora_runs_sft_grpo_and_eval_on_a_vlm(tmp_path, name, mode):
    from safetensors.torch import load_file

    from rlcli.engine.pipeline import run_all
    from rlcli.models.loading import load_policy
    from rlcli.store.checkpoints import resolve_checkpoint

    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": name, "max_length": 1024},
        lora={"r": 4, "alpha": 8},
        quantization=mode,
        env=GUI_CLICK,
        sft={"source": "expert", "demos": 4, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-2, "eval_fraction": 0},
        # As in test_vlm.py: a digit in the reply gives the groups a spread of rewards to learn from.
        rewards=[{"fn": "env_return"}, {"fn": "format", "kwargs": {"pattern": r"(?s).*\d.*"}}],
        grpo={"iterations": 2, "lr": 1e-2},
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 6, "batch_size": 8, "temperature": 1.0},
        eval={"tasks": 2, "k": 1, "checkpoints": ["base", "sft", "latest"]},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_all(ctx)
    stages = {s.name: s.status for s in ctx.rundb.stages(ctx.run)}
    assert stages and all(status == "done" for status in stages.values()), stages
    assert ctx.rundb.db["evals"].count == 3

    metrics = {(m.stage, m.step, m.key): m.value for m in ctx.rundb.metrics(ctx.run)}
    assert any(key == "sft/grad_norm" and value > 0 for (_, _, key), value in metrics.items())
    for step in (0, 1):  # iteration 0 samples with the SFT adapter, iteration 1 with GRPO's update
        assert metrics[("grpo", step, "train/tokens")] > 0
        assert metrics[("grpo", step, "train/grad_norm")] > 0
        assert metrics[("grpo", step, "train/engine_logprob_gap")] < GAP

    sft, latest = (resolve_checkpoint(ctx.store, which).path for which in ("sft", "latest"))
    before, after = load_file(f"{sft}/adapter_model.safetensors"), load_file(f"{latest}/adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "GRPO left the adapter as SFT saved it"
    # LoRA stays off the vision tower (lora.target_vision is false).
    assert not any(is_pixel_module(f".{k}") for k in after)

    model, _ = load_policy(ctx.recipe.model, ctx.recipe.lora, ctx.recipe.quantization, adapter=latest, trainable=False)
    assert getattr(model, f"is_loaded_in_{mode}")
    quantized = quantized_modules(model)
    # The language model's linear layers are quantised; the vision tower, projector and LM head not.
    assert quantized and not any(is_pixel_module(n) or n.endswith("lm_head") for n in quantized)
    pixel_linear = [n for n, m in model.named_modules() if is_pixel_module(n) and isinstance(m, torch.nn.Linear)]
    assert pixel_linear  # the vision tower is there, in plain linear layers
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", [IDEFICS3, QWEN2_VL, QWEN2_5_VL])
def test_lora_on_the_vision_tower_of_a_4bit_vlm_trains(name):
    """lora.target_vision with quantisation: the vision tower is unquantised, so its adapter sits on
    plain linear layers and the image tokens' loss reaches it."""
    from rlcli.envs.loading import load_env
    from rlcli.models import vision
    from rlcli.models.loading import load_policy
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    model, tokenizer = load_policy(
        ModelSection(name=name), LoraSection(r=4, target_vision=True), QuantizationSection(mode="4bit")
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any(is_pixel_module(n) for n in trainable) and any(not is_pixel_module(n) for n in trainable)
    assert not any(is_pixel_module(n) for n in quantized_modules(model))

    processor = vision.processor_of(tokenizer)
    messages, _ = load_env("gui_click", GUI_CLICK["kwargs"])().reset(0)
    named = vision.name_images(messages, {})
    images = vision.message_images(named)
    ids = torch.tensor([vision.tokenize(processor, vision.render(processor, named), images)], device=model.device)
    pixels = vision.pixel_inputs(processor, [ref.image for ref in images], model, ids)
    model.train()
    model(input_ids=ids, **pixels, labels=ids).loss.backward()
    # lora_B starts at zero: its gradient is what moves the vision tower's adapter first.
    vision_grads = [p.grad for n, p in model.named_parameters() if is_pixel_module(n) and "lora_B" in n]
    assert vision_grads and all(g is not None for g in vision_grads)
    assert any(g.abs().sum() > 0 for g in vision_grads)


def test_every_supported_family_names_its_unquantised_modules():
    from rlcli.models.vision import PIXEL_MODULES, SUPPORTED_FAMILIES

    assert set(PIXEL_MODULES) == set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("name", [IDEFICS3, QWEN2_VL])
def test_export_of_a_4bit_vlm_run_writes_a_full_vlm_with_its_processor(tmp_path, name):
    """`rlcli export --merge` of a quantised VLM run: the adapter merged into the unquantised base, saved
    with the processor, computes what the base with the adapter computes."""
    from transformers import AutoModelForImageTextToText

    from rlcli.envs.loading import load_env
    from rlcli.models import vision
    from rlcli.models.loading import export_merged, load_policy, save_checkpoint
    from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

    model_cfg, lora = ModelSection(name=name, dtype="float32"), LoraSection(r=4)  # auto: bfloat16 on a GPU
    model, tokenizer = load_policy(model_cfg, lora, QuantizationSection(mode="4bit"))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:  # as if trained: a zero lora_B would merge to the base unchanged
                param.normal_(0, 0.1)
    checkpoint = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    out = export_merged(model_cfg, lora, QuantizationSection(mode="4bit"), checkpoint, tmp_path / "out")
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32, device_map={"": str(model.device)})
    assert getattr(merged.config, "quantization_config", None) is None
    processor = vision.load_processor(out, name, None)  # the export loads on its own

    adapted, _ = load_policy(model_cfg, lora, QuantizationSection(), adapter=checkpoint, trainable=False)
    messages, _ = load_env("gui_click", GUI_CLICK["kwargs"])().reset(0)
    named = vision.name_images(messages, {})
    images = vision.message_images(named)
    ids = torch.tensor([vision.tokenize(processor, vision.render(processor, named), images)], device=merged.device)
    pixels = vision.pixel_inputs(processor, [ref.image for ref in images], merged, ids)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, **pixels).logits, adapted(input_ids=ids, **pixels).logits)
