"""Weights into and out of megatron model chunks.

In: each rank converts only its own shard of the Hugging Face checkpoint
(:func:`~reasonctl.backends.megatron.convert.hf_to_megatron` over a lazy safetensors
source) and copies it into its chunk's parameters.

Out: :func:`stream_hf_weights` walks every megatron parameter of the model in a fixed
order; the ranks of the owning pipeline stage all-gather the tensor-parallel shards, the
owner broadcasts the merged tensor over the pipeline group, and every rank yields the
Hugging Face tensors. All ranks must consume the iterator to the end.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reasonctl.backends.megatron.convert import (
    ConversionError,
    ModelShape,
    local_name,
    megatron_param_names,
    megatron_to_hf_tensors,
    merge_tp,
    owner_stage,
)


@dataclass
class ParallelGroups:
    """This rank's coordinates and the process groups weight gathering uses.

    ``tp_group`` / ``pp_group`` are ``None`` when that dimension has size 1.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vpp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None


def load_chunk_weights(chunk: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy converted tensors into ``chunk``'s parameters by name, checking coverage."""
    params = dict(chunk.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ConversionError(
            f"converted weights do not match the megatron model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ConversionError(
                    f"{name}: converted shape {tuple(tensor.shape)} but the model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))


def full_megatron_shape(name: str, shape: ModelShape) -> tuple[int, ...]:
    """Shape of a megatron parameter with ``tp = 1`` (vocabulary padded)."""
    h, d = shape.hidden_size, shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    suffixes = {
        "layernorm.weight": (h,),
        "q_layernorm.weight": (d,),
        "k_layernorm.weight": (d,),
        "linear_qkv.weight": (qkv, h),
        "linear_qkv.bias": (qkv,),
        "linear_proj.weight": (h, shape.num_heads * d),
        "linear_fc1.weight": (2 * shape.ffn_hidden_size, h),
        "linear_fc2.weight": (h, shape.ffn_hidden_size),
        "word_embeddings.weight": (shape.padded_vocab_size, h),
        "output_layer.weight": (shape.padded_vocab_size, h),
    }
    # most specific suffix first: q_layernorm before layernorm
    for suffix in sorted(suffixes, key=len, reverse=True):
        if name.endswith(suffix):
            return suffixes[suffix]
    raise ConversionError(f"unexpected megatron parameter {name!r}")


def stream_hf_weights(chunks: Sequence[torch.nn.Module], shape: ModelShape,
                      groups: ParallelGroups, *, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full Hugging Face tensors (collective over the model-parallel groups).

    ``chunks`` are this rank's unwrapped ``GPTModel`` chunks (one per virtual stage).
    Tensors are on ``device`` in the parameter dtype.
    """
    params = [dict(chunk.named_parameters()) for chunk in chunks]
    dtype = next(iter(params[0].values())).dtype
    for name in megatron_param_names(shape):
        owner_pp, owner_vpp = owner_stage(name, shape, groups.pp_size, groups.vpp_size)
        full: torch.Tensor | None = None
        if groups.pp_rank == owner_pp:
            local = params[owner_vpp][local_name(name, shape, groups.pp_size, groups.vpp_size)]
            full = _gather_tp(name, local.detach(), groups)
        if groups.pp_size > 1:
            if full is None:
                full = torch.empty(full_megatron_shape(name, shape), dtype=dtype, device=device)
            dist.broadcast(full, group=groups.pp_group, group_src=owner_pp)
        assert full is not None
        yield from megatron_to_hf_tensors(name, full, shape)


def _gather_tp(name: str, local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    if groups.tp_size == 1 or name.endswith("layernorm.weight"):
        return local
    shards = [torch.empty_like(local) for _ in range(groups.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
    return merge_tp(name, shards)
