"""Context parallelism: every sequence of a batch split over the ranks of a ``cp`` group.

**Layout.** A batch of length ``T`` is padded to ``Tp`` (a multiple of ``2 x cp``) and cut
into ``2 x cp`` chunks of ``S = Tp / (2 x cp)`` tokens; rank ``r`` of the group holds chunks
``r`` and ``2 x cp - 1 - r``. Under causal attention a late chunk attends to many more keys
than an early one, so pairing them gives every rank the same work.

**Attention.** Each decoder layer all-gathers the group's keys and values (one collective
per layer; its backward reduce-scatters their gradients), then each local chunk attends to
the keys before and within it: scaled dot-product attention with a lower-right causal
mask, which dispatches to the flash/memory-efficient kernels on CUDA and needs no mask
tensor. With grouped-query attention the keys and values are a fraction of the queries,
so gathering them whole costs little next to the attention itself. Packed rows (several
samples in one row) and rows padded anywhere but at the end attend through an explicit
mask built once per batch.

**Why not torch's context-parallel API.** ``torch.distributed.tensor.experimental.
context_parallel`` rings keys/values through the flash/memory-efficient/cuDNN attention
kernels of CUDA only (no gloo/CPU run to check it against) and takes plain causal masks
only, while packed rows need document masks; a Ulysses all-to-all needs the heads
(``heads / cp`` each) to divide evenly, which small-KV grouped-query models often do not.
All-gathering the keys/values works for every case above on gloo and NCCL alike; its
memory is the sequence's keys/values per layer (a fraction of the activations with
grouped-query attention). The world-model diffusion transformers are not split yet (a
follow-up once their backend lands).

**Hooks into transformers.** Nothing of the model is rewritten: a forward pre-hook on the
text decoder (the module that owns ``layers``: ``model.model`` of Qwen2/2.5/3,
``model.model.language_model`` of Qwen-VL) takes the full-length input embeddings and
positions the model computed (vision features already merged, 3D rotary positions already
derived), pads them, keeps this rank's chunks and passes the batch's :class:`ShardPlan` as
the attention mask of every layer, which the registered attention function
(:data:`ATTENTION_NAME`) reads. The decoder then returns hidden states of the local tokens
only.

**Log-probs.** :class:`~reasonctl.backends.token_logprobs.TokenLogprobModel` scores the
local tokens and gathers them into the full ``[B, T - 1]`` tensor on every rank of the
group, so loss functions see exactly what they see without context parallelism and every
rank of the group computes the same loss. The gather's backward keeps this rank's slice of
the gradient (no reduction: the peers hold the same gradient), and the data-parallel
gradient reduction, which spans the ``cp`` ranks too, adds their contributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reasonctl.backends.distributed import all_gather_into, reduce_scatter_into
from reasonctl.core.errors import ConfigError
from reasonctl.models.shared_prompt_attention import language_decoder

ATTENTION_NAME = "reasonctl_context_parallel"
"""The name the attention function is registered under in transformers."""


@dataclass
class ShardPlan:
    """How one batch is split over the context-parallel group (built per forward pass).

    ``index`` holds the global positions of this rank's tokens, ``documents`` the sample
    of every position of a packed row (``None`` when no row is packed) and ``key_valid``
    which positions are real tokens when some row is padded other than at its end
    (``None`` otherwise); both are ``[B, padded]``.
    """

    group: Any
    size: int
    rank: int
    length: int
    padded: int
    chunk: int
    index: torch.Tensor
    documents: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunk indices this rank holds, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def gather(self, local: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
        """The full-length tensor of every rank's ``local`` values along ``dim`` (global
        order); the backward pass keeps this rank's slice of the gradient."""
        return _GatherReplicated.apply(local, self, dim)

    def attention_mask(self, slot: int, device: torch.device) -> torch.Tensor | None:
        """The boolean ``[B, 1, S, end]`` mask of local chunk ``slot`` (``None`` when the
        lower-right causal pattern alone is right)."""
        if self.documents is None and self.key_valid is None:
            return None
        if slot not in self._masks:
            chunk = self.chunks[slot]
            start, end = chunk * self.chunk, (chunk + 1) * self.chunk
            queries = torch.arange(start, end, device=device)
            keys = torch.arange(end, device=device)
            allowed = (keys[None, :] <= queries[:, None]).unsqueeze(0)
            if self.documents is not None:
                docs = self.documents.to(device)
                allowed = allowed & (docs[:, start:end, None] == docs[:, None, :end])
            if self.key_valid is not None:
                allowed = allowed & self.key_valid.to(device)[:, None, :end]
            # a query always sees itself, so a padded position never has an empty softmax
            allowed = allowed | (keys[None, :] == queries[:, None]).unsqueeze(0)
            self._masks[slot] = allowed.unsqueeze(1)
        return self._masks[slot]


