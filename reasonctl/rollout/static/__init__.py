"""The static decode path of :class:`~reasonctl.rollout.hf_engine.HFRolloutEngine`.

Text prompts on SDPA text decoders decode here: :mod:`.decoder` (``StaticDecoder``:
prefill into slots, decode steps in windows, the cache kept across calls) and
:mod:`.run` (one call's continuous batching) on a static :mod:`.slot_cache`, with the
per-slot device state and stock bookkeeping of :mod:`.buffers`; on CUDA each batch-size
bucket (:mod:`.buckets`) replays a captured graph (:mod:`.cuda_graphs`). For Qwen2/2.5/3
and Llama models the step is the dedicated :mod:`.decode_forward` (weights in
:mod:`.decode_weights`, rotary tables in :mod:`.rotary`), which runs the Triton kernels of
:mod:`reasonctl.rollout.kernels` where they run. Its switches are a
:class:`~reasonctl.rollout.options.DecodeOptions`.

Importing this package imports nothing; ``buckets`` is torch-free.
"""
