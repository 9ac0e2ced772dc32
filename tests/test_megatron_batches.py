"""Micro-batch layout and single-group log-probs of the megatron backend (no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from reasonctl.backends.megatron.batches import common_shape, prepare, segments_of, split_rows
from reasonctl.backends.megatron.logprobs import vocab_parallel_logprobs
from reasonctl.core.errors import ReasonctlError


def test_padded_batch_keeps_rows_and_masks_padding_keys() -> None:
    ids = torch.arange(1, 13).view(2, 6)
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    prepared = prepare({"input_ids": ids, "attention_mask": attention}, rows=3, length=8)
    assert prepared.shape == (3, 8)
    assert torch.equal(prepared.tokens[:2, :6], ids)
    mask = prepared.attention_mask[:, 0]
    assert mask[0, 3, 4]  # a right-padding key
    assert mask[1, 3, 0]  # a left-padding key
    assert not mask[1, 3, 1] and mask[1, 3, 4]  # causal
    assert mask[2].all()  # the filler row attends to nothing
    values = torch.arange(3 * 7, dtype=torch.float32).view(3, 7)
    assert torch.equal(prepared.restore(values), values[:2, :5])


def test_packed_rows_are_unpacked_and_restored() -> None:
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert [(s.row, s.start, s.length) for s in segments_of(batch)] == [(0, 0, 3), (0, 3, 2)]
    prepared = prepare(batch)
    assert prepared.tokens.tolist() == [[5, 6, 7], [8, 9, 0]]
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert prepared.restore(values).tolist() == [[1.0, 2.0, 0.0, 3.0]]
    with pytest.raises(ReasonctlError, match="count up by 1"):
        segments_of({"input_ids": batch["input_ids"],
                     "position_ids": torch.tensor([[0, 2, 3, 0, 1]])})


def test_split_rows_and_common_shape() -> None:
    batch = {"input_ids": torch.zeros(5, 4, dtype=torch.long), "advantages": torch.ones(5),
             "scale": torch.tensor(2.0)}
    pieces = split_rows(batch, 2)
    assert [p["input_ids"].shape[0] for p in pieces] == [2, 2, 1]
    assert all(p["scale"] is batch["scale"] for p in pieces)
    assert common_shape([batch, {"input_ids": torch.zeros(1, 9, dtype=torch.long)}]) == (5, 9)


def test_single_group_logprobs_exclude_padded_vocabulary() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 16, requires_grad=True)
    targets = torch.randint(0, 12, (2, 5))
    out = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=12,
                                  temperature=0.5, with_entropy=True)
    reference = torch.log_softmax(logits[..., :12] / 0.5, -1)
    expected = reference.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(reference.exp() * reference).sum(-1)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)
    assert torch.allclose(out.entropy, entropy, atol=1e-5)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert not logits.grad[..., 12:].any()