class ContextParallel:
    """A context-parallel group and the hooks that split a model's sequences over it."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.active: ShardPlan | None = None
        """The plan of the forward pass in progress (read by the decoder's pre-hook)."""

    def plan(self, batch: dict[str, Any]) -> ShardPlan:
        """Split ``batch`` (``input_ids [B, T]``, optional ``attention_mask`` or packed
        ``position_ids``) over the group."""
        input_ids = batch["input_ids"]
        device = input_ids.device
        length = int(input_ids.shape[1])
        parts = 2 * self.size
        padded = max(parts, math.ceil(length / parts) * parts)
        chunk = padded // parts
        first, second = self.rank, parts - 1 - self.rank
        index = torch.cat([
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ])
        plan = ShardPlan(self.group, self.size, self.rank, length, padded, chunk, index)
        mask = batch.get("attention_mask")
        positions = batch.get("position_ids")
        if mask is None and positions is not None and positions.dim() == 2:
            starts = positions == 0
            if bool(starts[:, 1:].any()):  # several samples in a row
                documents = starts.long().cumsum(dim=1)
                plan.documents = F.pad(documents, (0, padded - length), value=-1)
        if mask is not None:
            valid = mask.bool()
            trailing = bool((valid[:, 1:] <= valid[:, :-1]).all())
            if not trailing:
                plan.key_valid = F.pad(valid, (0, padded - length), value=False)
        return plan

    def shard_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook of the text decoder: keep this rank's tokens (see the module
        docstring)."""
        plan = self.active
        if plan is None:
            return None
        if args:
            raise TypeError("context parallelism expects the decoder's inputs by keyword")
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = module.embed_tokens(kwargs["input_ids"])
        batch, length = embeds.shape[:2]
        if length != plan.length:
            raise ValueError(f"the decoder got {length} positions but the batch has "
                             f"{plan.length}")
        extra = plan.padded - length
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=embeds.device).expand(batch, length)
        embeds = F.pad(embeds, (0, 0, 0, extra))
        positions = F.pad(positions, (0, extra))
        kwargs["input_ids"] = None
        kwargs["inputs_embeds"] = embeds.index_select(1, plan.index)
        kwargs["position_ids"] = positions.index_select(-1, plan.index)
        layer_types = getattr(module.config, "layer_types", None) or ["full_attention"]
        kwargs["attention_mask"] = dict.fromkeys(layer_types, plan)
        return args, kwargs


def text_decoder(hf_model: nn.Module) -> nn.Module:
    """The module that runs the decoder layers of ``hf_model`` (owns ``layers``)."""
    candidate = language_decoder(hf_model)
    if candidate is not None:
        return candidate
    raise ConfigError([f"backend.fsdp.cp > 1: {type(hf_model).__name__} has no decoder with "
                       "`layers` to split (Qwen2/2.5/3 and Qwen-VL language towers are "
                       "supported); set cp = 1"])


def check_context_parallel(hf_model: nn.Module, cp: int) -> None:
    """Raise :class:`ConfigError` naming every reason ``hf_model`` cannot run with ``cp``."""
    decoder = text_decoder(hf_model)
    config = decoder.config
    problems = []
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        problems.append("backend.fsdp.cp > 1 does not support sliding-window attention; "
                        "set the model's use_sliding_window = false or cp = 1")
    if not hasattr(decoder, "embed_tokens"):
        problems.append(f"{type(decoder).__name__} has no embed_tokens; context parallelism "
                        "supports Qwen2/2.5/3 and Qwen-VL language towers")
    if problems:
        raise ConfigError(problems)


def enable_context_parallel(hf_model: nn.Module, group: Any) -> ContextParallel:
    """Route ``hf_model``'s text decoder through :class:`ContextParallel` over ``group``.

    Registers the attention function, switches the text decoder's config to it and adds
    the input pre-hook; the vision tower (if any) keeps its own attention.
    """
    from transformers import AttentionInterface

    check_context_parallel(hf_model, dist.get_world_size(group))
    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    decoder = text_decoder(hf_model)
    decoder.config._attn_implementation_internal = ATTENTION_NAME
    parallel = ContextParallel(group)
    decoder.register_forward_pre_hook(parallel.shard_inputs, with_kwargs=True)
    return parallel


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of this rank's query chunks over the group's keys and values.

    ``query`` is ``[B, H, 2S, D]``, ``key``/``value`` ``[B, KV, 2S, D]`` (this rank's
    chunks); returns ``[B, 2S, H, D]`` as transformers' attention functions do.
    """
    plan = attention_mask
    if not isinstance(plan, ShardPlan):
        raise RuntimeError(
            "the context-parallel attention runs only inside the backend's forward pass "
            "(it got no shard plan); call the model through the backend"
        )
    if sliding_window is not None:
        raise ConfigError(["backend.fsdp.cp > 1 does not support sliding-window attention"])
    keys_values = _GatherSharded.apply(torch.stack([key, value]), plan, -2)
    full_key, full_value = keys_values[0], keys_values[1]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        full_key = full_key.repeat_interleave(groups, dim=1)
        full_value = full_value.repeat_interleave(groups, dim=1)
    size = plan.chunk
    outputs = []
    for slot, chunk in enumerate(plan.chunks):
        end = (chunk + 1) * size
        q = query[:, :, slot * size : (slot + 1) * size]
        k, v = full_key[:, :, :end], full_value[:, :, :end]
        mask = plan.attention_mask(slot, query.device)
        if mask is None:
            outputs.append(_causal_lower_right(q, k, v, dropout=dropout, scale=scaling))
        else:
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          dropout_p=dropout, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _causal_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        dropout: float, scale: float | None) -> torch.Tensor:
    """Causal attention of the last ``q.shape[2]`` positions over ``k``/``v``."""
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                          scale=scale)


