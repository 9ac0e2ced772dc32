"""A megatron-core ``GPTModel`` with the architecture of a Hugging Face Qwen2/Qwen3/Llama model.

The transformer config carries GQA (``num_query_groups``), SwiGLU (``gated_linear_unit`` +
SiLU), RMSNorm with the model's epsilon, QKV bias (Qwen2), q/k RMSNorm (Qwen3), the head
dim (``kv_channels``) and tied embeddings. The layer spec is the local one
(``get_gpt_layer_local_spec``: megatron's own linear layers, torch's RMSNorm and
megatron's dot-product attention), so Transformer Engine is not needed; every kernel fusion
that would need it or Apex is off. The torch norms of that spec do not support sequence
parallelism, so it is not offered.

RoPE frequencies are taken from the Hugging Face model's own rotary module, so every
``rope_type`` whose attention scaling is 1 (default, linear, llama3, ...) matches exactly;
megatron's llama3 scaling has hard-coded factors, so it is not used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from reasonctl.backends.megatron.convert import ConversionError, ModelShape
from reasonctl.core.errors import require


@dataclass(frozen=True)
class ModelParallelSizes:
    """Tensor, pipeline and virtual-pipeline sizes."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1


def require_megatron() -> Any:
    """Import ``megatron.core`` or raise an error that names the ``megatron`` extra."""
    return require("megatron.core", extra="megatron", what="backend.name = 'megatron'")


def transformer_config(hf_config: Any, *, sizes: ModelParallelSizes, dtype: torch.dtype,
                       recompute: bool = False, cpu_init: bool = False) -> Any:
    """The megatron ``TransformerConfig`` equivalent to ``hf_config``.

    ``dtype`` is the parameter and compute dtype (bf16/fp16 turn on megatron's mixed
    precision with float32 main weights in the optimizer). ``recompute`` recomputes every
    layer's activations in backward (``model.gradient_checkpointing``). ``cpu_init``
    creates parameters on the CPU instead of the current CUDA device.
    """
    require_megatron()
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = ModelShape.from_hf_config(hf_config)
    extra: dict[str, Any] = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp if sizes.vpp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        # kept on although every weight is then loaded: megatron marks tensor-parallel
        # weights (``tensor_model_parallel``, which the gradient norm relies on) only
        # while initialising them
        perform_initialization=True,
        **extra,
    )


def build_gpt_model(hf_config: Any, config: Any, *, pre_process: bool, post_process: bool,
                    vp_stage: int | None = None) -> Any:
    """One model chunk: a ``GPTModel`` for the stage described by the flags.

    Weights are randomly initialised; load the real ones with
    :func:`~reasonctl.backends.megatron.weights.load_chunk_weights`.
    """
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    shape = ModelShape.from_hf_config(hf_config)
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    kwargs: dict[str, Any] = {}
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf_config)),
        **kwargs,
    )
    model.rotary_pos_emb.inv_freq = hf_rope_inv_freq(hf_config)
    return model


def rope_theta(hf_config: Any) -> float:
    """The RoPE base of a Hugging Face config (``rope_parameters`` or legacy ``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def hf_rope_inv_freq(hf_config: Any) -> torch.Tensor:
    """Inverse RoPE frequencies (float32, CPU) computed by the model's own rotary module."""
    model_type = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")
               and not n.startswith("_")]
    if len(classes) != 1:
        raise ConversionError(f"cannot find the rotary embedding of {model_type!r} models")
    rotary = classes[0](config=hf_config)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ConversionError(
            f"{model_type}: RoPE scaling {getattr(rotary, 'rope_type', '?')!r} scales attention "
            f"by {scaling}, which the megatron backend does not support; use backend.name = "
            "'fsdp'"
        )
    return rotary.inv_freq.detach().float().clone()
