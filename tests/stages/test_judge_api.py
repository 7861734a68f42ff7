"""Judges over an OpenAI-compatible API (kwargs.base_url), tested against rlcli's own endpoint serving the
tiny model: no network. The `judge` over the URL scores as the same model judging locally does; the
group judge (`judge_group`) asks once per group and reads one score per attempt."""

from __future__ import annotations

import pytest
import torch

from rlcli.errors import UsageError
from rlcli.generation.endpoint import Endpoint
from rlcli.generation.hf_sampler import HfSampler
from rlcli.generation.sampler import SamplingConfig
from rlcli.recipe import RewardSpec
from rlcli.rewards.judge import parse_group_scores
from rlcli.rewards.scoring import build_reward_fns, label_episodes
from test_rewards import episode


def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcli.models.cache import tiny_random_path

    path = tiny_random_path()
    return str(path), AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def serve(model, tokenizer) -> Endpoint:
    config = SamplingConfig(temperature=1.0, max_new_tokens=16)  # the judge asks for temperature 0
    return Endpoint(HfSampler(model, tokenizer, config), tokenizer, "judge", defaults=config, max_length=4096)


def test_the_judge_over_a_url_scores_as_the_same_model_judging_locally(monkeypatch):
    folder, model, tokenizer = tiny()
    monkeypatch.setenv("JUDGE_KEY", "local")
    episodes = [episode(i, f"It is {40 + i}") for i in range(1, 6)]
    kwargs = {"max_new_tokens": 4, "batch_size": 2}
    [local] = build_reward_fns([RewardSpec(fn="judge", kwargs={"model": folder, **kwargs})])
    with serve(model, tokenizer) as endpoint:
        api_kwargs = {"model": "judge", "base_url": endpoint.url(), "api_key_env": "JUDGE_KEY", **kwargs}
        [remote] = build_reward_fns([RewardSpec(fn="judge", kwargs=api_kwargs)])
        remote_scores = [label["judge"] for label in label_episodes([remote], episodes)]
    local_scores = [label["judge"] for label in label_episodes([local], episodes)]
    assert remote_scores == local_scores
    assert remote.failures == local.failures and remote.failures  # the random model's replies hold no score
    assert endpoint.requests == 5 and len(endpoint.calls()) == 5


def test_the_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    spec = RewardSpec(fn="judge", kwargs={"model": "m", "base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(UsageError, match="environment variable OPENAI_API_KEY is not set"):
        build_reward_fns([spec])
    spec.kwargs["api_key_env"] = None  # a server that takes no key
    assert build_reward_fns([spec])[0].scorer.client.api_key == "unused"


def test_group_scores_are_read_per_attempt():
    found = parse_group_scores("Attempt 1: 7\n2: 10/10\n- 3 = 12\n1: 0", 3, 10)
    assert found[1] == 0.7 and found[2] == 1.0  # the first line of an attempt counts
    assert "outside [0, 10]" in str(found[3])
    assert parse_group_scores("No idea.", 2, 10) == {}


def test_the_group_judge_asks_once_per_group_and_scores_each_attempt():
    """Two tasks, three attempts each: two requests. The tiny model taught one reply to the first group's
    request ranks that group; the second group is scored from its own reply, whatever the model wrote."""
    folder, model, tokenizer = tiny()
    groups = {
        "6 x 7": [episode(i, text) for i, text in enumerate(["41", "42", "It is 42"], start=1)],
        "2 + 2": [sum_episode(i, text) for i, text in enumerate(["4", "5", "22"], start=4)],
    }
    episodes = groups["6 x 7"] + groups["2 + 2"]
    kwargs = {"model": "judge", "max_new_tokens": 12, "api_key_env": None}
    with serve(model, tokenizer) as endpoint:
        [reward] = build_reward_fns([RewardSpec(fn="judge_group", kwargs={"base_url": endpoint.url(), **kwargs})])
        request = reward.scorer.request(groups["6 x 7"])
        assert request.count("Attempt ") == 3 and "assistant: It is 42" in request
        teach(model, tokenizer, request, "1: 2\n2: 9\n3: 8")
        scores = reward(episodes)
    first, second = sorted(endpoint.calls(), key=lambda r: "2 + 2" in tokenizer.decode(r.prompt_ids))
    assert "6 x 7" in tokenizer.decode(first.prompt_ids) and "2 + 2" in tokenizer.decode(second.prompt_ids)
    assert scores[:3] == [0.2, 0.9, 0.8] and not set(reward.failures) & {1, 2, 3}
    found = parse_group_scores(tokenizer.decode(second.completion_ids, skip_special_tokens=True), 3, 10)
    assert scores[3:] == [v if isinstance(v, float) else 0.0 for v in (found.get(n) for n in (1, 2, 3))]
    assert set(reward.failures) == {4 + n for n in range(3) if not isinstance(found.get(n + 1), float)}


def sum_episode(id: int, completion: str) -> dict:
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    messages = [*prompt, {"role": "assistant", "content": completion}]
    return episode(id, completion, task={"question": "2 + 2", "answer": 4}, prompt=prompt, messages=messages)


def teach(model, tokenizer, request: str, reply: str) -> None:
    """A few dozen Adam steps until the model greedily answers `request` (as the endpoint renders it) with `reply`."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    target = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids, labels = torch.tensor([prompt + target]), torch.tensor([[-100] * len(prompt) + target])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    model.eval()