# --- collectives with autograd -----------------------------------------------------------------


def _all_gather(local: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """``[size, *local.shape]``: every rank's ``local``, in group-rank order."""
    out = local.new_empty((plan.size * local.shape[0], *local.shape[1:]))
    all_gather_into(out, local.contiguous(), plan.group)
    return out.view(plan.size, *local.shape)


def _to_global(gathered: torch.Tensor, plan: ShardPlan, dim: int) -> torch.Tensor:
    """Rank-ordered ``[size, ..., 2S, ...]`` pieces -> one tensor in sequence order."""
    size, chunk = plan.size, plan.chunk
    firsts = [gathered[r].narrow(dim, 0, chunk) for r in range(size)]
    seconds = [gathered[r].narrow(dim, chunk, chunk) for r in reversed(range(size))]
    return torch.cat(firsts + seconds, dim=dim)


def _to_ranks(full: torch.Tensor, plan: ShardPlan, dim: int) -> torch.Tensor:
    """Inverse of :func:`_to_global`: ``[size, ..., 2S, ...]`` pieces in rank order."""
    size, chunk = plan.size, plan.chunk
    pieces = [
        torch.cat([full.narrow(dim, r * chunk, chunk),
                   full.narrow(dim, (2 * size - 1 - r) * chunk, chunk)], dim=dim)
        for r in range(size)
    ]
    return torch.stack(pieces)


def _positive_dim(tensor: torch.Tensor, dim: int) -> int:
    return dim if dim >= 0 else tensor.dim() + dim


class _GatherToGlobal(torch.autograd.Function):
    """All-gather of this rank's chunks into the whole sequence along ``dim``; subclasses
    say what the backward does with the whole sequence's gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, plan: ShardPlan, dim: int) -> torch.Tensor:
        dim = _positive_dim(local, dim)
        ctx.plan, ctx.dim = plan, dim
        return _to_global(_all_gather(local, plan), plan, dim)


class _GatherSharded(_GatherToGlobal):
    """All-gather of sharded activations (keys/values); backward sums every rank's
    gradient of this rank's part (reduce-scatter)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        pieces = _to_ranks(grad, plan, ctx.dim).contiguous()
        out = pieces.new_empty(pieces.shape[1:])
        reduce_scatter_into(out, pieces.flatten(0, 1), plan.group)
        return out, None, None


class _GatherReplicated(_GatherToGlobal):
    """All-gather of per-token results that every rank then uses identically (the loss);
    backward keeps this rank's slice of the gradient."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        return plan_slice(grad, plan, ctx.dim), None, None


def plan_slice(full: torch.Tensor, plan: ShardPlan, dim: int = -1) -> torch.Tensor:
    """This rank's two chunks of a full-length (padded) tensor along ``dim``."""
    return full.index_select(dim, plan.index.to(full.device))
