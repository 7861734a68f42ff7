"""Reward functions and labelling, on hand-made episodes and tiny random models built here."""

from __future__ import annotations

import math
import sys

import pytest

from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import RewardSpec
from rlcli.rewards.builtins import parse_answer
from rlcli.rewards.judge import parse_score
from rlcli.rewards.scoring import build_reward_fns, label_episodes


def episode(id: int, completion: str, **fields) -> dict:
    """An episode as the labeller sees it: a one-turn conversation unless fields say otherwise."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}]
    ep = {
        "id": id,
        "messages": [*prompt, {"role": "assistant", "content": completion}],
        "completion": completion,
        "completions": [completion],
        "prompt": prompt,
        "task": {"question": "What is 6 x 7?", "answer": 42},
        "env_return": 0.0,
        "success": None,
        "num_turns": 1,
        "num_tokens": 10,
        "truncated": False,
        "tool_calls": 0,
        "end_reason": "done",
    }
    ep.update(fields)
    return ep


def score(fn: str, episodes: list[dict], root=None, **kwargs) -> list[float]:
    [reward] = build_reward_fns([RewardSpec(fn=fn, kwargs=kwargs)], root=root)
    return reward(episodes)


# --- built-ins --------------------------------------------------------------------


def test_env_return():
    assert score("env_return", [episode(1, "", env_return=0.5), episode(2, "", env_return=-1)]) == [0.5, -1.0]


@pytest.mark.parametrize(
    ("parse", "completion", "expected"),
    [
        ("answer_tag", "<think>6*7</think><answer> 42 </answer>", 1.0),
        ("answer_tag", "<answer>41</answer> no, <answer>42</answer>", 1.0),  # the last tag counts
        ("answer_tag", "42", 0.0),  # no tag, no answer
        ("last_number", "6 x 7 = 42.", 1.0),
        ("last_number", "42, or maybe 41", 0.0),
        ("strip", "  42\n", 1.0),
        ("strip", "42.", 0.0),
    ],
)
def test_exact_match(parse, completion, expected):
    assert score("exact_match", [episode(1, completion)], parse=parse) == [expected]


def test_exact_match_ignores_case_and_spacing_and_reads_another_field():
    ep = episode(1, "<answer>new  york</answer>", task={"city": "New York"})
    assert score("exact_match", [ep], field="city") == [1.0]


def test_numeric_match():
    episodes = [
        episode(1, "It is 42.0000001"),
        episode(2, "It is 41.9"),
        episode(3, "Total: 1,000", task={"answer": "1000"}),
        episode(4, "no number here"),
    ]
    assert score("numeric_match", episodes) == [1.0, 0.0, 1.0, 0.0]
    assert score("numeric_match", episodes[:2], tol=0.2) == [1.0, 1.0]
    assert score("numeric_match", [episode(1, "<answer>x = 42</answer> 7")], parse="answer_tag") == [1.0]


def test_numeric_match_names_the_episode_whose_answer_is_not_a_number():
    with pytest.raises(RlcliError, match=r"'numeric_match' failed on episode 3: .*'answer' is 'forty-two'"):
        score("numeric_match", [episode(3, "42", task={"answer": "forty-two"})])


def test_missing_task_field_names_the_episode_and_the_fields_it_has():
    with pytest.raises(RlcliError, match=r"episode 5's task has no field 'solution' \(it has: question, answer\)"):
        score("exact_match", [episode(5, "42")], field="solution")


def test_format():
    episodes = [episode(1, "<think>a\nb</think><answer>1</answer>\n"), episode(2, "x <answer>1</answer>")]
    pattern = r"<think>.*</think><answer>.*</answer>"
    assert score("format", episodes, pattern=pattern) == [1.0, 0.0]  # fullmatch, across lines
    assert score("format", episodes, pattern=r"<answer>\d</answer>", fullmatch=False) == [1.0, 1.0]


def test_format_all_turns():
    good = episode(1, "<answer>1</answer>", completions=["<tool>ls</tool>", "<answer>1</answer>"])
    bad = episode(2, "<answer>1</answer>", completions=["thinking", "<answer>1</answer>"])
    pattern = r"<(tool|answer)>.*</\1>"
    assert score("format", [good, bad], pattern=pattern, all_turns=True) == [1.0, 0.0]
    assert score("format", [good, bad], pattern=pattern) == [1.0, 1.0]  # only the final answer


def test_format_rejects_a_bad_pattern_early():
    with pytest.raises(UsageError, match=r"Reward 'format': kwargs.pattern is not a valid regular expression"):
        build_reward_fns([RewardSpec(fn="format", kwargs={"pattern": "(unclosed"})])


def test_length_penalty_is_dapos_soft_overlong_punishment():
    episodes = [episode(i, "", num_tokens=n) for i, n in enumerate([10, 80, 90, 100, 150])]
    assert score("length_penalty", episodes, max_tokens=100, cache=20) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(UsageError, match="cache"):
        build_reward_fns([RewardSpec(fn="length_penalty", kwargs={"max_tokens": 10, "cache": 20})])


def test_tool_budget():
    episodes = [episode(i, "", tool_calls=n) for i, n in enumerate([0, 2, 5])]
    assert score("tool_budget", episodes, budget=2, penalty=0.5) == [0.0, 0.0, -1.5]


def test_turn_budget():
    episodes = [episode(i, "", num_turns=n) for i, n in enumerate([1, 2, 4])]
    assert score("turn_budget", episodes, budget=2, penalty=0.25) == [0.0, 0.0, -0.5]
    assert score("turn_budget", episodes, budget=0) == pytest.approx([-0.1, -0.2, -0.4])


# --- labelling ----------------------------------------------------------------------


def test_label_episodes_gives_every_component_and_the_weighted_total():
    fns = build_reward_fns(
        [
            RewardSpec(fn="env_return", weight=2.0),
            RewardSpec(fn="format", name="tagged", weight=0.5, kwargs={"pattern": "<answer>.*</answer>"}),
        ]
    )
    labels = label_episodes(fns, [episode(1, "<answer>42</answer>", env_return=1.0), episode(2, "42")])
    assert labels == [
        {"env_return": 1.0, "tagged": 1.0, "total": 2.5},
        {"env_return": 0.0, "tagged": 0.0, "total": 0.0},
    ]
    assert label_episodes(fns, []) == []


def test_total_is_a_reserved_component_name():
    with pytest.raises(UsageError, match="total"):
        build_reward_fns([RewardSpec(fn="env_return", name="total")])


# --- user functions -------------------------------------------------------------------

TRL_STYLE = """
def correct(completions, answer, **kwargs):
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]

