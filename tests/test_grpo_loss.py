"""GRPO loss math against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from reasonctl.algorithms.grpo_loss import (
    PolicyLossSettings,
    aggregate,
    group_advantages,
    importance_log_ratio,
    kl_estimate,
    policy_loss,
    reward_moments,
    std_from_moments,
)


def test_group_advantages_scaled_by_unbiased_group_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, 2)
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); the equal group gets zeros
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected, 0.0, 0.0])


def test_group_advantages_without_std_scaling_is_centred_reward() -> None:
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 3, scale="none")
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])


def test_batch_scaling_divides_by_the_std_of_all_rewards() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, 2, scale="batch")
    batch_std = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]).std().item()  # unbiased, TRL too
    expected = 0.5 / (batch_std + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected, 0.0, 0.0])
    # the same std from moments added up over two processes' halves
    halves = [reward_moments(rewards[:4]), reward_moments(rewards[4:])]
    summed = [a + b for a, b in zip(*halves, strict=True)]
    assert std_from_moments(*summed) == pytest.approx(batch_std)
    spread = group_advantages(rewards, 2, scale="batch", batch_std=2.0)
    assert spread.tolist()[0] == pytest.approx(0.5 / (2.0 + 1e-6))


def test_unscored_completions_leave_the_baseline_with_zero_advantage() -> None:
    """Completions every reward returned None for do not move the group mean or std and
    get advantage 0; the expected values use NaN for them and NaN-aware statistics."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0, 3.0, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False, True, True, False, False])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 4, scale=scale, valid=valid)
        nan = torch.where(valid, rewards.double(), torch.nan).view(-1, 4)
        mean = torch.nanmean(nan, dim=1, keepdim=True)
        centred = nan - mean
        if scale == "group":
            count = (~nan.isnan()).sum(1, keepdim=True)
            std = (torch.nansum(centred.square(), 1, keepdim=True) / (count - 1)).sqrt()
            centred = centred / (std + 1e-6)
        elif scale == "batch":
            flat = nan[~nan.isnan()]
            centred = centred / (flat.std() + 1e-6)
        expected = torch.nan_to_num(centred, nan=0.0).view(-1)
        assert adv.tolist() == pytest.approx(expected.tolist(), abs=1e-12)
        assert adv[3] == 0 and adv[6] == 0 and adv[7] == 0
    # a group of one scored completion: no baseline to compare with, advantage 0
    assert group_advantages(rewards, 4, valid=valid).tolist()[4:] == pytest.approx(
        [0.0, 0.0, 0.0, 0.0])


def test_group_advantages_rejects_ragged_groups() -> None:
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)


def test_kl_estimators_match_closed_forms() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # d = ref - logp = log(1/2)
    d = math.log(0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - d - 1)
    same = kl_estimate(logp, logp, "k3")
    assert same.item() == 0.0


def test_token_ratio_clipping_is_pessimistic_and_counts_clipped_tokens() -> None:
    old = torch.zeros(1, 4)
    # ratios 1.5, 1.5, 0.5, 1.25 with advantages +1, -1, -1 per sequence below
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.25]])).repeat(3, 1)
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    settings = PolicyLossSettings(epsilon_low=0.2, epsilon_high=0.28,
                                  loss_aggregation="token-mean")
    loss, metrics = policy_loss(logp, old.expand(3, 4), adv, mask, settings)
    # A=+1: -min(r, clip(r)) -> [-1.28, -1.28, -0.5, -1.25]
    # A=-1: max(r, clip(r))  -> [1.5, 1.5, 0.8, 1.25]
    expected = (-1.28 - 1.28 - 0.5 - 1.25 + 1.5 + 1.5 + 0.8 + 1.25) / 8
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac/high"] == pytest.approx(2 / 8)
    assert metrics["clip_frac/low"] == pytest.approx(1 / 8)
    loss.backward()
    grad = logp.grad
    assert grad is not None
    # clipped tokens carry no gradient; unclipped ones get -A * r / N
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, -0.5 / 8, -1.25 / 8])
    assert grad[1].tolist() == pytest.approx([1.5 / 8, 1.5 / 8, 0.0, 1.25 / 8])
    assert grad[2].abs().sum().item() == 0.0


def test_aggregations_on_a_ragged_batch() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", max_tokens=4).item() == (
        pytest.approx((6 / 4 + 4 / 4) / 2)
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_global_normalisers_make_micro_batches_add_up(mode: str) -> None:
    torch.manual_seed(0)
    values = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    whole = aggregate(values, mask, mode, max_tokens=5)
    tokens, sequences = float(mask.sum()), 6.0
    parts = sum(
        aggregate(values[i : i + 2], mask[i : i + 2], mode, num_tokens=tokens,
                  num_sequences=sequences, max_tokens=5)
        for i in range(0, 6, 2)
    )
    assert float(parts) == pytest.approx(whole.item(), abs=1e-6)


def test_sum_norm_needs_its_constant() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")


