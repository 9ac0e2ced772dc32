"""The megatron-core backend (``backend.name = "megatron"``): TP/PP/DP for Qwen2/Llama models.

Modules: :mod:`.convert` (pure Hugging Face <-> megatron weight mapping), :mod:`.model`
(``GPTModel`` from a Hugging Face config), :mod:`.parallel` (process groups),
:mod:`.batches` (micro-batch layout), :mod:`.logprobs` (vocabulary-parallel log-probs),
:mod:`.weights` (shard loading and full-weight streaming), :mod:`.checkpoint`
(resumable state) and :mod:`.backend` (the backend itself). Only :mod:`.convert`,
:mod:`.batches` and :mod:`.logprobs` work without megatron-core.
"""
