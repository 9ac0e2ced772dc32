"""Embedded rollout: batched sampling with a KV cache on the policy's own weights.

The package is an engine facade over two decode paths and the kernels they run:

- :class:`HFRolloutEngine` (:mod:`~reasonctl.rollout.hf_engine`) is the engine the ``hf``
  rollout plugin builds: it generates completions (``generate``), streams one
  (``stream``) and takes new weights (``update_weights``), choosing per call between the
  static path and the dynamic one (:mod:`~reasonctl.rollout.dynamic`: a per-token loop
  over ``transformers``' dynamic cache, for vision prompts, other models and streaming).
- :class:`DecodeOptions` (:mod:`~reasonctl.rollout.options`) is the frozen set of the
  static path's switches, given to the engine at construction and handed down to every
  part that reads one; benchmarks and tests build variants with
  :func:`dataclasses.replace`.
- What both paths share: :mod:`~reasonctl.rollout.sampling` (temperature, top-k, top-p and
  the log-prob to record), :mod:`~reasonctl.rollout.stopping` (stop strings) and
  :mod:`~reasonctl.rollout.rows` (completions being generated).

:mod:`reasonctl.rollout.static` is the static decode path: ``decoder`` (prefill, decode
windows and continuous batching on a static cache), ``run`` (one call's loop),
``slot_cache`` (the KV cache of per-sequence slots), ``buffers`` (per-slot device state
and each step's stock bookkeeping), ``cuda_graphs`` (a step captured per batch size),
``buckets`` (those batch sizes), and the dedicated decode step for Llama-style models:
``decode_forward`` with its ``decode_weights`` and ``rotary``.

:mod:`reasonctl.rollout.kernels` holds the Triton kernels, each next to its checks and,
where the tests compare against one, its torch ``*_reference`` twin: ``decode_norm``,
``decode_linear``, ``decode_attention`` and ``decode_mlp`` (the decode step's kernel
chain), ``prefill_kernels`` (the dedicated prefill's element-wise steps),
``head_sampling`` and ``race_sampling`` (plain sampling), ``step_record`` (each step's
bookkeeping) and ``triton_support`` (what they share). Triton is imported on first use.

Importing this package imports neither torch nor Triton: :class:`DecodeOptions` is
torch-free, and :class:`HFRolloutEngine` and :class:`RolloutStats` load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl.rollout.options import DecodeOptions

if TYPE_CHECKING:
    from reasonctl.rollout.hf_engine import HFRolloutEngine, RolloutStats

__all__ = ["DecodeOptions", "HFRolloutEngine", "RolloutStats"]


def __getattr__(name: str) -> Any:
    """The engine's classes, imported (with torch) on first access."""
    if name in ("HFRolloutEngine", "RolloutStats"):
        from reasonctl.rollout import hf_engine

        return getattr(hf_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
