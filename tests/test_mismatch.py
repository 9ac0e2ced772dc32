"""Rollout/training mismatch correction: the weights against hand-computed values, the loss
mask respected, a bfloat16 engine's bias on the policy gradient removed, and a GRPO run whose
engine runs in another dtype than its trainer."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from reasonctl.algorithms.grpo_loss import PolicyLossSettings, policy_loss
from reasonctl.algorithms.mismatch import MismatchSettings, mismatch_weights


def _close(values: torch.Tensor, expected: list[list[float]]) -> bool:
    return torch.allclose(values, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def _logprobs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(old, behaviour)`` whose per-token ratios ``pi_old / mu`` are ``ratios``."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    return old, old - torch.tensor(ratios).log()


def test_token_weights_are_truncated_and_sequences_outside_the_bounds_dropped() -> None:
    old, behaviour = _logprobs([[1.0, 3.0, 0.5], [0.25, 0.25, 1.0], [1.2, 1.0, 1.0]])
    mask = torch.ones(3, 3)
    tis = mismatch_weights(old, behaviour, mask, MismatchSettings("token_tis", token_cap=2.0))
    assert _close(tis.weights, [[1.0, 2.0, 0.5], [0.25, 0.25, 1.0], [1.2, 1.0, 1.0]])
    assert float(tis.metrics["mismatch/capped_frac"]) == pytest.approx(1 / 9)
    assert float(tis.metrics["mismatch/masked_frac"]) == 0.0
    # geometric means: 1.5 ** (1/3) = 1.14 (kept), 1/16 ** (1/3) = 0.40 (below 0.5), 1.06
    masked = mismatch_weights(old, behaviour, mask,
                              MismatchSettings("seq_mask", seq_low=0.5, seq_high=2.0))
    assert masked.weights.tolist() == [[1.0] * 3, [0.0] * 3, [1.0] * 3]
    assert float(masked.metrics["mismatch/masked_frac"]) == pytest.approx(1 / 3)
    both = mismatch_weights(old, behaviour, mask, MismatchSettings("both", token_cap=2.0))
    assert _close(both.weights, [[1.0, 2.0, 0.5], [0.0] * 3, [1.2, 1.0, 1.0]])
    assert float(both.metrics["mismatch/is_weight_mean"]) == pytest.approx(
        (3.5 + 3.2) / 9)
    high = mismatch_weights(old, behaviour, mask,
                            MismatchSettings("seq_mask", seq_low=0.0, seq_high=1.1))
    assert high.weights[:, 0].tolist() == [0.0, 1.0, 1.0]  # seq_low = 0: no lower bound
    # k3 of KL(mu || pi_old) per token: r - 1 - log r
    expected_kl = sum(r - 1 - math.log(r) for r in (1.0, 3.0, 0.5, 0.25, 0.25, 1.0, 1.2, 1, 1))
    assert float(tis.metrics["mismatch/kl"]) == pytest.approx(expected_kl / 9, rel=1e-5)


def test_off_reports_the_mismatch_and_leaves_the_loss_unchanged() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    off = PolicyLossSettings(mismatch=MismatchSettings("off"))
    loss, metrics = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, off,
                                behaviour_logprobs=behaviour)
    plain, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask,
                           PolicyLossSettings())
    assert float(loss.detach()) == float(plain.detach())
    assert float(metrics["mismatch/kl"]) > 0.0
    assert float(metrics["mismatch/is_weight_mean"]) == 1.0


def test_bit_identical_engine_logprobs_change_nothing_in_any_mode() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=generator) * 3).requires_grad_()
    mask = (torch.rand(3, 5, generator=generator) > 0.3).float()
    advantages = torch.tensor([1.0, -0.5, 2.0])
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, PolicyLossSettings())
    (plain_grad,) = torch.autograd.grad(loss, logprobs)
    for mode in ("token_tis", "seq_mask", "both", "off"):
        settings = PolicyLossSettings(mismatch=MismatchSettings(mode))  # type: ignore[arg-type]
        corrected, metrics = policy_loss(logprobs, logprobs.detach(), advantages, mask,
                                         settings, behaviour_logprobs=logprobs.detach())
        (grad,) = torch.autograd.grad(corrected, logprobs)
        assert torch.equal(corrected.detach(), loss.detach()), mode
        assert torch.equal(grad, plain_grad), mode
        assert float(metrics["mismatch/kl"]) == 0.0
        assert float(metrics["mismatch/masked_frac"]) == 0.0


def test_tokens_outside_the_loss_mask_never_enter_a_ratio() -> None:
    """An episode's observation tokens (no loss, no engine log-prob: 0) and padding leave
    the weights, the sequence means and the metrics alone."""
    old, behaviour = _logprobs([[1.5, 1.5, 1.5, 1.5]])
    behaviour[0, 1:3] = 0.0  # an observation: the engine generated none of it
    old[0, 1:3] = -9.0  # the trainer finds it unlikely
    behaviour[0, 3] = 0.0  # padding
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    settings = MismatchSettings("both", token_cap=2.0, seq_high=1.6)
    result = mismatch_weights(old, behaviour, mask, settings)
    assert _close(result.weights, [[1.5, 0.0, 0.0, 0.0]])
    assert float(result.metrics["mismatch/masked_frac"]) == 0.0
    assert float(result.metrics["mismatch/kl"]) == pytest.approx(0.5 - math.log(1.5))
    assert float(result.metrics["mismatch/capped_frac"]) == 0.0


def test_settings_refuse_bounds_that_exclude_equal_policies() -> None:
    with pytest.raises(ValueError, match="seq_low < 1 < seq_high"):
        MismatchSettings("seq_mask", seq_low=1.0)
    with pytest.raises(ValueError, match="token_cap"):
        MismatchSettings(token_cap=0.5)


# --- a bfloat16 engine against a float32 trainer ------------------------------------------

SHARPEN = 20.0
"""Scale of the tiny model's final norm: random weights give logits of std 0.16, a trained
language model's are spread over several nats; scaled, they have a std of about 3."""
BIAS_AT_LEAST = 1e-2
"""The uncorrected gradient's relative error from a bfloat16 engine (measured: 2.1e-2)."""
CORRECTED_WITHIN = 1e-5
"""The corrected gradient's relative error (measured: 5e-8, float32 rounding)."""


