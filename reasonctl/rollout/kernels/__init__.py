"""The Triton kernels of the static decode path, each with its checks and torch twin.

Every module holds one operation: a launcher that checks its arguments and names every
problem, the kernel source defined by ``_kernels()`` on first use (so importing a module
imports neither Triton nor anything compiled, and ``TRITON_INTERPRET`` is read then), and
where the tests compare against one a ``*_reference`` function computing the same in
plain torch (Triton's interpreter runs the kernels on CPU in the tests).

- decode step chain: :mod:`.decode_norm` (residual add + RMSNorm, embedding lookup),
  :mod:`.decode_linear` (skinny matmuls with split reductions), :mod:`.decode_attention`
  (rotary, cache store and attention bounded by each slot's length) and
  :mod:`.decode_mlp` (gate/up projection with its activation);
- prefill: :mod:`.prefill_kernels` (rotary embedding, ``silu(gate) * up``);
- sampling: :mod:`.race_sampling` (over written logits) and :mod:`.head_sampling` (the
  output head inside the sampler);
- bookkeeping: :mod:`.step_record` (each decode step's in one kernel);
- :mod:`.triton_support`: whether Triton and its interpreter run, what the GPU offers.

Kernel math and launch order are measured choices (see ``bench/RESULTS.md``); tile and
block sizes are module constants, switches live in
:class:`~reasonctl.rollout.options.DecodeOptions`.
"""
