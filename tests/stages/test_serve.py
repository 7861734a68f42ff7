"""`rlcli serve`: a policy behind the OpenAI-compatible endpoint, in its own process, until Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess

import openai
import pytest

from helpers import RLCLI, cli, cli_env, write_recipe

HI = [{"role": "user", "content": "Hi"}]


def lora_checkpoint(folder):
    """A LoRA adapter on tiny-random, as a checkpoint folder holds one (its B matrices made non-zero, so that
    it changes the model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlcli.models.cache import tiny_random_path

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_random_path()), LoraConfig(r=4, lora_alpha=8))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("checkpoint", [None, "adapter"])
def test_serve_prints_the_url_and_model_and_stops_on_ctrl_c(tmp_path, checkpoint):
    recipe = write_recipe(tmp_path / "r.yaml", rollout={"max_new_tokens": 5, "temperature": 0.0})
    runs = tmp_path / "runs"
    args = ["-c", lora_checkpoint(tmp_path / "iter-0003")] if checkpoint else []
    server = subprocess.Popen(
        [*RLCLI, "serve", "-r", recipe, *args],
        env=cli_env(runs),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Started as a script's background job is (SIGINT ignored, inherited): it still stops on SIGINT.
        preexec_fn=ignore_ctrl_c if checkpoint else None,
    )
    try:
        assert server.stdout is not None
        base_url = server.stdout.readline().strip().removeprefix("base_url: ")
        model = server.stdout.readline().strip().removeprefix("model: ")
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        assert model == ("tiny-random@iter-0003" if checkpoint else "tiny-random")
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert [m.id for m in api.models.list().data] == [model]
        reply = api.chat.completions.create(model=model, messages=HI)
        # The recipe's settings apply: greedy, at most rollout.max_new_tokens tokens.
        assert reply.usage.completion_tokens <= 5
        again = api.chat.completions.create(model=model, messages=HI, seed=99)
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()  # no server outlives its test
            server.communicate()
            raise
    assert server.returncode == 0, err
    assert "stopped" in err and "Traceback" not in err
    # The weights served are those of the checkpoint asked for: the same reply as they give here.
    assert reply.choices[0].message.content == greedy_reply(recipe, args[1] if args else None)
    if checkpoint:
        assert reply.choices[0].message.content != greedy_reply(recipe, None)  # the adapter changes the reply


def greedy_reply(recipe_path, folder) -> str:
    from rlcli.generation.endpoint import Endpoint
    from rlcli.generation.hf_sampler import HfSampler
    from rlcli.generation.sampler import SamplingConfig
    from rlcli.models.loading import load_policy
    from rlcli.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=folder, trainable=False)
    config = SamplingConfig(temperature=0.0, max_new_tokens=5)
    with Endpoint(HfSampler(model, tokenizer, config), tokenizer, "m", defaults=config) as endpoint:
        api = openai.OpenAI(base_url=endpoint.url(), api_key="unused", max_retries=0)
        return api.chat.completions.create(model="m", messages=HI).choices[0].message.content


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "70000"], "--port 70000 is not a port number"),
        (["-c", "7"], "--checkpoint: there is no run database"),
        (["--port", "TAKEN"], "cannot listen on 127.0.0.1:"),
    ],
)
def test_serve_refuses_bad_input_in_one_sentence(tmp_path, capsys, args, says):
    recipe = write_recipe(tmp_path / "r.yaml")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args]
        code, out, err = cli(capsys, "serve", "-r", recipe, *args)
    assert code == 2 and out == ""
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2
