"""Token log-probs and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds the logits of a contiguous slice of the (padded)
vocabulary. The log-softmax is assembled across the group: the max is all-reduced (MAX,
no gradient: the result does not depend on it), the sum of exponentials and the target
logit are all-reduced (SUM). Those sums use an all-reduce whose backward is the identity,
which is exact because every output is a function of the global sums alone: each rank
computes the same loss from the same sums, so the gradient reaching rank ``r``'s partial
sum is the gradient of that loss with respect to the global sum. (So entropy is computed
as ``log S - T / S`` with ``S = sum(e^x)`` and ``T = sum(e^x * x)``: written with local
probabilities, the gradient of ``log S`` would see only the local terms.) megatron's
``reduce_from_tensor_model_parallel_region`` has the same semantics; this module keeps
its own so it works with any process group.

Columns past the real vocabulary (padding) are excluded from the softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from reasonctl.backends.token_logprobs import TokenLogprobs

_EXCLUDED = -1e30


class _SumAcrossGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum(tensor: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    return tensor if size == 1 else _SumAcrossGroup.apply(tensor, group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Any = None,
    group_size: int = 1,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """``log_softmax(logits / temperature)`` at ``targets`` over the whole vocabulary.

    ``logits`` is ``[..., V_local]``: this rank's columns ``vocab_start ..
    vocab_start + V_local - 1`` of the padded vocabulary; ``vocab_size`` is the real
    vocabulary (columns from there on are padding). ``targets`` holds global token ids and
    has ``logits``' leading shape. Returns float32 log-probs (and entropy) of that shape.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive (got {temperature})")
    local_width = logits.shape[-1]
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    columns = torch.arange(vocab_start, vocab_start + local_width, device=x.device)
    padded = columns >= vocab_size
    if bool(padded.any()):
        x = x.masked_fill(padded, _EXCLUDED)
    peak = x.detach().amax(dim=-1)
    if group_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = x - peak.unsqueeze(-1)
    exps = shifted.exp()
    total = _sum(exps.sum(dim=-1), group, group_size)
    normaliser = total.log()
    local_target = targets - vocab_start
    mine = (local_target >= 0) & (local_target < local_width)
    picked = shifted.gather(-1, local_target.clamp(0, local_width - 1).unsqueeze(-1)).squeeze(-1)
    picked = _sum(picked * mine, group, group_size)
    logprobs = picked - normaliser
    entropy = None
    if with_entropy:  # H = log S - T / S with S = sum(e^x), T = sum(e^x * x) over the vocabulary
        weighted = _sum((exps * shifted).sum(dim=-1), group, group_size)
        entropy = normaliser - weighted / total
    return TokenLogprobs(logprobs, entropy)
