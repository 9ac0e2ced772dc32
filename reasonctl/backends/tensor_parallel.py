"""Tensor parallelism of Llama-style decoder blocks with DTensor (for the ``fsdp`` backend).

Every decoder layer's attention and MLP are split Megatron-style over a one-dimensional
``tp`` mesh: the query, key, value, gate and up projections by output features
(column-wise, each rank computing ``heads / tp`` attention heads and ``ffn / tp`` MLP
channels), the attention output and down projections by input features (row-wise, their
partial outputs summed across the ranks). Inputs and outputs of each block stay
replicated, so norms, embeddings and the output head are untouched. The attention code of
``transformers`` infers the head count from the projection's width, so the local heads
need no change to it.
"""

from __future__ import annotations

from typing import Any

from reasonctl.backends.layout import model_split_problems
from reasonctl.core.errors import ConfigError

COLUMN_WISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
               "mlp.up_proj")
ROW_WISE = ("self_attn.o_proj", "mlp.down_proj")


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Raise :class:`ConfigError` naming every reason ``config``'s model cannot be split
    over ``tp`` ranks."""
    problems = []
    if getattr(config, "vision_config", None) is not None:
        problems.append("backend.fsdp.tp > 1 splits text decoders only; train "
                        "vision-language models with tp = 1")
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or getattr(config, "num_attention_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    problems += [f"the model config has no {name}; tensor parallelism needs it"
                 for name, value in sizes.items() if value is None]
    problems += model_split_problems(sizes, "backend.fsdp.tp", tp)
    if problems:
        raise ConfigError(problems)


def parallelize_blocks(hf_model: Any, tp_mesh: Any) -> int:
    """Split every decoder layer of ``hf_model`` over ``tp_mesh``; returns the layer count.

    Works on real or meta-device parameters (they become DTensors either way)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tensor_parallel(hf_model.config, tp_mesh.size())
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if not layers:
        raise ConfigError([f"{type(hf_model).__name__} has no model.layers to split; use "
                           "backend.fsdp.tp = 1 or the megatron backend"])
    for layer in layers:
        missing = [name for name in (*COLUMN_WISE, *ROW_WISE) if not _has_submodule(layer, name)]
        if missing:
            raise ConfigError([f"{type(layer).__name__} lacks {', '.join(missing)}: "
                               "backend.fsdp.tp supports Llama-style blocks only"])
        plan: dict[str, Any] = {name: ColwiseParallel() for name in COLUMN_WISE}
        plan.update({name: RowwiseParallel() for name in ROW_WISE})
        parallelize_module(layer, tp_mesh, plan)
    return len(layers)


def _has_submodule(module: Any, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
