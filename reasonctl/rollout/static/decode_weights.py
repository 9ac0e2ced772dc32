"""The dedicated decode step's matmul weights, held in the compute dtype.

Query, key and value projections are one concatenated weight, and so are the gate and up
projections; the output projection, the down projection and the output head are the
model's own parameters when they already have the compute dtype and contiguous rows
(else copies). :meth:`DecodeWeights.refresh` re-copies them in place, so their storage
never moves and captured CUDA graphs stay valid; the engine calls it before every
rollout, since the policy's weights change between rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LayerWeights:
    """One decoder layer's matmul weights in the compute dtype."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodeWeights:
    """Every layer's :class:`LayerWeights` and the output head (``lm_head``) of a
    Llama-style ``model`` (its decoder ``layers``), in ``dtype``; filled by
    :meth:`refresh` (called once here)."""

    def __init__(self, model: Any, dtype: torch.dtype, layers: Any) -> None:
        self.model = model
        self.dtype = dtype
        self.decoder_layers = layers
        self.layers = [self._allocate(layer) for layer in layers]
        self.lm_head = self._own_or_copy(model.get_output_embeddings().weight)
        self.refresh()

    def _own_or_copy(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` itself when it has the compute dtype and is contiguous (the chain's
        kernels read rows by a fixed stride), else a buffer for its copy."""
        if param.dtype == self.dtype and param.is_contiguous():
            return param.detach()
        return torch.empty(param.shape, dtype=self.dtype, device=param.device)

    def _allocate(self, layer: Any) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        device = attention.q_proj.weight.device
        rows = sum(p.weight.shape[0] for p in projections)
        hidden = attention.q_proj.weight.shape[1]
        ffn = mlp.gate_proj.weight.shape[0]
        has_bias = attention.q_proj.bias is not None
        return LayerWeights(
            qkv=torch.empty((rows, hidden), dtype=self.dtype, device=device),
            qkv_bias=torch.empty(rows, dtype=self.dtype, device=device) if has_bias else None,
            out=self._own_or_copy(attention.o_proj.weight),
            out_bias=(None if attention.o_proj.bias is None
                      else self._own_or_copy(attention.o_proj.bias)),
            gate_up=torch.empty((2 * ffn, hidden), dtype=self.dtype, device=device),
            down=self._own_or_copy(mlp.down_proj.weight),
        )

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current weights into the compute-dtype buffers, in place: one
        batched copy (``torch._foreach_copy_``) of every weight that has a buffer of its
        own, since a rollout starts with this and ~200 separate copies would each cost a
        launch."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for layer, weights in zip(self.decoder_layers, self.layers, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            _pair_rows(targets, sources, weights.qkv, [p.weight for p in projections])
            if weights.qkv_bias is not None:
                _pair_rows(targets, sources, weights.qkv_bias, [p.bias for p in projections])
            _pair_rows(targets, sources, weights.gate_up,
                       [mlp.gate_proj.weight, mlp.up_proj.weight])
            _pair_if_distinct(targets, sources, weights.out, attention.o_proj.weight)
            if weights.out_bias is not None:
                _pair_if_distinct(targets, sources, weights.out_bias, attention.o_proj.bias)
            _pair_if_distinct(targets, sources, weights.down, mlp.down_proj.weight)
        _pair_if_distinct(targets, sources, self.lm_head,
                          self.model.get_output_embeddings().weight)
        if targets:
            torch._foreach_copy_(targets, [s.detach() for s in sources])


def _pair_rows(targets: list[torch.Tensor], sources: list[torch.Tensor],
               target: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Pair consecutive row blocks of ``target`` with ``parts`` (a concatenated copy)."""
    start = 0
    for part in parts:
        targets.append(target[start : start + part.shape[0]])
        sources.append(part)
        start += part.shape[0]


def _pair_if_distinct(targets: list[torch.Tensor], sources: list[torch.Tensor],
                      target: torch.Tensor, source: torch.Tensor) -> None:
    """Pair ``target`` with ``source`` unless it is ``source`` itself."""
    if target.data_ptr() != source.data_ptr():
        targets.append(target)
        sources.append(source)
