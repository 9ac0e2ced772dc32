"""A one-token decode forward pass for Llama-style decoders (Qwen2/2.5/3, Llama).

The Hugging Face forward pass is written for every case (training, prefill, many cache
types); one decode step of it at batch 64 launches several hundred small kernels and,
with a mask, expands the grouped key/value heads into full copies of the cache every
layer. :class:`DecodeForward` computes the same function for the one case the rollout
engine repeats hundreds of times: one new token per slot of a
:class:`~reasonctl.rollout.static.slot_cache.SlotKVCache`.

- Query, key and value projections are one matmul over a concatenated weight, and so are
  the gate and up projections (four matmuls per layer instead of seven).
- Attention groups the query heads that share a key/value head into one query block
  (``[B, kv_heads, group, head_dim]``), so the cache is read in place, never repeated.
- Matmul weights are held in the compute dtype
  (:mod:`~reasonctl.rollout.static.decode_weights`): concatenated weights always as
  copies, others as the model's own parameters when they already have that dtype (else
  copies). :meth:`DecodeForward.refresh` re-copies them in place (storage never moves, so
  captured CUDA graphs stay valid); the engine calls it before every rollout, since the
  policy's weights change between rollouts.
- Norms, the activation and the embedding are the model's own modules and parameters;
  rotary angles use the model's ``inv_freq`` and attention scaling
  (:mod:`~reasonctl.rollout.static.rotary`).
- With ``fused_kernels`` (at most :data:`FUSED_MLP_ROWS` rows), the gate/up projection
  and the SiLU activation run as one kernel
  (:mod:`reasonctl.rollout.kernels.decode_mlp`).
- With ``fused_kernels`` where every fused kernel runs (at most :data:`CHAIN_ROWS` rows),
  the whole step is a chain of this project's kernels: residual add and RMSNorm
  (:mod:`~reasonctl.rollout.kernels.decode_norm`; the first also looks up the embedding
  rows of a plain ``nn.Embedding``), the skinny matmuls
  (:mod:`~reasonctl.rollout.kernels.decode_linear`), attention and the gated MLP. On
  GPUs that have it (compute capability 9.0 and newer) each is a programmatic dependent
  launch, so a kernel starts while the previous one finishes. Only the rotary table and
  the output head remain library operations; there is nothing left to compile.
- :class:`~reasonctl.rollout.options.DecodeOptions` switches parts off for measurements:
  the chain (``kernel_chain``), the fused gate/up kernel (``fused_mlp``), programmatic
  launches, tensor-descriptor loads, the QKV weights' preload and the dedicated prefill.
- Where the chain runs, :meth:`DecodeForward.prefill_hidden` also runs the prompts'
  prefill with the same weights: one matmul each for QKV and gate/up, the chain's
  residual add + RMSNorm kernel, one kernel each for the rotary embedding and the
  activation (:mod:`~reasonctl.rollout.kernels.prefill_kernels`), the library's attention
  with the prompts' mask, and the keys and values stored through the cache's own
  prefill store.

Supported: model types in :data:`SUPPORTED_MODEL_TYPES` with full attention, a static
rotary frequency table (not the ``dynamic``/``longrope`` types) and no MLP bias; other
models decode through the Hugging Face forward pass. For the vision-language models
(Qwen2.5-VL, Qwen3-VL) the step runs their language model: a generated token's
multimodal rotary position has equal time, height and width parts, which is the ordinary
rotary embedding at that position, so only the position differs from the cache index:
each slot's offset (the model's ``rope_deltas`` of its prompt) is in :attr:`rope_offsets`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from reasonctl.rollout.kernels.decode_attention import (
    decode_attention,
    default_splits,
    supports_fused_attention,
)
from reasonctl.rollout.kernels.decode_linear import MAX_ROWS as LINEAR_MAX_ROWS
from reasonctl.rollout.kernels.decode_linear import (
    choose_linear_tiles,
    choose_qkv_tiles,
    skinny_linear,
)
from reasonctl.rollout.kernels.decode_mlp import choose_tiles, gated_silu
from reasonctl.rollout.kernels.decode_norm import MAX_HIDDEN, add_rms_norm, embed_rms_norm
from reasonctl.rollout.kernels.prefill_kernels import rotate, silu_and_mul
from reasonctl.rollout.kernels.triton_support import (
    kernels_run_on,
    processor_count,
    supports_pdl,
)
from reasonctl.rollout.options import DecodeOptions
from reasonctl.rollout.static.decode_weights import DecodeWeights, LayerWeights
from reasonctl.rollout.static.rotary import RotaryTables, rotate_half
from reasonctl.rollout.static.slot_cache import SlotKVCache

FUSED_MLP_ROWS = 64
"""Batches up to this many rows use the fused gate/up kernel (its tiles were chosen at
64 rows); larger ones use the library matmul and a separate activation."""
CHAIN_ROWS = LINEAR_MAX_ROWS
"""Batches up to this many rows run as the kernel chain (when it runs at all); larger
ones use library matmuls."""
MULTIMODAL_MODEL_TYPES = frozenset({"qwen2_5_vl", "qwen3_vl"})
"""Vision-language models whose language model the step runs (multimodal rotary)."""
SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"}) | MULTIMODAL_MODEL_TYPES
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def text_config(model: Any) -> Any:
    """The config of ``model``'s language model (the model's own for text models)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def text_decoder(model: Any) -> Any:
    """The module holding the decoder layers, embedding, final norm and rotary embedding
    (``model.model``, or its ``language_model`` for a vision-language model)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", None) or inner


def is_multimodal(model: Any) -> bool:
    """True for the vision-language models of :data:`MULTIMODAL_MODEL_TYPES`."""
    return getattr(getattr(model, "config", None), "model_type", None) in MULTIMODAL_MODEL_TYPES


def supports_decode_forward(model: Any) -> bool:
    """True when :class:`DecodeForward` reproduces ``model``'s forward pass."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    inner = text_decoder(model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return False
    try:
        mlp = inner.layers[0].mlp
        attention = inner.layers[0].self_attn
    except (AttributeError, IndexError):
        return False
    if any(getattr(mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    biases = {getattr(attention, name).bias is None for name in ("q_proj", "k_proj", "v_proj")}
    return len(biases) == 1


class DecodeForward:
    """Next-token logits for one new token per slot, computed from ``model``'s weights.

    ``dtype`` is the matmul (compute) dtype. With ``fused_kernels``, attention runs as
    :func:`~reasonctl.rollout.kernels.decode_attention.decode_attention` where that kernel
    runs (CUDA, Triton, power-of-two head size), and the gate/up projection with its
    activation as :func:`~reasonctl.rollout.kernels.decode_mlp.gated_silu` where that runs
    (CUDA, Triton, a SiLU-gated MLP). ``options`` switches parts off for measurements
    (see the module docstring). Call :meth:`refresh` after the model's weights change;
    :meth:`__call__` runs one step.
    """

    def __init__(self, model: Any, dtype: torch.dtype, *, fused_kernels: bool = False,
                 options: DecodeOptions = DecodeOptions()) -> None:
        if not supports_decode_forward(model):
            raise ValueError(f"{type(model).__name__} is not supported by DecodeForward")
        self.model = model
        self.dtype = dtype
        self.options = options
        config = text_config(model)
        inner = self.inner = text_decoder(model)
        self.multimodal = is_multimodal(model)
        """Rotary positions are the cache positions plus :attr:`rope_offsets`."""
        self.rope_offsets: torch.Tensor | None = None
        """Per slot, the rotary position minus the cache position (multimodal models; a
        static buffer the decoder owns, read by captured graphs)."""
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        attention = inner.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scaling = float(attention.scaling)
        device = attention.q_proj.weight.device
        self.fused_attention = fused_kernels and supports_fused_attention(self.head_dim, device)
        """Attention (with rotary and the cache store) runs as one fused kernel."""
        self.processors = processor_count(device)  # asked once, outside compiled code
        self.q_norm_eps = float(getattr(getattr(attention, "q_norm", None),
                                        "variance_epsilon", 1e-6))
        self.fused_mlp = (fused_kernels and kernels_run_on(device)
                          and getattr(config, "hidden_act", None) in ("silu", "swish"))
        """The gate/up projection and its activation run as one fused kernel."""
        self.fused_mlp_rows = FUSED_MLP_ROWS if options.fused_mlp else 0
        """Batches up to this many rows use the fused gate/up kernel off the chain."""
        self.mlp_tiles = choose_tiles(config.hidden_size)
        self.weights = DecodeWeights(model, dtype, inner.layers)
        self.layers: list[LayerWeights] = self.weights.layers
        self.lm_head = self.weights.lm_head
        self.norm_eps = float(getattr(inner.norm, "variance_epsilon", 1e-6))
        self.chain = (self.fused_attention and self.fused_mlp
                      and config.hidden_size <= MAX_HIDDEN)
        """Every kernel of the chain runs here: batches of up to :attr:`chain_rows` rows
        run as the kernel chain."""
        self.chain_rows = CHAIN_ROWS if options.kernel_chain and options.fused_mlp else 0
        """Batches up to this many rows run as the kernel chain (where :attr:`chain`)."""
        self.pdl = self.chain and options.programmatic_launches and supports_pdl(device)
        """The chain's kernels are programmatic dependent launches."""
        self.descriptors = None if options.tensor_descriptors else False
        """The chain's matmuls read through tensor descriptors where the device has them
        (None: :func:`~reasonctl.rollout.kernels.decode_linear.uses_descriptors`
        decides), or never (False)."""
        first = self.layers[0]
        self.qkv_tiles = choose_qkv_tiles(first.qkv.shape[0], first.qkv.shape[1],
                                          self.processors, preload=options.preload_qkv)
        self.out_tiles = choose_linear_tiles(first.out.shape[0], first.out.shape[1],
                                             self.processors,
                                             may_split=first.out_bias is None)
        self.down_tiles = choose_linear_tiles(first.down.shape[0], first.down.shape[1],
                                              self.processors, may_split=True)
        self._stock = self.stock_hidden
        self.rotary = RotaryTables(inner.rotary_emb)

    def rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotary positions of tokens at cache ``positions`` of the first slots."""
        if not self.multimodal or self.rope_offsets is None:
            return positions
        return positions + self.rope_offsets[: positions.shape[0]]

    def compile_stock(self) -> None:
        """Compile :meth:`stock_hidden` (the path of batches the kernel chain does not
        take) with ``torch.compile``: one compilation for every batch size."""
        self._stock = torch.compile(self.stock_hidden, dynamic=True)

    def refresh(self) -> None:
        """Copy the model's current weights into the compute-dtype buffers, in place
        (:meth:`DecodeWeights.refresh
        <reasonctl.rollout.static.decode_weights.DecodeWeights.refresh>`)."""
        self.weights.refresh()

    # --- the step -------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
                 allowed: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[B, V]`` (compute dtype) for tokens ``input_ids`` (``[B]``) at
        ``positions`` (``[B]``) of the first ``B`` slots; stores their keys/values in
        ``cache`` and attends where ``allowed`` (``[B, 1, 1, max_len]``) is true (None when
        :attr:`fused_attention`: that kernel attends up to each row's position)."""
        return self.logits(self.hidden(input_ids, positions, cache, allowed))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's logits ``[B, V]`` (compute dtype) of hidden states
        ``[B, hidden]``."""
        return F.linear(hidden, self.lm_head)

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """Write the logits of :meth:`hidden`'s output into ``out`` (``[B, V]``, compute
        dtype, contiguous) with one matmul and no copy."""
        torch.mm(hidden, self.lm_head.t(), out=out)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
               allowed: torch.Tensor | None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The final-normalised hidden states ``[B, hidden]`` (compute dtype) from which
        :meth:`__call__` takes the logits; arguments as there, and ``out`` (contiguous,
        that shape and dtype) to write them into. The kernel chain computes them where it
        runs, else :meth:`stock_hidden` (compiled after :meth:`compile_stock`)."""
        if self.chain and input_ids.shape[0] <= self.chain_rows:
            return self.chain_hidden(input_ids, positions, cache, out=out)
        hidden = self._stock(input_ids, positions, cache, allowed)
        if out is None:
            return hidden
        out.copy_(hidden)
        return out

    def chain_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     cache: SlotKVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`hidden` as the kernel chain (needs :attr:`chain`, at most
        :data:`CHAIN_ROWS` rows, whatever :attr:`chain_rows` says): the embedding lookup
        with the first norm, then per layer the QKV matmul, attention (which sums the QKV
        matmul's split products and adds its bias), the output projection (its reduction
        split, summed by the next norm), residual add and RMSNorm, the gated MLP's
        gate/up, the down projection and the next residual add and RMSNorm."""
        inner = self.inner
        pdl, descriptors = self.pdl, self.descriptors
        layers = inner.layers
        embedding = inner.embed_tokens
        if (type(embedding) is torch.nn.Embedding and embedding.max_norm is None
                and embedding.weight.is_contiguous()):
            residual, h = embed_rms_norm(input_ids, embedding.weight,
                                         layers[0].input_layernorm.weight, self.norm_eps,
                                         self.dtype, pdl=pdl)
        else:  # a wrapped or renormalising embedding: its own forward
            residual = embedding(input_ids)
            h = add_rms_norm(residual, None, layers[0].input_layernorm.weight, self.norm_eps,
                             self.dtype, pdl=pdl)
        if self.multimodal:  # one table row per slot, at its own rotary position
            cos, sin = self.rotary.at(self.rotary_positions(positions), residual.dtype)
        else:
            cos, sin = self.rotary.every_position(cache.max_len, residual.dtype,
                                                  residual.device)
        splits = default_splits(cache.slots, self.kv_heads, cache.max_len, self.processors)
        split_qkv = self.qkv_tiles.splits(self.layers[0].qkv.shape[1]) > 1
        for layer_index, (layer, weights) in enumerate(zip(layers, self.layers, strict=True)):
            qkv = skinny_linear(h, weights.qkv, None if split_qkv else weights.qkv_bias,
                                self.qkv_tiles, pdl=pdl, descriptors=descriptors)
            attended = self._attention(layer.self_attn, qkv, cos, sin, None, positions,
                                       cache, layer_index, None, splits, pdl=pdl,
                                       rotary_by_position=not self.multimodal,
                                       qkv_bias=weights.qkv_bias if split_qkv else None)
            update = skinny_linear(attended, weights.out, weights.out_bias, self.out_tiles,
                                   pdl=pdl, descriptors=descriptors)
            h = add_rms_norm(residual, update, layer.post_attention_layernorm.weight,
                             self.norm_eps, self.dtype, pdl=pdl)
            activated = gated_silu(h, weights.gate_up, self.mlp_tiles, pdl=pdl)
            update = skinny_linear(activated, weights.down, None, self.down_tiles, pdl=pdl,
                                   descriptors=descriptors)
            last = layer_index == len(layers) - 1
            norm = inner.norm if last else layers[layer_index + 1].input_layernorm
            h = add_rms_norm(residual, update, norm.weight, self.norm_eps, self.dtype,
                             pdl=pdl, out=out if last else None)
        return h

    @property
    def prefills(self) -> bool:
        """True when :meth:`prefill_hidden` runs: where the kernel chain's kernels do,
        unless the options turn the dedicated prefill off."""
        return self.chain and self.options.dedicated_prefill

    def prefill_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Prefill of ``input_ids`` (``[P, W]`` left-padded prompts at ``positions``,
        attending where ``allowed``, ``[P, 1, W, W]``): the final-normalised hidden states
        of each row's last position (``[P, hidden]``, compute dtype). Keys and values
        are stored by ``cache.update``, so ``cache.prepare_prefill`` must have said
        where. Needs :attr:`prefills`.

        Numerics are those of the decode chain: matmuls in the compute dtype, the
        residual stream in the model's dtype, rotary in float32 rounded to the cache
        dtype, attention by ``scaled_dot_product_attention`` in the cache dtype."""
        inner = self.inner
        rows, width = input_ids.shape
        embedded = inner.embed_tokens(input_ids)
        residual = embedded.reshape(rows * width, -1)
        cos, sin = (table.view(cache.max_len, -1) for table in
                    self.rotary.every_position(cache.max_len, residual.dtype,
                                               residual.device))
        token_positions = positions.reshape(-1)
        cache_dtype = cache.keys[0].dtype
        tokens = rows * width
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # the mask as attention adds it (0 or -inf), made once rather than in every layer
        bias = torch.zeros(allowed.shape, dtype=cache_dtype, device=allowed.device
                           ).masked_fill_(~allowed, float("-inf"))
        update = None
        for layer_index, (layer, weights) in enumerate(
                zip(inner.layers, self.layers, strict=True)):
            attention = layer.self_attn
            h = add_rms_norm(residual, update, layer.input_layernorm.weight, self.norm_eps,
                             self.dtype)
            q, k, v = F.linear(h, weights.qkv, weights.qkv_bias).split(
                [q_width, kv_width, kv_width], dim=-1)
            q = q.view(tokens, self.heads, self.head_dim)
            k = k.view(tokens, self.kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before rotary
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = (rotate(x, cos, sin, token_positions, cache_dtype)
                    .view(rows, width, -1, self.head_dim).transpose(1, 2) for x in (q, k))
            v = v.to(cache_dtype).reshape(rows, width, self.kv_heads, self.head_dim) \
                .transpose(1, 2)
            cache.update(k, v, layer_index)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                      scale=self.scaling, enable_gqa=True)
            update = F.linear(attended.transpose(1, 2).reshape(rows * width, q_width)
                              .to(self.dtype), weights.out, weights.out_bias)
            h = add_rms_norm(residual, update, layer.post_attention_layernorm.weight,
                             self.norm_eps, self.dtype)
            update = F.linear(silu_and_mul(F.linear(h, weights.gate_up)), weights.down)
        last_residual = residual.view(rows, width, -1)[:, -1].contiguous()
        last_update = update.view(rows, width, -1)[:, -1].contiguous()
        return add_rms_norm(last_residual, last_update, inner.norm.weight, self.norm_eps,
                            self.dtype)

    def stock_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     cache: SlotKVCache, allowed: torch.Tensor | None) -> torch.Tensor:
        """:meth:`hidden` with library matmuls and the model's own norms (the fused
        attention and gate/up kernels where :attr:`fused_attention` and
        :attr:`fused_mlp` say so)."""
        inner = self.inner
        batch = input_ids.shape[0]
        x = inner.embed_tokens(input_ids)
        cos, sin = self.rotary.at(self.rotary_positions(positions), x.dtype)
        rows = torch.arange(batch, device=input_ids.device)
        splits = default_splits(cache.slots, self.kv_heads, cache.max_len, self.processors) \
            if self.fused_attention else 1
        fused_mlp = self.fused_mlp and batch <= self.fused_mlp_rows
        for layer_index, (layer, weights) in enumerate(
                zip(inner.layers, self.layers, strict=True)):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            qkv = F.linear(h.to(self.dtype), weights.qkv, weights.qkv_bias)
            attended = self._attention(attention, qkv, cos, sin, rows, positions, cache,
                                       layer_index, allowed, splits)
            x = x + F.linear(attended.to(self.dtype), weights.out, weights.out_bias)
            h = layer.post_attention_layernorm(x).to(self.dtype)
            if fused_mlp:
                activated = gated_silu(h, weights.gate_up, self.mlp_tiles)
            else:
                gate, up = F.linear(h, weights.gate_up).chunk(2, dim=-1)
                activated = layer.mlp.act_fn(gate) * up
            x = x + F.linear(activated, weights.down)
        return inner.norm(x).to(self.dtype)

    def _attention(self, attention: Any, qkv: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, rows: torch.Tensor | None, positions: torch.Tensor,
                   cache: SlotKVCache, layer_index: int, allowed: torch.Tensor | None,
                   splits: int, *, pdl: bool = False, rotary_by_position: bool = False,
                   qkv_bias: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's attention output ``[B, heads * head_dim]`` (stores the new keys and
        values): the fused kernel where it runs (a programmatic dependent launch with
        ``pdl``; ``cos``/``sin`` tables of every position with ``rotary_by_position``;
        ``qkv`` may be the split QKV matmul's partial sums, whose bias is ``qkv_bias``),
        else stock operations."""
        if not self.fused_attention:
            assert allowed is not None and rows is not None, "stock attention needs the mask"
            return self._attend(attention, qkv, cos, sin, rows, positions, cache,
                                layer_index, allowed)
        rows_of_table = cos.shape[0]  # one per row, or one per cache position
        q_norm = getattr(attention, "q_norm", None)
        return decode_attention(
            qkv, cos.view(rows_of_table, -1), sin.view(rows_of_table, -1), positions,
            cache.keys[layer_index], cache.values[layer_index], heads=self.heads,
            scale=self.scaling, splits=splits,
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if q_norm is None else attention.k_norm.weight,
            norm_eps=self.q_norm_eps, pdl=pdl, rotary_by_position=rotary_by_position,
            qkv_bias=qkv_bias,
        )

    def _attend(self, attention: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rows: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
                layer_index: int, allowed: torch.Tensor) -> torch.Tensor:
        """Rotary, cache store and attention in stock torch operations."""
        batch = qkv.shape[0]
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(batch, self.heads, self.head_dim)
        k = k.view(batch, self.kv_heads, self.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before rotary
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        keys, values = cache.keys[layer_index], cache.values[layer_index]
        # an indexed store into the whole cache tensor: a compiler turns it into a
        # write of the new entries only (a store into a slice view would make it copy
        # the slice)
        keys[rows, :, positions] = k.to(keys.dtype)
        values[rows, :, positions] = v.view(batch, self.kv_heads, self.head_dim).to(
            values.dtype)
        grouped = q.to(keys.dtype).view(batch, self.kv_heads, -1, self.head_dim)
        attended = F.scaled_dot_product_attention(grouped, keys[:batch], values[:batch],
                                                  attn_mask=allowed, scale=self.scaling)
        return attended.reshape(batch, self.heads * self.head_dim)