def test_sequence_level_ratio_is_the_masked_mean_log_ratio() -> None:
    logp = torch.tensor([[0.1, 0.3, 5.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    ratio = importance_log_ratio(logp, old, mask, "sequence")
    assert ratio[0].tolist() == pytest.approx([0.2, 0.2, 0.2])
    assert importance_log_ratio(logp, old, mask, "token")[0].tolist() == pytest.approx(
        [0.1, 0.3, 5.0]
    )


def test_sequence_level_clipping_clips_whole_sequences() -> None:
    logp = torch.tensor([[0.5, 0.5], [0.05, 0.05]])
    old = torch.zeros(2, 2)
    settings = PolicyLossSettings(importance_level="sequence")
    _, metrics = policy_loss(logp, old, torch.tensor([1.0, 1.0]), torch.ones(2, 2), settings)
    # exp(0.5) > 1.2 clips both tokens of row 0; exp(0.05) < 1.2 clips nothing
    assert metrics["clip_frac/high"] == pytest.approx(0.5)


def test_kl_penalty_and_entropy_bonus_enter_the_loss() -> None:
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    entropy = torch.tensor([[1.0, 3.0]])
    mask = torch.ones(1, 2)
    base = PolicyLossSettings()
    plain, _ = policy_loss(logp, logp, torch.tensor([0.5]), mask, base)
    assert plain.item() == pytest.approx(-0.5)
    settings = PolicyLossSettings(kl_beta=0.1, kl_estimator="k3", entropy_bonus=0.01)
    loss, metrics = policy_loss(logp, logp, torch.tensor([0.5]), mask, settings,
                                ref_logprobs=ref, entropy=entropy)
    k3 = 0.5 - math.log(0.5) - 1
    assert metrics["kl"] == pytest.approx(k3)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-0.5 + 0.1 * k3 - 0.01 * 2.0)


def test_rollouts_of_an_older_policy_get_truncated_importance_weights() -> None:
    """Decoupled PPO: the clipped term against the proximal (old) policy, times the constant
    min(pi_old / pi_behaviour, cap) per token."""
    from reasonctl.algorithms.mismatch import MismatchSettings

    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach().clone()  # on-policy update: the proximal policy is the current one
    behaviour = torch.tensor([[-1.0, -2.0 - math.log(3.0), -0.5 + math.log(2.0)]])
    mask = torch.ones(1, 3)
    settings = PolicyLossSettings(mismatch=MismatchSettings(token_cap=2.0))
    loss, metrics = policy_loss(logprobs, old, torch.tensor([1.0]), mask, settings,
                                behaviour_logprobs=behaviour)
    loss.backward()
    # weights 1, min(3, 2) = 2, 1/2; d(-A * ratio)/dlogp = -A * weight at ratio 1
    assert logprobs.grad[0].tolist() == pytest.approx([-1 / 3, -2 / 3, -0.5 / 3])
    assert metrics["mismatch/is_weight_mean"] == pytest.approx((1 + 2 + 0.5) / 3)
    assert metrics["mismatch/capped_frac"] == pytest.approx(1 / 3)
    plain, plain_metrics = policy_loss(logprobs.detach(), old, torch.tensor([1.0]), mask,
                                       PolicyLossSettings(), behaviour_logprobs=behaviour)
    assert float(plain) == pytest.approx(-1.0) and "mismatch/kl" not in plain_metrics


def test_gspo_with_token_sums_is_warned_about() -> None:
    from reasonctl.algorithms.grpo_config import GRPOConfig

    assert GRPOConfig(importance_level="sequence").config_warnings()  # token-mean default
    assert GRPOConfig(importance_level="sequence",
                      loss_aggregation="seq-mean-token-sum-norm").config_warnings()
    assert not GRPOConfig(importance_level="sequence",
                          loss_aggregation="seq-mean-token-mean").config_warnings()
    assert not GRPOConfig().config_warnings()


def test_grpo_training_rows_leave_completions_no_reward_scored_at_zero(
        caplog: pytest.LogCaptureFixture) -> None:
    """GRPO's step turns all-None reward components into advantage 0 and a warning."""
    from types import SimpleNamespace

    from reasonctl.algorithms.grpo import GRPO, _Rollout
    from reasonctl.algorithms.grpo_config import GRPOConfig
    from reasonctl.core.types import Completion, RolloutGroup, Sample
    from reasonctl.data.processing import EncodedSample

    def group(scores: list[float | None]) -> RolloutGroup:
        completions = [Completion(str(i), [i + 1], [0.0]) for i in range(len(scores))]
        return RolloutGroup(Sample([]), [0], completions,
                            rewards=[s or 0.0 for s in scores],
                            reward_components={"math": scores},
                            prompt=EncodedSample([0], [0], num_prompt_tokens=1))

    rollout = _Rollout(groups=[group([1.0, None, 0.0, 0.0]), group([None, None, 1.0, 0.0])],
                       kept=[0, 1])
    backend = SimpleNamespace(world_size=1)
    with caplog.at_level("WARNING", logger="reasonctl.algorithms.grpo"):
        rows = GRPO(GRPOConfig(scale_rewards="none"))._training_rows(rollout, backend)
    assert [row.advantage for row in rows] == pytest.approx(
        [1 - 1 / 3, 0.0, -1 / 3, -1 / 3, 0.0, 0.0, 0.5, -0.5])
    assert "3 of 8 completions got None from every reward" in caplog.text


def test_per_token_advantages_weight_each_token() -> None:
    # one sequence, on-policy (ratio 1): the gradient of token t is -A[t] / N
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    settings = PolicyLossSettings(loss_aggregation="token-mean")
    per_token = torch.tensor([[1.0, 0.0, -2.0], [0.5, 0.5, 0.5]])
    loss, _ = policy_loss(logp, logp.detach(), per_token, mask, settings)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 6, 0.0, 2 / 6], [-0.5 / 6] * 3]))
    # one value per sequence is the same as that value on each of its tokens
    same, _ = policy_loss(logp.detach(), logp.detach(), torch.tensor([0.5, -1.0]), mask, settings)
    spread, _ = policy_loss(logp.detach(), logp.detach(),
                            torch.tensor([[0.5] * 3, [-1.0] * 3]), mask, settings)
    assert same.item() == pytest.approx(spread.item())
    with pytest.raises(ValueError, match=r"advantages of shape \(2, 2\)"):
        policy_loss(logp.detach(), logp.detach(), torch.ones(2, 2), mask, settings)