def scaled(completions, answer, bonus=0.0, **kwargs):
    return [float(c.strip() == str(a)) + bonus for c, a in zip(completions, answer)]

def no_kwargs(completions, question):
    return [float("6" in q) for q in question]

def spy(completions, calls, **kwargs):
    calls.append(kwargs)
    return [0.0] * len(completions)
"""


def test_trl_style_function_from_a_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE)
    episodes = [episode(1, "42"), episode(2, "41")]
    assert score("my_rewards.py:correct", episodes, root=tmp_path) == [1.0, 0.0]

    calls = []  # a recipe kwarg: the spy records what it was passed
    score("my_rewards.py:spy", episodes, root=tmp_path, calls=calls)
    [kwargs] = calls
    assert kwargs["question"] == ["What is 6 x 7?"] * 2  # every task field, as a column
    assert kwargs["prompts"] == [ep["prompt"] for ep in episodes]
    assert kwargs["episodes"] is episodes
    assert kwargs["completion_ids"] is None and kwargs["trainer_state"] is None
    kwargs["log_metric"]("my/metric", 1.0)  # TRL's logging hooks exist, so functions that log still run


def test_recipe_kwargs_reach_the_function_and_kwargs_are_optional(tmp_path):
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE)
    specs = [
        RewardSpec(fn="my_rewards.py:scaled", kwargs={"bonus": 0.5}),
        RewardSpec(fn="my_rewards.py:no_kwargs"),
    ]
    labels = label_episodes(build_reward_fns(specs, root=tmp_path), [episode(1, "42")])
    assert labels == [{"my_rewards.py:scaled": 1.5, "my_rewards.py:no_kwargs": 1.0, "total": 2.5}]


def test_function_from_a_module_in_the_root(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # build_reward_fns adds the root; undo it after
    (tmp_path / "rlcli_test_module_rewards.py").write_text(TRL_STYLE)
    assert score("rlcli_test_module_rewards:correct", [episode(1, "42")], root=tmp_path) == [1.0]


def test_trl_conversational_function_from_a_module():
    # TRL's own reward reads completion[0]["content"]: it needs the messages after the prompt.
    episodes = [episode(1, "<think>6*7</think>42"), episode(2, "42")]
    assert score("trl.rewards:think_format_reward", episodes, conversational=True) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("fn", "kwargs", "message"),
    [
        ("exact_mach", {}, r"Reward 'exact_mach': unknown reward function \(did you mean exact_match\?\)"),
        ("missing.py:f", {}, r"Reward 'missing.py:f': file .*missing.py does not exist"),
        ("my_rewards.py:nope", {}, r"my_rewards.py has no function 'nope'"),
        ("no_such_module_xyz:f", {}, r"cannot import module no_such_module_xyz"),
        ("broken.py:f", {}, r"loading .*broken.py failed: ZeroDivisionError"),
        ("my_rewards.py:no_kwargs", {"bonus": 1}, r"no_kwargs takes no argument bonus"),
        ("my_rewards.py:correct", {"prompts": []}, r"kwargs prompts are passed by rlcli itself"),
        ("exact_match", {"parse": "regex"}, r"Reward 'exact_match': kwargs.parse: Input should be 'answer_tag'"),
        ("exact_match", {"fields": "x"}, r"unknown kwarg fields \(accepted: field, parse\)"),
        ("format", {}, r"kwargs.pattern is required"),
        ("env_return", {"scale": 2}, r"unknown kwarg scale \(accepted: none\)"),
        (
            "judge",
            {"model": "no/such/folder"},
            r"Reward 'judge': kwargs.model 'no/such/folder' is not a local model folder",
        ),
    ],
)
def test_bad_specs_fail_early_naming_the_reward(tmp_path, fn, kwargs, message):
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(UsageError, match=message):
        build_reward_fns([RewardSpec(fn=fn, kwargs=kwargs)], root=tmp_path)


BAD_FUNCTIONS = """
def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def none_for_second(completions, **kwargs):
    return [1.0, None]

