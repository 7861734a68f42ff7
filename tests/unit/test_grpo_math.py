"""GRPO maths (rlcli.engine.grpo.advantages and .loss) against values worked out by hand in the comments next to each case."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlcli.engine.grpo.advantages import (
    compute_advantages,
    discounted_turn_returns,
    step_group_advantages,
    turn_advantages,
    zero_variance_groups,
)
from rlcli.engine.grpo.loss import check_finite, chunked_token_logprobs, policy_loss
from rlcli.errors import RlcliError

D = torch.float64
LN2 = math.log(2.0)


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def close(a, b, tol=1e-9) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0)


# Two groups: g0 = [1, 0, 0, 1] (mean 0.5), g1 = [2, 4, 6] (mean 4).
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1]


# --- advantages ----------------------------------------------------------------------------


def test_grpo_uses_unbiased_group_std_like_trl():
    # g0: sum of squares 4 * 0.25 = 1, var 1/3, std 1/sqrt(3): A = +-0.5 * sqrt(3) = +-sqrt(3)/2.
    # g1: sum of squares 4 + 0 + 4 = 8, var 8/2 = 4, std 2: A = [-1, 0, 1].
    h = math.sqrt(3) / 2
    adv = compute_advantages(t(REWARDS), GROUPS, "grpo", eps=0.0)
    assert close(adv, [h, -h, -h, h, -1.0, 0.0, 1.0])
    # The default eps only nudges the scale.
    assert close(compute_advantages(t(REWARDS), GROUPS, "grpo"), adv, tol=1e-5)


def test_dr_grpo_only_centres():
    adv = compute_advantages(t(REWARDS), torch.tensor(GROUPS), "dr_grpo")
    assert close(adv, [0.5, -0.5, -0.5, 0.5, -2.0, 0.0, 2.0])


def test_rloo_subtracts_the_mean_of_the_others():
    # g0: 1 - (0+0+1)/3 = 2/3; 0 - (1+0+1)/3 = -2/3.  g1: 2 - 5 = -3, 4 - 4 = 0, 6 - 3 = 3.
    adv = compute_advantages(t(REWARDS), GROUPS, "rloo")
    assert close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -3.0, 0.0, 3.0])


def test_batch_normalises_over_all_episodes():
    # Mean 14/7 = 2; deviations [-1,-2,-2,-1,0,2,4]; squares sum 30; var 30/6 = 5.
    adv = compute_advantages(t(REWARDS), GROUPS, "batch", eps=0.0)
    assert close(adv, [d / math.sqrt(5) for d in [-1, -2, -2, -1, 0, 2, 4]])


def test_group_ids_may_be_interleaved_and_arbitrary():
    adv = compute_advantages(t([1.0, 2.0, 0.0, 4.0]), [7, 3, 7, 3], "dr_grpo")
    assert close(adv, [0.5, -1.0, -0.5, 1.0])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_equal_and_single_member_groups_get_exactly_zero(method):
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantage must still be exactly 0, not noise / eps.
    rewards = t([0.1, 0.1, 0.1, 5.0, 1.0, 0.0])
    adv = compute_advantages(rewards, [0, 0, 0, 1, 2, 2], method)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0 > adv[5]


def test_batch_advantage_of_identical_rewards_is_zero():
    assert compute_advantages(t([3.0, 3.0]), [0, 1], "batch").tolist() == [0.0, 0.0]
    assert compute_advantages(t([3.0]), [0], "batch").tolist() == [0.0]


def test_integer_rewards_are_fine():
    assert close(compute_advantages(torch.tensor([1, 0]), [0, 0], "dr_grpo"), [0.5, -0.5])


def test_unknown_method_and_mismatched_groups_are_refused():
    with pytest.raises(ValueError, match="advantage method"):
        compute_advantages(t([1.0, 0.0]), [0, 0], "ppo")
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(t([1.0, 0.0]), [0, 0, 0], "grpo")


def test_zero_variance_groups_flags_every_member():
    flags = zero_variance_groups(t([1.0, 1.0, 0.0, 1.0, 5.0, 0.1, 0.1, 0.1]), [0, 0, 1, 1, 2, 3, 3, 3])
    assert flags.tolist() == [True, True, False, False, True, True, True, True]


# --- multi-turn returns ----------------------------------------------------------------------


def test_discounted_turn_returns():
    assert discounted_turn_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_turn_returns([1.0, 2.0, 3.0], 1.0) == [6.0, 5.0, 3.0]
    assert discounted_turn_returns([1.0, 2.0], 0.0) == [1.0, 2.0]
    assert discounted_turn_returns([], 0.9) == []


# Episode a: returns [0.25, 0.5, 1] (G0 = 0.25); episode b: [0, 0] (G0 = 0); one group, mean of G0 = 0.125.
TURNS = [[0.25, 0.5, 1.0], [0.0, 0.0]]


def test_turn_advantages_dr_grpo_centres_on_the_group_mean_episode_return():
    adv = turn_advantages(TURNS, [0, 0], "dr_grpo")
    assert close(adv[0], [0.125, 0.375, 0.875]) and close(adv[1], [-0.125, -0.125])


def test_turn_advantages_grpo_scales_by_the_group_std_of_episode_returns():
    # std of [0.25, 0] (unbiased) = sqrt(2 * 0.125^2 / 1) = 0.125 * sqrt(2).
    s = 0.125 * math.sqrt(2)
    adv = turn_advantages(TURNS, [0, 0], "grpo", eps=0.0)
    assert close(adv[0], [0.125 / s, 0.375 / s, 0.875 / s]) and close(adv[1], [-0.125 / s, -0.125 / s])


def test_turn_advantages_rloo_uses_the_others_episode_returns():
    adv = turn_advantages(TURNS, [0, 0], "rloo")
    assert close(adv[0], [0.25, 0.5, 1.0]) and close(adv[1], [-0.25, -0.25])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "batch"])
def test_turn_advantages_equal_episode_advantages_for_one_final_reward(method):
    # gamma = 1 and reward on the last turn only: every turn's return is the episode reward.
    steps = [[0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0], [0.0], [0.0, 3.0], [2.0]]
    groups = [0, 0, 0, 0, 1, 1]
    returns = [discounted_turn_returns(s, 1.0) for s in steps]
    episode = compute_advantages(t([r[0] for r in returns]), groups, method)
    adv = turn_advantages(returns, groups, method)
    for i, per_turn in enumerate(adv):
        assert close(per_turn, [float(episode[i])] * len(steps[i]))


def test_turn_advantages_of_a_zero_variance_group_are_zero_not_divided_by_eps():
    # Both episodes return 0.5 overall, but later turns have higher return-to-go.
    adv = turn_advantages([[0.5, 1.0], [0.5, 1.0, 2.0]], [0, 0], "grpo")
    assert adv == [[0.0, 0.0], [0.0, 0.0, 0.0]]


# --- policy loss -----------------------------------------------------------------------------


def loss_of(logprobs, old, adv, mask, **kw):
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.28)
    return policy_loss(logprobs, old, adv, mask, **kw)


# GiGPO's step groups: three episodes of one task (group 0) and one of another (group 1). The reset ("")
# and state A repeat within group 0 with different returns; B, C, D and group 1's A are alone.
STEP_RETURNS = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0], [5.0, 5.0]]
STEP_STATES = [["", "A", "B"], ["", "A", "C"], ["", "D"], ["", "A"]]


def test_step_groups_share_a_baseline_per_state_within_a_group():
    adv, live = step_group_advantages(STEP_RETURNS, STEP_STATES, [0, 0, 0, 1], "grpo", eps=0.0)
    reset_std, a_std = math.sqrt(1 / 3), math.sqrt(0.5)  # unbiased std of {1, 0, 1} and {1, 0}
    assert adv[0] == pytest.approx([(1 - 2 / 3) / reset_std, 0.5 / a_std, 0.0])
    assert adv[1] == pytest.approx([-2 / 3 / reset_std, -0.5 / a_std, 0.0])
    assert adv[2] == pytest.approx([(1 - 2 / 3) / reset_std, 0.0])
    assert adv[3] == [0.0, 0.0]  # its own group: alone at the reset and at A
    assert live == pytest.approx(5 / 10)  # group 0's reset (3 turns) and A (2) of the 10 turns


def test_step_groups_centre_only_under_dr_grpo_and_normalise_per_state_under_batch():
    centred, _ = step_group_advantages(STEP_RETURNS, STEP_STATES, [0, 0, 0, 1], "dr_grpo")
    assert centred[0] == pytest.approx([1 / 3, 0.5, 0.0])
    batch, _ = step_group_advantages(STEP_RETURNS, STEP_STATES, [0, 0, 0, 1], "batch", eps=0.0)
    grpo, _ = step_group_advantages(STEP_RETURNS, STEP_STATES, [0, 0, 0, 1], "grpo", eps=0.0)
    assert batch == grpo


def test_a_turn_acted_on_the_reset_or_on_the_answer_before_it_without_the_tool_call_timing():
    from rlcli.engine.grpo.batch import acted_on
    from rlcli.store.records import Turn

    answer = [{"role": "tool", "name": "calc", "content": "4", "call": {"latency_s": 0.01}}]
    again = [{**answer[0], "call": {"latency_s": 0.02}}]
    keys = acted_on([Turn(0, [], [], [], observation=json.dumps(m)) for m in (answer, [], [])])
    keys_again = acted_on([Turn(0, [], [], [], observation=json.dumps(m)) for m in (again, [], [])])
    assert keys[0] == "" and keys == keys_again and keys[1] != keys[2]


def _labelled(turn_rewards: list[float], observations: list[str]):
    """A stored episode whose turns earned `turn_rewards` and were answered with `observations`."""
    from rlcli.store.records import EndReason, Episode, LabelledEpisode, Turn

    turns = [
        Turn(i, [], [], [], reward=r, observation=json.dumps([{"role": "user", "content": o}]))
        for i, (r, o) in enumerate(zip(turn_rewards, observations))
    ]
    episode = Episode(
        None,
        "r",
        "rollout/0",
        0,
        "train",
        0,
        0,
        0,
        "base",
        "ok",
        EndReason.TERMINATED,
        sum(turn_rewards),
        True,
        len(turns),
        0,
        {},
        [],
        True,
        None,
        "",
        turns=turns,
    )
    return LabelledEpisode(episode, "default", sum(turn_rewards))


def _credit(episodes, **grpo):
    from rlcli.engine.grpo.batch import turn_credit
    from rlcli.recipe import GrpoSection

    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    groups = torch.zeros(len(episodes), dtype=torch.long)
    return turn_credit(GrpoSection(**grpo), episodes, rewards, groups, {}, {})


def test_step_groups_discount_by_gamma_even_when_it_is_zero():
    """grpo.gamma 0 credits each turn with its own reward only; it must not read as 'undiscounted'."""
    # Both episodes see "A" after their first turn; only their second turns' rewards differ.
    episodes = [_labelled([1.0, 1.0], ["A", "x"]), _labelled([1.0, 0.0], ["A", "y"])]
    credit = _credit(episodes, gamma=0.0, step_groups=1.0, advantage="dr_grpo")
    # Episode level: the first turns' returns are equal (1, 1), so the group gives 0 on every turn.
    # Step level with gamma 0: the reset {1, 1} gives 0; "A" {1, 0} gives +0.5 and -0.5. Undiscounted the
    # returns-to-go would be {2, 1} at the reset, giving the first turns +0.5 and -0.5.
    assert credit.per_turn == [[0.0, 0.5], [0.0, -0.5]]
    # Equal at the episode level, yet both train: each has a turn with a step-level advantage.
    assert credit.zero_var.tolist() == [True, True] and credit.credited == {0, 1}


def test_with_a_discount_wins_of_different_lengths_are_not_a_group_of_equal_returns():
    """Two wins, in one turn and in three: equal rewards, but with grpo.gamma their discounted returns
    differ, so the group has an advantage and must train (it was dropped as equal, and counted in
    train/zero_var_groups, while its advantages said the short win was better)."""
    episodes = [_labelled([1.0], ["Correct!"]), _labelled([0.0, 0.0, 1.0], ["Higher.", "Lower.", "Correct!"])]
    discounted = _credit(episodes, gamma=0.9)
    assert discounted.zero_var.tolist() == [False, False] and not discounted.credited
    assert discounted.per_turn[0][0] > 0 > discounted.per_turn[1][0]
    undiscounted = _credit(episodes)
    assert undiscounted.zero_var.tolist() == [True, True]
    assert undiscounted.per_turn == [[0.0], [0.0, 0.0, 0.0]]


def test_step_groups_are_refused_with_role_baselines():
    from pydantic import ValidationError

    from rlcli.recipe import GrpoSection

    with pytest.raises(ValidationError, match="grpo.advantage rae has no groups"):
        GrpoSection(step_groups=1.0, advantage="rae")


def test_token_clipping_values_gradients_and_clip_fractions():
    # ratios 1.5, 0.5, 1.1, 0.7 with A = +1, -1, +1, +1 and range [0.8, 1.28]:
    #   1.5*+1 -> min(1.5, 1.28) = 1.28 (high clip active);  0.5*-1 -> min(-0.5, -0.8) = -0.8 (low clip active)
    #   1.1*+1 -> 1.1;  0.7*+1 -> min(0.7, 0.8) = 0.7 (below the range but A > 0: unclipped)
    # token_mean = (-1.28 + 0.8 - 1.1 - 0.7) / 4 = -0.57.
    ratios = t([[1.5, 0.5, 1.1, 0.7]])
    logp = ratios.log().requires_grad_()
    loss, st = loss_of(logp, torch.zeros_like(ratios), t([[1.0, -1.0, 1.0, 1.0]]), torch.ones_like(ratios))
    assert close(loss, -0.57)
    assert st["loss"] == pytest.approx(-0.57)
    assert st["clip_frac_low"] == pytest.approx(0.25) and st["clip_frac_high"] == pytest.approx(0.25)
    assert st["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert st["kl"] == 0.0 and st["tokens"] == 4.0
    assert "entropy" not in st and "tis_weight_mean" not in st
    loss.backward()
    # d/dlogp of -r*A/4 is -r*A/4 where unclipped, 0 where clipped.
    assert close(logp.grad, [[0.0, 0.0, -1.1 / 4, -0.7 / 4]])


def test_per_sequence_advantages_broadcast():
    logp = t([[0.0, 0.0], [0.0, 0.0]])
    loss, _ = loss_of(logp, logp, t([2.0, -1.0]), torch.ones_like(logp))
    assert close(loss, -(2 + 2 - 1 - 1) / 4)


def test_sequence_importance_is_the_geometric_mean_with_token_gradients():
    # Token ratios 2 and 0.5 on row 0 (geometric mean 1); 1.2, 1.2 and a padded token on row 1 (mean 1.2).
    logp = t([[LN2, -LN2, 0.0], [math.log(1.2), math.log(1.2), 50.0]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 0]])
    kw = {"importance": "sequence", "aggregation": "seq_mean", "clip_low": 0.5, "clip_high": 0.5}
    loss, st = loss_of(logp, torch.zeros_like(logp), t([1.0, 1.0]), mask, **kw)
    # GSPO: loss = -mean_i(s_i * A_i) = -(1 + 1.2) / 2.
    assert close(loss, -1.1)
    assert st["ratio_mean"] == pytest.approx((1 + 1 + 1.2 + 1.2) / 4)
    loss.backward()
    # Each token gets s_i * A_i / |y_i| / B, not its own token ratio; padding gets nothing.
    assert close(logp.grad, [[-0.25, -0.25, 0.0], [-0.3, -0.3, 0.0]])


def test_sequence_ratio_outside_the_range_is_clipped_as_a_whole():
    # Geometric mean of 2 and 2 is 2 > 1 + 0.001 with A > 0: the whole sequence is clipped, no gradient.
    logp = t([[LN2, LN2]]).requires_grad_()
    loss, st = loss_of(
        logp, t([[0.0, 0.0]]), t([1.0]), t([[1, 1]]), importance="sequence", clip_low=0.001, clip_high=0.001
    )
    assert close(loss, -1.001)
    assert st["clip_frac_high"] == 1.0
    loss.backward()
    assert close(logp.grad, [[0.0, 0.0]])


# Token losses [[1, 2, 3], [4, -, -], [-, -, -]] (ratio 1, A = -loss): a ragged batch with one empty row.
RAGGED_ADV = t([[-1.0, -2.0, -3.0], [-4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
RAGGED_MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "aggregation, max_len_norm, expected",
    [
        ("token_mean", None, 10 / 4),  # every token weighs the same
        ("seq_mean", None, (6 / 3 + 4 / 1) / 2),  # every sequence weighs the same
        ("seq_mean_token_sum_norm", None, 10 / (2 * 3)),  # constant normaliser B * T
        ("seq_mean_token_sum_norm", 5, 10 / (2 * 5)),  # constant normaliser B * max_len_norm
    ],
)
def test_aggregations_on_a_ragged_batch(aggregation, max_len_norm, expected):
    logp = torch.zeros(3, 3, dtype=D)
    loss, st = loss_of(logp, logp, RAGGED_ADV, RAGGED_MASK, aggregation=aggregation, max_len_norm=max_len_norm)
    assert close(loss, expected)
    assert st["tokens"] == 4.0


def test_an_all_masked_batch_gives_zero_not_nan():
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    for aggregation in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
        loss, st = loss_of(logp, logp.detach(), t([1.0, 1.0]), torch.zeros(2, 3, dtype=D), aggregation=aggregation)
        assert loss.item() == 0.0 and st["tokens"] == 0.0 and st["ratio_mean"] == 0.0


def test_junk_at_masked_positions_cannot_make_nan():
    # Padding can hold stale or extreme values; exp(1e4) would be inf and inf * 0 is NaN.
    logp = t([[-0.1, 0.0], [-0.2, -1e4]]).requires_grad_()
    old = t([[-0.1, -1e4], [-0.2, 0.0]])
    mask = t([[1, 0], [1, 0]])
    for importance in ("token", "sequence"):
        loss, st = loss_of(
            logp,
            old,
            t([1.0, -1.0]),
            mask,
            importance=importance,
            ref_logprobs=old,
            beta=0.1,
            rollout_logprobs=t([[-0.1, 1e4], [-0.2, -1e4]]),
            tis_cap=2.0,
            entropy=t([[0.5, math.inf], [0.5, math.nan]]),
            entropy_top_frac=0.5,
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(math.isfinite(v) for v in st.values())
        logp.grad = None


def test_kl_is_zero_when_the_reference_equals_the_policy():
    logp = t([[-0.3, -1.2]])
    base, _ = loss_of(logp, logp, t([1.0]), torch.ones_like(logp))
    loss, st = loss_of(logp, logp, t([1.0]), torch.ones_like(logp), ref_logprobs=logp, beta=0.5)
    assert st["kl"] == 0.0 and close(loss, base)


def test_kl_k3_values():
    # ref - logp = ln 2: k3 = 2 - ln 2 - 1;  ref - logp = -ln 2: k3 = 0.5 + ln 2 - 1.  A = 0, so only KL remains.
    logp = t([[0.0, 0.0]]).requires_grad_()
    loss, st = loss_of(logp, logp.detach(), t([0.0]), t([[1, 1]]), ref_logprobs=t([[LN2, -LN2]]), beta=0.1)
    k3 = [1 - LN2, LN2 - 0.5]
    assert st["kl"] == pytest.approx(sum(k3) / 2) and st["kl"] > 0
    assert close(loss, 0.1 * sum(k3) / 2)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): -1 and +0.5, times beta / 2 tokens.
    assert close(logp.grad, [[-0.05, 0.025]])


def test_kl_is_reported_but_not_added_when_beta_is_zero():
    logp = t([[0.0]])
    loss, st = loss_of(logp, logp, t([0.0]), t([[1]]), ref_logprobs=t([[LN2]]), beta=0.0)
    assert loss.item() == 0.0 and st["kl"] == pytest.approx(1 - LN2)


def test_tis_weights_are_truncated_and_detached():
    # exp(old - rollout) = 3 -> capped at 2; 0.5 stays.  Ratio 1, A = 1: losses -2 and -0.5.
    logp = t([[0.0, 0.0]]).requires_grad_()
    old = logp.detach()
    rollout = t([[-math.log(3.0), LN2]]).requires_grad_()
    loss, st = loss_of(logp, old, t([1.0]), t([[1, 1]]), rollout_logprobs=rollout, tis_cap=2.0)
    assert close(loss, -1.25) and st["tis_weight_mean"] == pytest.approx(1.25)
    loss.backward()
    assert close(logp.grad, [[-1.0, -0.25]]) and rollout.grad is None
    # Without a cap the rollout logprobs are ignored.
    plain, st = loss_of(logp, old, t([1.0]), t([[1, 1]]), rollout_logprobs=rollout)
    assert close(plain, -1.0) and "tis_weight_mean" not in st


def test_entropy_selection_keeps_the_top_fraction_of_masked_tokens():
    # Masked entropies 0.1 0.9 0.5 0.7 0.3 (the 99 is padding).  Top 40% of 5 = 2 tokens: 0.9 and 0.7.
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    entropy = t([[0.1, 0.9, 0.5], [0.7, 0.3, 99.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    loss, st = loss_of(logp, logp.detach(), t([1.0, 1.0]), mask, entropy=entropy, entropy_top_frac=0.4)
    # The kept tokens carry -1 each; the denominator still counts all 5 masked tokens.
    assert close(loss, -2 / 5)
    assert st["entropy"] == pytest.approx((0.1 + 0.9 + 0.5 + 0.7 + 0.3) / 5)
    loss.backward()
    assert close(logp.grad, [[0.0, -0.2, 0.0], [-0.2, 0.0, 0.0]])


def test_entropy_selection_keeps_at_least_one_token_and_ties():
    logp = torch.zeros(1, 4, dtype=D, requires_grad=True)
    loss, _ = loss_of(
        logp,
        logp.detach(),
        t([1.0]),
        torch.ones(1, 4, dtype=D),
        entropy=t([[0.1, 0.9, 0.5, 0.7]]),
        entropy_top_frac=0.01,
    )
    assert close(loss, -1 / 4)
    tied, _ = loss_of(
        logp,
        logp.detach(),
        t([1.0]),
        torch.ones(1, 4, dtype=D),
        entropy=t([[0.2, 0.2, 0.2, 0.2]]),
        entropy_top_frac=0.5,
    )
    assert close(tied, -1.0)
    # 0.28 * 25 is 7.000000000000001 in floating point: still 7 tokens of 25, not 8.
    n = torch.zeros(1, 25, dtype=D)
    some, _ = loss_of(
        n,
        n,
        t([1.0]),
        torch.ones(1, 25, dtype=D),
        entropy=torch.arange(25, dtype=D).unsqueeze(0),
        entropy_top_frac=0.28,
    )
    assert close(some, -7 / 25)


def test_entropy_is_reported_without_selection():
    logp = t([[0.0, 0.0]])
    loss, st = loss_of(logp, logp, t([1.0]), t([[1, 0]]), entropy=t([[0.4, 7.0]]))
    assert st["entropy"] == pytest.approx(0.4) and close(loss, -1.0)


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_gradient_step_moves_logp_with_the_advantage(importance, sign):
    # A 3-token policy; the sampled sequence is tokens 0, 2.  A > 0 must raise its log-prob, A < 0 lower it.
    theta = torch.zeros(3, dtype=D, requires_grad=True)
    ids = torch.tensor([[0, 2]])

    def seq_logp():
        logp, _ = chunked_token_logprobs(torch.ones(2, 1, dtype=D), lambda h: h * theta, ids[0], chunk_size=1)
        return logp.unsqueeze(0)

    before = seq_logp().sum().item()
    old = seq_logp().detach()
    loss, _ = loss_of(seq_logp(), old, t([sign]), t([[1, 1]]), importance=importance)
    loss.backward()
    with torch.no_grad():
        theta -= 0.1 * theta.grad
    after = seq_logp().sum().item()
    assert (after - before) * sign > 0


def test_unknown_options_are_refused():
    logp = t([[0.0]])
    with pytest.raises(ValueError, match="importance"):
        loss_of(logp, logp, t([1.0]), t([[1]]), importance="episode")
    with pytest.raises(ValueError, match="aggregation"):
        loss_of(logp, logp, t([1.0]), t([[1]]), aggregation="sum")


# --- helpers -------------------------------------------------------------------------------


def test_check_finite_raises_before_the_optimizer_step():
    check_finite("the loss", t(1.5))
    with pytest.raises(RlcliError, match=r"the loss is NaN/inf .*before the optimizer step"):
        check_finite("the loss", t(float("nan")))
    with pytest.raises(RlcliError, match="the rewards is NaN/inf in 1 of 3"):
        check_finite("the rewards", t([0.0, math.inf, 1.0]))


def test_chunked_entropy_is_exact_where_naive_formulas_fail():
    # Uniform over 4: ln 4.  A certain token (others -inf): 0, not NaN.  Huge logits stay finite.
    logits = t([[0.0, 0.0, 0.0, 0.0], [5.0, -math.inf, -math.inf, -math.inf], [1e4, 1e4, -1e4, -1e4]])
    logp, entropy = chunked_token_logprobs(logits, lambda h: h, torch.tensor([1, 0, 0]), chunk_size=2, entropy=True)
    assert close(entropy, [math.log(4), 0.0, LN2], tol=1e-6)
    assert close(logp, [-math.log(4), 0.0, -LN2], tol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunked_token_logprobs_match_a_full_log_softmax(chunk_size, dtype):
    """Logprobs, entropy and the gradients of hidden states and head weights, whatever the chunking,
    equal a full [N, V] log_softmax at temperature 0.7 (bf16 logits are upcast as the model's would be)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 5, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(11, 5, generator=gen).to(dtype).requires_grad_()
    ids = torch.randint(0, 11, (7,), generator=gen)
    upstream = torch.randn(7, generator=gen)

    def head(h):
        return h @ weight.T

    logp, entropy = chunked_token_logprobs(hidden, head, ids, chunk_size=chunk_size, temperature=0.7, entropy=True)
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = (head(hidden).float() / 0.7).log_softmax(-1)
    expected = full.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (expected * upstream).sum().backward()
    assert logp.shape == (7,) and logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not entropy.requires_grad
    tol = 1e-5 if dtype != torch.bfloat16 else 1e-3
    assert torch.allclose(logp, expected.to(logp.dtype), rtol=tol, atol=tol)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1).detach().to(entropy.dtype), rtol=tol, atol=tol)
    # bf16 gradients sum chunk by chunk in bf16 (8 bits of mantissa): a different order, a few ulp apart.
    grad_tol = 1e-5 if dtype != torch.bfloat16 else 3e-2
    for got, want in zip(grads, (hidden.grad, weight.grad)):
        assert torch.allclose(got.float(), want.float(), rtol=grad_tol, atol=grad_tol)


