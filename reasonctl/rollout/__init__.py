"""Embedded rollout: batched sampling with a KV cache on the policy's own weights.

``sampling`` picks the next token from logits (temperature, top-k, top-p) and reports its
log-probability; ``stopping`` finds stop strings in generated text; ``hf_engine`` runs the
decode loop on a Hugging Face causal LM. Its fast path: ``slot_cache`` (a static KV cache of
per-sequence slots), ``fast_decode`` (prefill, decode steps and continuous batching on it),
``cuda_graphs`` (the decode step captured per batch size) and ``buckets`` (those batch
sizes). The dedicated decode step is ``decode_forward``; its Triton kernels are
``decode_norm``, ``decode_linear``, ``decode_attention`` and ``decode_mlp`` (the kernel
chain), ``head_sampling`` and ``race_sampling`` (sampling) and ``step_record`` (each
step's bookkeeping). Import the submodules directly: this package does not import torch
on its own.
"""