def string(completions, **kwargs):
    return ["1.0"] * len(completions)

def nan(completions, **kwargs):
    return [float("nan")] * len(completions)

def scalar(completions, **kwargs):
    return 1.0

def raises(completions, **kwargs):
    raise KeyError("answer_text")
"""


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "short",
            r"Reward 'acc' \(bad.py:short\) returned the wrong number of values for episodes 7, 8: expected 2, got 1",
        ),
        ("none_for_second", r"Reward 'acc' \(bad.py:none_for_second\) returned None for episode 8; expected a finite"),
        ("string", r"Reward 'acc' \(bad.py:string\) returned '1.0' for episode 7"),
        ("nan", r"Reward 'acc' \(bad.py:nan\) returned nan for episode 7; .*NaN and inf are errors"),
        ("scalar", r"Reward 'acc' \(bad.py:scalar\) returned 1.0 for episodes 7, 8; expected a list of 2 numbers"),
        ("raises", r"Reward 'acc' \(bad.py:raises\) failed on episodes 7, 8: KeyError: 'answer_text'"),
    ],
)
def test_bad_values_name_the_function_and_the_episode(tmp_path, name, message):
    (tmp_path / "bad.py").write_text(BAD_FUNCTIONS)
    fns = build_reward_fns([RewardSpec(fn=f"bad.py:{name}", name="acc")], root=tmp_path)
    with pytest.raises(RlcliError, match=message):
        label_episodes(fns, [episode(7, "a"), episode(8, "b")])


SLOW_FUNCTION = """
import time

def slow(completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)
"""


def test_a_reward_function_over_its_time_limit_fails_labelling_naming_it_and_the_limit(tmp_path):
    # A hanging reward function (a network call, an endless loop) held labelling up for ever.
    import time

    (tmp_path / "slow.py").write_text(SLOW_FUNCTION)
    fns = build_reward_fns([RewardSpec(fn="slow.py:slow", name="acc", timeout_s=0.3)], root=tmp_path)
    start = time.monotonic()
    with pytest.raises(
        RlcliError, match=r"Reward 'acc' \(slow.py:slow\) exceeded its 0.3s time limit on episodes 7, 8"
    ):
        label_episodes(fns, [episode(7, "a"), episode(8, "b")])
    assert time.monotonic() - start < 10
    # The limit has a default, and null lifts it.
    assert RewardSpec(fn="env_return").timeout_s == 600
    [unlimited] = build_reward_fns([RewardSpec(fn="env_return", timeout_s=None)])
    assert unlimited([episode(1, "", env_return=0.5)]) == [0.5]


# --- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("7", 0.7), (" Score: 8/10", 0.8), ("10", 1.0), ("0", 0.0), ("2.5 out of 10", 0.25), ("7-8", 0.7)],
)
def test_parse_score(reply, expected):
    assert math.isclose(parse_score(reply, 10), expected)


@pytest.mark.parametrize(("reply", "reason"), [("great answer", "no number"), ("11", "outside"), ("-1", "outside")])
def test_parse_score_failures_say_why(reply, reason):
    with pytest.raises(ValueError, match=reason):
        parse_score(reply, 10)


def test_parse_answer():
    assert parse_answer("a <answer>x</answer> b <answer>y</answer>", "answer_tag") == "y"
    assert parse_answer("from 3-5 it is -1,234.5 then", "last_number") == "-1234.5"
    assert parse_answer("no numbers", "last_number") is None


# --- model-based rewards ------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama(folder, head: str, num_labels: int = 1, max_positions: int = 2048):
    """A random one-layer Llama with a byte-level tokenizer, saved like a downloaded model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<pad>": len(vocab), "<eos>": len(vocab) + 1}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", chat_template=CHAT_TEMPLATE
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config) if head == "causal" else LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("judge"), "causal")