def _policy_gradient(model: Any, prompt: torch.Tensor, sampling_logprobs: torch.Tensor,
                     engine_logprobs: torch.Tensor, advantages: torch.Tensor,
                     correction: str) -> torch.Tensor:
    """The exact expected policy gradient of one-token completions sampled with
    probabilities ``exp(sampling_logprobs)`` whose engine recorded ``engine_logprobs``:
    one row per vocabulary token, its advantage scaled by its sampling probability, through
    the GRPO loss of an on-policy update (old log-probs = the update's own, detached)."""
    vocab = sampling_logprobs.numel()
    rows = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
    model.zero_grad()
    logits = model(rows).logits[:, -2].float()
    logprobs = logits.log_softmax(-1).gather(-1, rows[:, -1:])
    settings = PolicyLossSettings(mismatch=MismatchSettings(correction))  # type: ignore[arg-type]
    loss, _ = policy_loss(logprobs, logprobs.detach(),
                          vocab * sampling_logprobs.exp() * advantages, torch.ones(vocab, 1),
                          settings, behaviour_logprobs=engine_logprobs[:, None],
                          num_tokens=vocab)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_a_bfloat16_engine_biases_the_gradient_and_the_correction_removes_it(
        tiny_model_dir: Path) -> None:
    """Completions sampled by a bfloat16 copy of a float32 policy: the expected gradient of
    the uncorrected update differs from the on-policy one by more than ``BIAS_AT_LEAST``;
    with token-level truncated importance weights (none of which reaches the cap here) it
    equals the on-policy gradient within ``CORRECTED_WITHIN``. Expectations are exact:
    every token of the vocabulary is a row, weighted by its sampling probability."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        trainer.model.norm.weight.mul_(SHARPEN)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    prompt = torch.tensor([1, 5, 9, 30, 40, 50, 60, 70])
    with torch.no_grad():
        policy = trainer(prompt[None]).logits[0, -1].float().log_softmax(-1)
        behaviour = engine(prompt[None]).logits[0, -1].float().log_softmax(-1)
    rewards = (torch.rand(policy.numel(), generator=torch.Generator().manual_seed(0)) < 0.5)
    advantages = rewards.float() - (policy.exp() * rewards).sum()

    on_policy = _policy_gradient(trainer, prompt, policy, policy, advantages, "off")
    uncorrected = _policy_gradient(trainer, prompt, behaviour, behaviour, advantages, "off")
    corrected = _policy_gradient(trainer, prompt, behaviour, behaviour, advantages, "token_tis")
    scale = on_policy.norm()
    assert float((uncorrected - on_policy).norm() / scale) > BIAS_AT_LEAST
    assert float((corrected - on_policy).norm() / scale) < CORRECTED_WITHIN
    assert float((behaviour - policy).exp().max()) < 2.0  # no weight reached the cap


def test_grpo_with_a_bfloat16_engine_reports_and_corrects_the_mismatch(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """``rollout.hf.dtype = "bfloat16"`` under a float32 trainer: the same rollouts, and the
    corrected update (the default) differs from the uncorrected one by its weights."""
    import reasonctl
    from tests.test_grpo import _config, byte_parity

    runs: dict[str, list[dict[str, Any]]] = {}
    for correction in ("token_tis", "off"):
        config = _config(tmp_path / correction, tiny_model_dir)
        config["train"]["max_steps"] = 1
        config["rollout"]["hf"] = {"dtype": "bfloat16"}
        if correction == "off":
            config["algorithm"]["grpo"]["mismatch"] = {"correction": "off"}
        reasonctl.run(config, rewards=[byte_parity])
        lines = (tmp_path / correction / "run" / "metrics.jsonl").read_text().splitlines()
        runs[correction] = [json.loads(line) for line in lines]
    (tis,), (off,) = runs["token_tis"], runs["off"]
    assert tis["reward/mean"] == off["reward/mean"]  # the engine sampled the same completions
    assert tis["rollout/logprob_gap"] > 1e-3  # bfloat16 against float32
    assert tis["mismatch/kl"] > 0.0 and off["mismatch/kl"] == tis["mismatch/kl"]
    assert tis["mismatch/is_weight_mean"] != 1.0 and off["mismatch/is_weight_mean"] == 1.0
    assert tis["loss"] != off["loss"]


def test_importance_cap_of_the_workers_names_its_new_place() -> None:
    import reasonctl
    from reasonctl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.grpo.mismatch.token_cap"):
        reasonctl.load_config(values={"rollout": {"workers": {"importance_cap": 3.0}}})


def test_settings_the_correction_does_not_read_are_warned_about() -> None:
    from reasonctl.algorithms.grpo_config import GRPOConfig

    warned = GRPOConfig(mismatch={"correction": "token_tis", "seq_low": 0.8}).config_warnings()
    assert any("seq_low set, but correction = 'token_tis'" in w for w in warned)
    assert not GRPOConfig(mismatch={"correction": "both", "seq_low": 0.8}).config_warnings()
