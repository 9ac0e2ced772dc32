"""Checks of shared-prompt rows on a CUDA GPU: PyTorch's variable-length flash attention,
as :func:`~reasonctl.models.varlen_attention.varlen_attention` calls it, equals the
per-segment reference (lower-right causal mask with shorter queries than keys,
grouped-query heads, gradients), and a bfloat16 model scores shared-prompt rows as it
scores padded ones.

On a GPU machine, from the repository root:

    python -m pytest --noconftest tests/cuda_checks_shared_prompt.py
"""

from __future__ import annotations

import pytest
import torch

from reasonctl.models.varlen_attention import (
    _flash_varlen,
    varlen_attention,
    varlen_attention_reference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _segments() -> tuple[list[int], list[int]]:
    prompts, completions = [300, 47], [[128, 1, 77], [256]]
    q_lengths, k_lengths = [], []
    for prompt, own in zip(prompts, completions, strict=True):
        q_lengths.append(prompt)
        k_lengths.append(prompt)
        for length in own:
            q_lengths.append(length)
            k_lengths.append(prompt + length)
    return q_lengths, k_lengths


@pytest.mark.parametrize("heads", [(8, 8), (28, 4)])
def test_flash_varlen_equals_the_reference(heads: tuple[int, int]) -> None:
    assert _flash_varlen() is not None, "this PyTorch has no variable-length flash attention"
    torch.manual_seed(0)
    q_lengths, k_lengths = _segments()
    hq, hkv = heads
    query = torch.randn(sum(q_lengths), hq, 128, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(sum(k_lengths), hkv, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    cu_q = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], device="cuda",
                        dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lengths).cumsum(0).tolist()], device="cuda",
                        dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out = varlen_attention(*leaves, cu_q, cu_k, max(q_lengths), max(k_lengths), scale=0.1)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact = [t.float().clone().requires_grad_() for t in (query, key, value)]
    want = varlen_attention_reference(*exact, cu_q, cu_k, scale=0.1)
    want.backward(grad.float())
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    for got, ref in zip(leaves, exact, strict=True):
        assert got.grad is not None and ref.grad is not None
        error = (got.grad.float() - ref.grad).norm() / ref.grad.norm()
        assert float(error) < 2e-2


def test_bfloat16_vl_model_scores_shared_prompt_rows_as_padded_rows() -> None:
    from transformers import AutoModelForImageTextToText

    from reasonctl.algorithms.policy_batch import (
        collate_policy_rows,
        policy_rows,
        shared_prompt_micro_batches,
    )
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.core.types import Completion, RolloutGroup, Sample
    from reasonctl.data.processing import EncodedSample
    from reasonctl.models.tiny import build_tiny_tokenizer
    from reasonctl.models.tiny_vl import tiny_qwen2_5_vl_config

    tokenizer = build_tiny_tokenizer()
    config = tiny_qwen2_5_vl_config(
        tokenizer, hidden_size=256, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                "mrope_section": [4, 6, 6]})
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    generator = torch.Generator().manual_seed(0)
    groups = []
    for prompt_len in (400, 123):
        ids = torch.randint(10, 200, (prompt_len,), generator=generator).tolist()
        prompt = EncodedSample(ids, [0] * prompt_len)
        completions = [Completion(text="", token_ids=torch.randint(
            10, 200, (length,), generator=generator).tolist(), logprobs=[0.0] * length,
            finish_reason="stop") for length in (90, 300, 1)]
        groups.append(RolloutGroup(sample=Sample([]), prompt_ids=ids,
                                   completions=completions, prompt=prompt))
    rows = policy_rows(groups, [0.0] * 6)
    policy = TokenLogprobModel(model)
    with torch.no_grad():
        padded = policy({k: v.cuda() for k, v in collate_policy_rows(rows, 0).items()})[0]
        (_, shared), = shared_prompt_micro_batches(rows, 0, budget=100_000)
        shared = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in shared.items()}
        got = policy(shared)[0]
    mask = collate_policy_rows(rows, 0)["completion_mask"].cuda().bool()
    assert float((got[mask] - padded[mask]).abs().mean()) < 2e-2


def test_vision_tower_through_flash_varlen_equals_its_sdpa_loop() -> None:
    from transformers import AutoModelForImageTextToText

    from reasonctl.models.tiny import build_tiny_tokenizer
    from reasonctl.models.tiny_vl import tiny_qwen2_5_vl_config
    from reasonctl.models.varlen_attention import enable_vision_varlen_attention

    config = tiny_qwen2_5_vl_config(build_tiny_tokenizer())
    config.vision_config.update({"hidden_size": 256, "num_heads": 4, "intermediate_size": 512})
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    grid = torch.tensor([[4, 16, 24], [2, 8, 8]], device="cuda")
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda",
                         dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.cat(model.model.get_video_features(pixels, grid,
                                                        return_dict=True).pooler_output)
        assert enable_vision_varlen_attention(model)
        got = torch.cat(model.model.get_video_features(pixels, grid,
                                                       return_dict=True).pooler_output)
    error = (got.float() - want.float()).norm() / want.float().norm()
    assert float(error) < 2e-2
