"""Embedded rollout: batched sampling with a KV cache on the policy's own weights.

``sampling`` picks the next token from logits (temperature, top-k, top-p) and reports its
log-probability; ``stopping`` finds stop strings in generated text; ``hf_engine`` runs the
decode loop on a Hugging Face causal LM. Import the submodules directly: this package does
not import torch on its own.
"""
