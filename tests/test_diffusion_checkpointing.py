"""``model.gradient_checkpointing = "auto"``: partial checkpointing keeps gradients, the
plan picks the fewest blocks that fit, and on the CPU ``auto`` keeps every activation."""

from __future__ import annotations

import pytest
import torch

from reasonctl.diffusion.checkpointing import (
    ActivationProfile,
    CheckpointPlan,
    checkpoint_blocks,
    fewest_checkpointed,
    largest_uncheckpointed,
    plan_checkpointing,
    transformer_blocks,
)


def _wan(layers: int = 3) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _grads(model: torch.nn.Module, calls: list[int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 2, 8, 8, generator=generator)
    text = torch.randn(2, 5, 16, generator=generator)
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(hidden_states=latents, timestep=torch.tensor([500.0, 200.0]),
                encoder_hidden_states=text, return_dict=False)[0]
    out.square().mean().backward()
    calls.append(0)
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_partial_checkpointing_recomputes_only_the_chosen_blocks_with_equal_gradients() -> None:
    model = _wan()
    blocks = transformer_blocks(model)
    assert len(blocks) == 3
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    marks: list[int] = []
    plain = _grads(model, marks)
    assert counts == [1, 1, 1]
    checkpoint_blocks(model, blocks[:2])
    counts[:] = [0, 0, 0]
    partial = _grads(model, marks)
    assert counts == [2, 2, 1]  # checkpointed blocks run again in backward
    checkpoint_blocks(model, blocks[1:], prefer_cudnn=True)  # recomputed under the preference
    counts[:] = [0, 0, 0]
    preferred = _grads(model, marks)
    assert counts == [1, 2, 2]
    checkpoint_blocks(model, ())
    counts[:] = [0, 0, 0]
    _grads(model, marks)
    assert counts == [1, 1, 1]
    assert plain.keys() == partial.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(partial[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(preferred[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_cudnn_attention_is_preferred_only_where_asked_and_keeps_the_output() -> None:
    from reasonctl.diffusion.attention import attention_context, prefers_cudnn

    cpu = torch.device("cpu")
    assert not any(prefers_cudnn(s, cpu) for s in (True, False, "auto"))
    q = torch.randn(1, 2, 6, 8)
    plain = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with attention_context(True):
        preferred = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(preferred, plain)


def test_the_plan_checkpoints_the_fewest_blocks_that_fit() -> None:
    profile = ActivationProfile(blocks=10, per_block=100.0, block_input=10.0, outside=50.0,
                                fixed=1000.0, transient=200.0)
    # nothing checkpointed: 1000 + 4 * (50 + 1000) + 200 = 5400
    assert profile.need(0, 4) == 5400.0
    assert fewest_checkpointed(profile, 4, 5400.0) == 0
    # each checkpointed block saves 4 * 90; the first one costs a recomputed block (400)
    assert profile.need(3, 4) == 5400.0 - 3 * 360.0 + 400.0
    assert fewest_checkpointed(profile, 4, 5000.0) == 3
    assert fewest_checkpointed(profile, 4, 100.0) == 10  # never fits: every block
    # 1000 + n * 1050 + 200 <= 4000: two transitions fit with nothing checkpointed
    assert largest_uncheckpointed(profile, 4000.0, 4) == 2
    assert largest_uncheckpointed(profile, 100.0, 4) == 0
    line = CheckpointPlan(3, 10, 2).describe(4)
    assert "3 of 10 block(s)" in line and "train.micro_batch_size = 2 would need none" in line


def test_auto_on_a_cpu_keeps_every_activation() -> None:
    model = _wan(2)
    model.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(model.parameters())
    plan = plan_checkpointing(model, optimizer, lambda n: None, size=4,
                              device=torch.device("cpu"))
    assert (plan.checkpointed, plan.blocks) == (0, 2) and not model.gradient_checkpointing


def test_auto_is_a_valid_setting_and_other_strings_are_not() -> None:
    from pydantic import ValidationError

    from reasonctl.core.config.schema import ModelSection

    assert ModelSection(gradient_checkpointing="auto").gradient_checkpointing == "auto"
    with pytest.raises(ValidationError):
        ModelSection(gradient_checkpointing="sometimes")
