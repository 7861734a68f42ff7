"""The LLM judge generates through the rollout engine seam (HfSampler): greedy replies equal to
transformers' greedy decoding, the same whichever episodes share a batch."""

from __future__ import annotations

import torch

from rlcli.generation.hf_sampler import HfSampler
from rlcli.recipe import RewardSpec
from rlcli.rewards.scoring import build_reward_fns
from test_rewards import episode, judge_folder, tiny_llama  # noqa: F401 (judge_folder: a fixture)


def build_judge(folder, **kwargs):
    [judge] = build_reward_fns([RewardSpec(fn="judge", kwargs={"model": folder, "max_new_tokens": 6, **kwargs})])
    return judge.scorer


def test_the_judge_samples_through_the_hf_engine_greedily(judge_folder):  # noqa: F811
    judge = build_judge(judge_folder, batch_size=4)
    assert isinstance(judge.sampler, HfSampler) and judge.sampler.config.temperature == 0
    episodes = [episode(i, f"It is {40 + i}") for i in range(1, 5)]
    requests = [judge.request(ep) for ep in episodes]
    replies = judge.generate(requests, [ep["id"] for ep in episodes])

    # transformers' own greedy decoding, one request at a time (no padding), as the reference.
    tokenizer, lm = judge.tokenizer, judge.lm
    for request, reply in zip(requests, replies):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert reply == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert any(replies), "a random model should write something"


def test_the_judges_scores_do_not_depend_on_the_batch(judge_folder):  # noqa: F811
    episodes = [episode(i, f"It is {40 + i}" + " indeed" * i) for i in range(1, 6)]
    together, apart = build_judge(judge_folder, batch_size=5), build_judge(judge_folder, batch_size=1)
    assert together(episodes) == apart(episodes)
    assert together.failures == apart.failures
