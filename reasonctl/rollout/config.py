"""``[rollout.hf]``: how the embedded engine (:class:`~reasonctl.rollout.HFRolloutEngine`) runs.

Torch-free, so registering the engine and validating configs never import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.rollout.static.buckets import DEFAULT_GRAPH_BATCH_SIZES


class HFRolloutConfig(BaseModel):
    """``[rollout.hf]``: how the embedded engine runs."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(
        default=64, gt=0, description="Sequences (prompts x n) decoded together at most."
    )
    decode: Literal["static", "dynamic"] = Field(
        default="static",
        description="static: a KV cache allocated once, continuous batching, few host "
        "synchronisations (text prompts on SDPA text decoders). dynamic: the per-token loop "
        "over transformers' dynamic cache (always used for vision prompts).",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="With decode = 'static' on CUDA, replay the decode step as a CUDA graph "
        "per batch-size bucket. No effect on other devices.",
    )
    compile: bool = Field(
        default=False,
        description="With decode = 'static', compile the decode step with torch.compile "
        "where it runs library matmuls: batches above 64 sequences, or every batch when "
        "the kernel chain does not run (fused_kernels = false, no Triton, models outside "
        "Qwen2/Qwen3/Llama); one compile for every batch size, paid on the first rollout.",
    )
    fused_kernels: bool = Field(
        default=True,
        description="With decode = 'static' on CUDA with Triton installed, run the "
        "dedicated decode step of batches up to 64 sequences as a chain of Triton kernels "
        "(residual add and RMSNorm, small-batch matmuls, attention bounded by each "
        "sequence's length with rotary and the cache store, the MLP's gate/up projection "
        "with its activation), launched as programmatic dependent launches on compute "
        "capability 9.0+; plain sampling (no top-k/top-p) with the output head inside the "
        "sampler; each step's bookkeeping as one kernel (see bench/RESULTS.md). "
        "false: stock torch operations.",
    )
    graph_batch_sizes: list[int] = Field(
        default_factory=lambda: list(DEFAULT_GRAPH_BATCH_SIZES),
        description="Batch-size buckets the static decode step runs at (live rows are "
        "padded up to the next one); max_batch_size is always one.",
    )
    share_weights: bool = Field(
        default=True,
        description="With a backend whose weights are not sharded (single), generate with "
        "the policy module itself (no copy; with [model.lora] the engine always keeps a "
        "merged copy). false: keep a separate copy refreshed from the trainer before each "
        "rollout.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Dtype of the engine's weights and computation. auto: model.dtype's "
        "compute dtype, as the trainer's. Another value keeps a copy of its own in that "
        "dtype (share_weights does not apply), e.g. bfloat16 rollouts for a float32 "
        "trainer; [algorithm.grpo.mismatch] corrects the update for the difference.",
    )
