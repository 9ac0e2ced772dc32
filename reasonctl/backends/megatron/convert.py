"""Hugging Face <-> Megatron-core weights for Qwen2 / Qwen2.5 / Qwen3 / Llama-family models.

Pure tensor mapping: nothing here imports megatron, so the layout is testable anywhere.
Both directions live in this one module (longer than our usual module, on purpose): each
layout rule below is written once and read by both the import and the export.

Megatron names and layouts (the *local* layer spec, ``get_gpt_layer_local_spec``; ``i`` is
the layer index local to a model chunk, ``d`` the head dim, ``g`` the KV groups)::

    embedding.word_embeddings.weight                      [V'/tp, H]   vocab-parallel rows
    decoder.layers.i.input_layernorm.weight               [H]          replicated
    decoder.layers.i.self_attention.linear_qkv.weight     [(nq+2g)d/tp, H]  column-parallel
    decoder.layers.i.self_attention.linear_qkv.bias       [(nq+2g)d/tp]     (QKV bias, Qwen2)
    decoder.layers.i.self_attention.q_layernorm.weight    [d]          (q/k norm, Qwen3)
    decoder.layers.i.self_attention.k_layernorm.weight    [d]
    decoder.layers.i.self_attention.linear_proj.weight    [H, nq*d/tp] row-parallel
    decoder.layers.i.pre_mlp_layernorm.weight             [H]          replicated
    decoder.layers.i.mlp.linear_fc1.weight                [2F/tp, H]   column-parallel
    decoder.layers.i.mlp.linear_fc2.weight                [H, F/tp]    row-parallel
    decoder.final_layernorm.weight                        [H]
    output_layer.weight                                   [V'/tp, H]   vocab-parallel rows

- ``linear_qkv`` is grouped per KV head: for each group ``[q heads of the group; k; v]``
  (``nq/g`` query heads, then one key and one value head, ``d`` rows each). A tensor-parallel
  rank holds ``g/tp`` whole groups, i.e. a contiguous block of rows.
- ``linear_fc1`` is ``[gate; up]`` *per rank*: rank ``r`` holds ``[gate_r; up_r]`` (megatron
  splits the local output in two halves and applies SiLU to the first).
- With the Transformer Engine spec the two norms live inside the following linear layer as
  ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``;
  this module produces the local-spec layout above (separate ``input_layernorm`` /
  ``pre_mlp_layernorm``), which is what the backend builds when Transformer Engine is absent.
- ``V'`` is the vocabulary padded to a multiple of :data:`VOCAB_PAD_MULTIPLE` (independent of
  the tensor-parallel size, so checkpoints reshard); padding rows are zero and are dropped
  on the way back.
- ``output_layer.weight`` exists when embeddings are untied, and also when they are tied but
  the last pipeline stage does not hold the embedding (megatron keeps a copy there).

Pipeline stages hold a contiguous range of layers (:meth:`ParallelLayout.layer_range`),
the first stage also the embedding, the last one the final norm and the output layer.

Loading is lazy: :func:`hf_to_megatron` asks a :class:`TensorSource` for row/column slices
only, so with :class:`SafetensorsSource` each rank reads just its shard from disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from reasonctl.core.errors import ReasonctlError

VOCAB_PAD_MULTIPLE = 128
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class ConversionError(ReasonctlError):
    """A model or parallel layout the Megatron conversion cannot handle."""


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts the weight mapping needs, read from a Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Read a ``Qwen2Config`` / ``Qwen3Config`` / ``LlamaConfig`` (or equivalent)."""
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(
                f"the megatron backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                f"got {model_type!r}. Use backend.name = 'fsdp' for other models"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"{model_type}: hidden_act {act!r} is not supported (silu only)")
        if getattr(config, "mlp_bias", False):
            raise ConversionError(f"{model_type}: mlp_bias = true is not supported")
        if getattr(config, "use_sliding_window", False):
            raise ConversionError(
                f"{model_type}: use_sliding_window = true is not supported by the megatron "
                "backend; use backend.name = 'fsdp'"
            )
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        if model_type == "llama" and attention_bias:
            raise ConversionError(
                "llama: attention_bias = true also adds an o_proj bias, which the megatron "
                "layout here does not carry"
            )
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen3" and attention_bias),
            qk_norm=model_type == "qwen3",
        )

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to :data:`VOCAB_PAD_MULTIPLE` (megatron's embedding rows)."""
        return -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


@dataclass(frozen=True)
class ParallelLayout:
    """Which piece of the model a rank (or one of its virtual pipeline chunks) holds."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vpp_size: int = 1
    vpp_rank: int = 0

    def check(self, shape: ModelShape) -> None:
        """Raise :class:`ConversionError` when ``shape`` cannot be split this way."""
        problems = []
        tp = self.tp_size
        for what, value in (
            ("num_key_value_heads", shape.num_kv_heads),
            ("num_attention_heads", shape.num_heads),
            ("intermediate_size", shape.ffn_hidden_size),
            (f"the padded vocabulary ({VOCAB_PAD_MULTIPLE} multiple)", shape.padded_vocab_size),
        ):
            if value % tp:
                problems.append(f"{what} = {value} is not divisible by tp = {tp}")
        if shape.num_heads % shape.num_kv_heads:
            problems.append(
                f"num_attention_heads = {shape.num_heads} is not a multiple of "
                f"num_key_value_heads = {shape.num_kv_heads}"
            )
        stages = self.pp_size * self.vpp_size
        if shape.num_layers % stages:
            problems.append(
                f"num_hidden_layers = {shape.num_layers} is not divisible by pp x vpp = {stages}"
            )
        for name, rank, size in (("tp", self.tp_rank, tp), ("pp", self.pp_rank, self.pp_size),
                                 ("vpp", self.vpp_rank, self.vpp_size)):
            if not 0 <= rank < size:
                problems.append(f"{name} rank {rank} outside 0..{size - 1}")
        if problems:
            raise ConversionError("cannot shard the model: " + "; ".join(problems))

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding."""
        return self.pp_rank == 0 and self.vpp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the final norm and the output layer."""
        return self.pp_rank == self.pp_size - 1 and self.vpp_rank == self.vpp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """Global indices of the decoder layers in this chunk (megatron's even split)."""
        per_chunk = num_layers // (self.pp_size * self.vpp_size)
        start = (self.vpp_rank * self.pp_size + self.pp_rank) * per_chunk
        return range(start, start + per_chunk)

    def holds_output_layer(self, shape: ModelShape) -> bool:
        """Whether this chunk has its own ``output_layer.weight``."""
        return self.is_last_stage and (not shape.tie_word_embeddings or not self.is_first_stage)


def stage_of_layer(layer: int, shape: ModelShape, pp_size: int, vpp_size: int = 1
                   ) -> tuple[int, int]:
    """``(pp_rank, vpp_rank)`` of the chunk holding global decoder layer ``layer``."""
    per_chunk = shape.num_layers // (pp_size * vpp_size)
    stage = layer // per_chunk
    return stage % pp_size, stage // pp_size


# --- reading Hugging Face tensors ---------------------------------------------------------


class TensorSource(Protocol):
    """Read access to Hugging Face tensors by name, optionally only a block of them."""

    def __contains__(self, name: object) -> bool:
        """Whether a tensor of that name exists."""
        ...

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None
            ) -> torch.Tensor:
        """The tensor (or ``tensor[rows]`` / ``tensor[rows, cols]``)."""
        ...


class StateDictSource:
    """A :class:`TensorSource` over an in-memory state dict."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    def __contains__(self, name: object) -> bool:
        return name in self.state_dict

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None
            ) -> torch.Tensor:
        """Slice the stored tensor."""
        return _index(self.state_dict[name], rows, cols)


class SafetensorsSource:
    """A :class:`TensorSource` over a Hugging Face model directory, read lazily.

    Only the requested rows/columns are read from the (possibly sharded) safetensors files,
    through ``safetensors.safe_open(...).get_slice``.
    """

    def __init__(self, directory: Path) -> None:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}
        else:
            raise ConversionError(
                f"{directory} holds no model.safetensors or model.safetensors.index.json; the "
                "megatron backend loads safetensors checkpoints only"
            )
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None
            ) -> torch.Tensor:
        """Read ``name`` (or a block of it) from its safetensors file."""
        path = self.files[name]
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[path] = safe_open(str(path), framework="pt")
        piece = handle.get_slice(name)
        if rows is None and cols is None:
            return piece[:]
        if cols is None:
            return piece[rows]
        return piece[rows if rows is not None else slice(None), cols]


def _index(tensor: torch.Tensor, rows: slice | None, cols: slice | None) -> torch.Tensor:
    if rows is not None:
        tensor = tensor[rows]
    if cols is not None:
        tensor = tensor[:, cols]
    return tensor


# --- Hugging Face -> Megatron ---------------------------------------------------------------


def hf_to_megatron(source: TensorSource, shape: ModelShape, layout: ParallelLayout
                   ) -> dict[str, torch.Tensor]:
    """The megatron state dict (local names) of one chunk, read from Hugging Face tensors.

    Reads only the slices this tensor-parallel rank and pipeline chunk hold.
    """
    layout.check(shape)
    out: dict[str, torch.Tensor] = {}
    if layout.is_first_stage:
        out["embedding.word_embeddings.weight"] = _vocab_rows(
            source, "model.embed_tokens.weight", shape, layout)
    for local, layer in enumerate(layout.layer_range(shape.num_layers)):
        for name, tensor in _layer_to_megatron(source, shape, layout, layer).items():
            out[f"decoder.layers.{local}.{name}"] = tensor
    if layout.is_last_stage:
        out["decoder.final_layernorm.weight"] = source.get("model.norm.weight")
        if layout.holds_output_layer(shape):
            head = "lm_head.weight"
            if shape.tie_word_embeddings or head not in source:
                head = "model.embed_tokens.weight"
            out["output_layer.weight"] = _vocab_rows(source, head, shape, layout)
    return out


def _vocab_rows(source: TensorSource, name: str, shape: ModelShape, layout: ParallelLayout
                ) -> torch.Tensor:
    per_rank = shape.padded_vocab_size // layout.tp_size
    start = layout.tp_rank * per_rank
    stop = min(start + per_rank, shape.vocab_size)
    if stop <= start:
        probe = source.get(name, slice(0, 1))
        return probe.new_zeros((per_rank, probe.shape[1]))
    rows = source.get(name, slice(start, stop))
    if rows.shape[0] < per_rank:
        rows = torch.cat([rows, rows.new_zeros((per_rank - rows.shape[0], rows.shape[1]))])
    return rows


def _layer_to_megatron(source: TensorSource, shape: ModelShape, layout: ParallelLayout,
                       layer: int) -> dict[str, torch.Tensor]:
    hf = f"model.layers.{layer}"
    tp, rank, d = layout.tp_size, layout.tp_rank, shape.head_dim
    groups = shape.num_kv_heads // tp
    q_rows = groups * shape.heads_per_group * d
    kv_rows = groups * d
    q_span = slice(rank * q_rows, (rank + 1) * q_rows)
    kv_span = slice(rank * kv_rows, (rank + 1) * kv_rows)
    ffn = shape.ffn_hidden_size // tp
    ffn_span = slice(rank * ffn, (rank + 1) * ffn)
    attn_width = shape.num_heads // tp * d
    attn_cols = slice(rank * attn_width, (rank + 1) * attn_width)
    out = {
        "input_layernorm.weight": source.get(f"{hf}.input_layernorm.weight"),
        "self_attention.linear_qkv.weight": interleave_qkv(
            source.get(f"{hf}.self_attn.q_proj.weight", q_span),
            source.get(f"{hf}.self_attn.k_proj.weight", kv_span),
            source.get(f"{hf}.self_attn.v_proj.weight", kv_span),
            groups,
        ),
        "self_attention.linear_proj.weight": source.get(
            f"{hf}.self_attn.o_proj.weight", None, attn_cols),
        "pre_mlp_layernorm.weight": source.get(f"{hf}.post_attention_layernorm.weight"),
        "mlp.linear_fc1.weight": torch.cat([
            source.get(f"{hf}.mlp.gate_proj.weight", ffn_span),
            source.get(f"{hf}.mlp.up_proj.weight", ffn_span),
        ]),
        "mlp.linear_fc2.weight": source.get(f"{hf}.mlp.down_proj.weight", None, ffn_span),
    }
    if shape.qkv_bias:
        out["self_attention.linear_qkv.bias"] = interleave_qkv(
            source.get(f"{hf}.self_attn.q_proj.bias", q_span),
            source.get(f"{hf}.self_attn.k_proj.bias", kv_span),
            source.get(f"{hf}.self_attn.v_proj.bias", kv_span),
            groups,
        )
    if shape.qk_norm:
        out["self_attention.q_layernorm.weight"] = source.get(f"{hf}.self_attn.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = source.get(f"{hf}.self_attn.k_norm.weight")
    return out


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int
                   ) -> torch.Tensor:
    """Megatron's grouped ``[q_group; k; v]`` rows from separate q, k, v rows (or biases)."""
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, ...]:
    """Separate q, k, v rows (or biases) from megatron's grouped layout (inverse of above)."""
    d, per_group = shape.head_dim, shape.heads_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(-1, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


# --- Megatron -> Hugging Face ---------------------------------------------------------------

_REPLICATED_SUFFIXES = ("layernorm.weight",)
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def merge_tp(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """One megatron parameter with ``tp = 1`` from its tensor-parallel shards (rank order)."""
    if len(shards) == 1 or name.endswith(_REPLICATED_SUFFIXES):
        return shards[0]
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(list(shards), dim=1)
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    # linear_qkv (whole groups per rank), embedding and output layer (vocab rows)
    return torch.cat(list(shards), dim=0)


def megatron_to_hf_tensors(name: str, tensor: torch.Tensor, shape: ModelShape
                           ) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face tensors from one megatron parameter (global name, merged over TP).

    The output layer of tied models maps to nothing (Hugging Face stores it once, as the
    embedding).
    """
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: shape.vocab_size])]
    if name == "output_layer.weight":
        if shape.tie_word_embeddings:
            return []
        return [("lm_head.weight", tensor[: shape.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = _LAYER.match(name)
    if match is None:
        raise ConversionError(f"unexpected megatron parameter {name!r}")
    hf = f"model.layers.{match.group(1)}"
    part = match.group(2)
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if part in simple:
        return [(f"{hf}.{simple[part]}", tensor)]
    if part in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = part.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, shape)
        return [(f"{hf}.self_attn.q_proj.{kind}", q), (f"{hf}.self_attn.k_proj.{kind}", k),
                (f"{hf}.self_attn.v_proj.{kind}", v)]
    if part == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(f"{hf}.mlp.gate_proj.weight", gate), (f"{hf}.mlp.up_proj.weight", up)]
    raise ConversionError(f"unexpected megatron parameter {name!r}")


def megatron_param_names(shape: ModelShape) -> Iterator[str]:
    """Every megatron parameter of the whole model (global names, canonical order).

    ``output_layer.weight`` is listed only for untied models: with tied embeddings it is a
    copy of the embedding, not a separate weight.
    """
    yield "embedding.word_embeddings.weight"
    for layer in range(shape.num_layers):
        prefix = f"decoder.layers.{layer}."
        yield prefix + "input_layernorm.weight"
        yield prefix + "self_attention.linear_qkv.weight"
        if shape.qkv_bias:
            yield prefix + "self_attention.linear_qkv.bias"
        if shape.qk_norm:
            yield prefix + "self_attention.q_layernorm.weight"
            yield prefix + "self_attention.k_layernorm.weight"
        yield prefix + "self_attention.linear_proj.weight"
        yield prefix + "pre_mlp_layernorm.weight"
        yield prefix + "mlp.linear_fc1.weight"
        yield prefix + "mlp.linear_fc2.weight"
    yield "decoder.final_layernorm.weight"
    if not shape.tie_word_embeddings:
        yield "output_layer.weight"


def owner_stage(name: str, shape: ModelShape, pp_size: int, vpp_size: int = 1
                ) -> tuple[int, int]:
    """``(pp_rank, vpp_rank)`` holding the global megatron parameter ``name``."""
    if name.startswith("embedding."):
        return 0, 0
    match = _LAYER.match(name)
    if match is None:  # final norm and output layer
        return pp_size - 1, vpp_size - 1
    return stage_of_layer(int(match.group(1)), shape, pp_size, vpp_size)


def local_name(name: str, shape: ModelShape, pp_size: int, vpp_size: int = 1) -> str:
    """The chunk-local name of a global megatron parameter (layer index within its chunk)."""
    match = _LAYER.match(name)
    if match is None:
        return name
    per_chunk = shape.num_layers // (pp_size * vpp_size)
    return f"decoder.layers.{int(match.group(1)) % per_chunk}.{match.group(2)}"


def megatron_to_hf(shards: Mapping[ParallelLayout, Mapping[str, torch.Tensor]],
                   shape: ModelShape) -> dict[str, torch.Tensor]:
    """A full Hugging Face state dict from the local state dicts of every rank and chunk.

    ``shards`` maps each :class:`ParallelLayout` (all tp ranks of all pipeline chunks) to
    the megatron state dict it holds. Used on gathered tensors; the backend streams the
    same mapping one parameter at a time.
    """
    layouts = list(shards)
    if not layouts:
        raise ConversionError("no shards given")
    tp, pp, vpp = layouts[0].tp_size, layouts[0].pp_size, layouts[0].vpp_size
    out: dict[str, torch.Tensor] = {}
    for name in megatron_param_names(shape):
        pp_rank, vpp_rank = owner_stage(name, shape, pp, vpp)
        local = local_name(name, shape, pp, vpp)
        parts = []
        for tp_rank in range(tp):
            layout = ParallelLayout(tp, tp_rank, pp, pp_rank, vpp, vpp_rank)
            if layout not in shards:
                raise ConversionError(f"missing the shard of {layout}")
            parts.append(shards[layout][local])
        out.update(megatron_to_hf_tensors(name, merge_tp(name, parts), shape))
    return out
