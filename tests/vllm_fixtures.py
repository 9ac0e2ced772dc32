"""Shared pieces of the vLLM engine tests: a tiny Qwen2 vLLM's CPU build runs (head size
64), the run context an engine is built in, and the ``hf`` engine on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VLLM_SECTION = {"kv_cache_memory_gib": 0.0625, "max_num_seqs": 64, "max_model_len": 512,
                "enforce_eager": True}
"""``[rollout.vllm]`` for CPU tests: a small KV cache and context."""


def make_vllm_model_dir(path: Path, *, initializer_range: float = 0.1) -> Path:
    """A random Qwen2 of 2 layers, hidden size 128 and head size 64 (2 query heads, 1 KV
    head); ``initializer_range`` 0.1 makes greedy continuations varied."""
    from reasonctl.models.tiny import make_tiny_model_dir

    return make_tiny_model_dir(path, hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=256,
                               initializer_range=initializer_range)


def engine_context(model_dir: Path, output_dir: Path, **vllm: Any) -> Any:
    """The run context an engine is built in (no backend, as in ``reasonctl eval``)."""
    from reasonctl.testing import run_context

    section = {**VLLM_SECTION, **vllm}
    return run_context({"model": {"name_or_path": str(model_dir)},
                        "backend": {"device": "cpu"},
                        "rollout": {"engine": "vllm", "vllm": section},
                        "run": {"output_dir": str(output_dir)}})


def build_engine(ctx: Any) -> Any:
    """The ``vllm`` engine as a run builds it, from ``ctx``'s ``[rollout.vllm]``."""
    from reasonctl.runtime.composition import build_rollout_engine

    return build_rollout_engine(ctx)


def hf_engine(model_dir: Path) -> tuple[Any, Any]:
    """``(engine, model)``: the ``hf`` engine on its own float32 copy of the weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    return HFRolloutEngine(model, AutoTokenizer.from_pretrained(model_dir)), model


def perturbed(model: Any, scale: float = 0.3, seed: int = 1) -> dict[str, Any]:
    """A copy of ``model``'s state dict with Gaussian noise added (a different policy)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + scale * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}