# --- grpo.entropy_target ---------------------------------------------------------------------------


def test_the_entropy_bonus_from_sampled_tokens_ascends_the_exact_entropy():
    """coef * (sg(logp) + H) * logp over tokens sampled from p: its mean gradient with respect to the
    logits is -coef times the gradient of p's entropy, computed exactly by autograd."""
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0], requires_grad=True)
    exact = -(logits.softmax(-1) * logits.log_softmax(-1)).sum()
    (entropy_grad,) = torch.autograd.grad(exact, logits)
    n = 200_000
    tokens = torch.multinomial(
        logits.softmax(-1).detach(), n, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    logp = logits.log_softmax(-1)[tokens].unsqueeze(0)  # one sequence of n sampled tokens
    entropy = exact.detach().expand(1, n)
    zeros, mask = torch.zeros(1, n), torch.ones(1, n)
    loss, _ = policy_loss(
        logp, logp.detach(), zeros[:, 0], mask, clip_low=0.2, clip_high=0.2, entropy=entropy, entropy_coef=0.1
    )
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(grad, -0.1 * entropy_grad, atol=2e-3), (grad, -0.1 * entropy_grad)
    plain, _ = policy_loss(logp, logp.detach(), zeros[:, 0], mask, clip_low=0.2, clip_high=0.2, entropy=entropy)
    assert float(plain.detach()) == 0.0  # no advantage and no bonus: nothing to learn


def test_the_entropy_coefficient_rises_below_the_target_and_falls_above_it():
    from rlcli.engine.grpo.batch import entropy_coefficient
    from rlcli.recipe import load_recipe

    cfg = load_recipe(
        None, ["grpo.entropy_target=0.3", "grpo.entropy_coef_step=0.01", "grpo.entropy_coef_max=0.02"]
    ).grpo
    assert entropy_coefficient(cfg, []) == 0.0
    assert entropy_coefficient(cfg, [0.5, 0.5]) == 0.0  # never below 0
    assert entropy_coefficient(cfg, [0.1]) == pytest.approx(0.01)
    assert entropy_coefficient(cfg, [0.1, 0.1, 0.1]) == pytest.approx(0.02)  # at most entropy_coef_max
    assert entropy_coefficient(cfg, [0.1, 0.1, None, 0.4]) == pytest.approx(0.01)  # None moves nothing
    off = load_recipe(None, []).grpo
    assert entropy_coefficient(off, [0.01, 0.01]) == 0.0  # no target: no bonus
