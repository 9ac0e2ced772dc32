"""The static decode path's switches, as one frozen object the engine is built with.

Every switch's default is the fast path; each exists so that a benchmark or a test can
turn one part off and measure or compare what it does, without changing anything else.
Build a variant with :func:`dataclasses.replace`::

    from dataclasses import replace
    from reasonctl.rollout import DecodeOptions, HFRolloutEngine

    engine = HFRolloutEngine(model, tokenizer,
                             options=replace(DecodeOptions(), head_sampling=False))

The engine hands the object down to the parts that read it (the static decoder, its
dedicated decode step, the kernels' launch choices). The ``[rollout.hf]`` config keys
(``cuda_graphs``, ``compile``, ``fused_kernels`` ...) are the engine's own arguments, not
switches here. Tile and block sizes are tuning constants of the kernel modules.

Torch-free, so configuration code and benchmarks' argument parsing can import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeOptions:
    """Switches of the static decode path (defaults: everything on, the fast path).

    Most only matter with ``fused_kernels`` on a device where the Triton kernels run; on
    other devices, or for models the dedicated decode step does not support, the parts
    they switch do not run at all.
    """

    head_sampling: bool = True
    """Plain sampling with the dedicated decode step applies the output head inside the
    sampler (:mod:`reasonctl.rollout.kernels.head_sampling`) instead of writing logits
    and sampling them."""
    fast_logarithm: bool = True
    """The head sampler's Gumbel noise uses the GPU's approximate logarithm (False: the
    library's exact one, e.g. to compare draws)."""
    kernel_chain: bool = True
    """Batches small enough run the whole decode step as the chain of Triton kernels
    (False: library matmuls and the model's norms; the fused attention and gate/up
    kernels stay)."""
    fused_mlp: bool = True
    """The gate/up projection and its activation run as one kernel (False: the library
    matmul and a separate activation; then no kernel chain either, since the chain
    always has that kernel)."""
    programmatic_launches: bool = True
    """The kernel chain's kernels, and the sampler and bookkeeping kernels after them,
    are programmatic dependent launches where the GPU has them (False: ordinary
    launches)."""
    tensor_descriptors: bool = True
    """The chain's matmuls read their operands through tensor descriptors where the GPU
    has them (False: per-thread loads everywhere)."""
    preload_qkv: bool = True
    """The chain's QKV matmul loads its weight shares whole before waiting for the
    previous kernel, where they are small enough (False: its reduction loop)."""
    dedicated_prefill: bool = True
    """Where the kernel chain runs, prompts are prefilled by the dedicated decode step's
    prefill (False: the Hugging Face forward pass)."""
    prefill_graphs: bool = True
    """With CUDA graphs and the dedicated prefill, a prefill of a shape (prompts, width,
    slots) seen before replays a CUDA graph of it (False: always launched kernel by
    kernel). The first prefill of a shape runs eagerly: a workload whose prompt widths
    never repeat pays no capture."""
    prefill_graph_limit: int = 16
    """The most prefill shapes kept as graphs per cache; later new shapes run eagerly."""
    sync_every: int = 16
    """Decode steps queued between host synchronisations (the length of a window)."""

    def __post_init__(self) -> None:
        problems = []
        if self.sync_every < 1:
            problems.append(f"sync_every must be at least 1 (got {self.sync_every})")
        if self.prefill_graph_limit < 0:
            problems.append(f"prefill_graph_limit must be at least 0 "
                            f"(got {self.prefill_graph_limit})")
        if problems:
            raise ValueError("DecodeOptions: " + "; ".join(problems))