def test_judge_scores_in_range_and_records_parse_failures(judge_folder):
    episodes = [episode(i, f"It is {40 + i}") for i in range(1, 6)]
    spec = RewardSpec(fn="judge", kwargs={"model": judge_folder, "max_new_tokens": 4, "batch_size": 2})
    fns = build_reward_fns([spec])
    scores = [label["judge"] for label in label_episodes(fns, episodes)]

    assert len(scores) == 5 and all(0.0 <= s <= 1.0 for s in scores)
    failures = fns[0].failures
    assert failures, "a random model should mostly reply without a usable score"
    assert set(failures) <= {ep["id"] for ep in episodes}
    for ep, s in zip(episodes, scores):
        if ep["id"] in failures:
            assert s == 0.0 and "judge's reply" in failures[ep["id"]]


def test_judge_rubric_with_task_fields(judge_folder):
    rubric = "Q: {question}\nExpected: {answer}\nGot: {completion}\nScore 0-{scale}:"
    [judge] = build_reward_fns([RewardSpec(fn="judge", kwargs={"model": judge_folder, "rubric": rubric})])
    assert judge.scorer.request(episode(1, "42")) == "Q: What is 6 x 7?\nExpected: 42\nGot: 42\nScore 0-10:"
    with pytest.raises(RlcliError, match=r"rubric names question, which episode 2's task does not have"):
        judge([episode(2, "42", task={"answer": 42})])


def test_judge_rejects_a_malformed_rubric(judge_folder):
    with pytest.raises(UsageError, match=r"Reward 'judge': kwargs.rubric"):
        build_reward_fns([RewardSpec(fn="judge", kwargs={"model": judge_folder, "rubric": "Score {0} {"})])


def test_reward_model_scores_each_conversation_deterministically(tmp_path):
    folder = tiny_llama(tmp_path / "rm", "classification")
    [reward] = build_reward_fns([RewardSpec(fn="reward_model", kwargs={"model": folder, "batch_size": 2})])
    episodes = [episode(1, "42"), episode(2, "It is forty-two, I think."), episode(3, "41")]
    first = reward(episodes)
    assert len(first) == 3 and all(isinstance(v, float) for v in first)
    assert reward(episodes) == first
    assert reward(episodes[:1]) == pytest.approx(first[:1], abs=1e-5)  # padding does not change a score


def test_reward_model_with_several_labels_needs_one_chosen(tmp_path):
    folder = tiny_llama(tmp_path / "rm", "classification", num_labels=3)
    with pytest.raises(UsageError, match=r"has 3 labels; set kwargs.label"):
        build_reward_fns([RewardSpec(fn="reward_model", kwargs={"model": folder})])
    [reward] = build_reward_fns([RewardSpec(fn="reward_model", kwargs={"model": folder, "label": 2})])
    assert len(reward([episode(1, "42")])) == 1


# With one token per byte, this episode does not fit in the few positions these tiny models have.
LONG_COMPLETION = "The answer, after a long think: " + "6 x 7 is 42. " * 20


def test_judge_cuts_an_over_long_request_from_the_left_and_says_so(tmp_path):
    folder = tiny_llama(tmp_path / "judge", "causal", max_positions=256)
    spec = RewardSpec(fn="judge", kwargs={"model": folder, "max_new_tokens": 4, "batch_size": 2})
    [judge] = build_reward_fns([spec])
    scores = judge([episode(1, "42"), episode(2, LONG_COMPLETION)])
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    assert "input cut from the left" in judge.failures[2] and "252 tokens kept" in judge.failures[2]
    assert "cut" not in judge.failures.get(1, "")


def test_reward_model_cuts_an_over_long_conversation_from_the_left_and_says_so(tmp_path):
    folder = tiny_llama(tmp_path / "rm", "classification", max_positions=64)
    [reward] = build_reward_fns([RewardSpec(fn="reward_model", kwargs={"model": folder, "batch_size": 2})])
    long_episode = episode(2, LONG_COMPLETION)
    values = reward([episode(1, "42"), long_episode])
    assert len(values) == 2 and all(math.isfinite(v) for v in values)
    assert list(reward.failures) == [2] and "64 tokens kept" in reward.failures[2]
    # What is kept is the end of the conversation, where the model reads its score.
    same_end = episode(
        3,
        LONG_COMPLETION,
        messages=[{"role": "user", "content": "Other start. " * 20}, {"role": "assistant", "content": LONG_COMPLETION}],
    )
    assert reward([same_end]) == pytest.approx(values[1:], abs=1e-5)
