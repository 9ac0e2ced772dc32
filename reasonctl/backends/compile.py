"""``train.compile``: compile each transformer block of the model for training passes.

Each block (a class in the model's ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``) gets
its ``forward`` compiled with ``torch.compile``, which fuses the normalisation, rotary,
activation and residual kernels between the matmuls. Blocks of one class share one
compiled function that takes the block as an argument (parameters are graph inputs), so
compile time does not grow with depth. Only passes with gradients use the compiled code:
evaluation and the rollout engine's decode steps, whose shapes change every call, run
eagerly instead of triggering recompiles. Parameter names are unchanged, so checkpoints
and exports are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def transformer_blocks(hf_model: nn.Module) -> list[nn.Module]:
    """The modules of ``hf_model`` whose class is listed in its ``_no_split_modules``."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    return [m for m in hf_model.modules() if type(m).__name__ in names]


def compile_blocks(hf_model: nn.Module, *, without_grad: bool = False) -> int:
    """Compile the training forward of every transformer block; return how many.

    ``without_grad`` compiles the passes without gradients too: for models whose inference
    shapes do not change from call to call (a diffusion transformer's denoising steps).
    Those shapes are few (the sampling batch, the training micro-batch), so each gets its
    own static graph instead of one graph with a symbolic batch size.
    """
    blocks = transformer_blocks(hf_model)
    if not blocks:
        raise ValueError(
            f"{type(hf_model).__name__} lists no transformer block classes "
            "(_no_split_modules), so train.compile cannot find blocks to compile"
        )
    compiled: dict[type, Callable[..., Any]] = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=False if without_grad else None)
        block.forward = _dispatch(block, compiled[cls], without_grad)  # type: ignore[method-assign]
    return len(blocks)


def _dispatch(block: nn.Module, compiled: Callable[..., Any],
              without_grad: bool = False) -> Callable[..., Any]:
    """``block``'s forward: the compiled function with gradients (and without, when asked),
    the eager one otherwise."""
    eager = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if without_grad or torch.is_grad_enabled():
            return compiled(block, *args, **kwargs)
        return eager(*args, **kwargs)

    return forward
