"""The ``hf`` rollout engine plugin: embedded generation with the policy's own weights.

Config section ``[rollout.hf]``. The engine itself lives in
:mod:`reasonctl.rollout.hf_engine`; this module only registers it and decides, from the
run's backend, whether the engine shares the policy module or keeps its own copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reasonctl import hookimpl
from reasonctl.rollout.static.buckets import DEFAULT_GRAPH_BATCH_SIZES

if TYPE_CHECKING:
    from reasonctl.core.context import RunContext
    from reasonctl.core.registry import Registrar
    from reasonctl.rollout.options import DecodeOptions


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
        "the policy module itself (no "
        "copy). false: keep a separate copy refreshed from the trainer before each rollout.",
    )


def build_hf_engine(config: HFRolloutConfig | None, *, ctx: RunContext,
                    options: DecodeOptions | None = None) -> Any:
    """Build the engine for the run in ``ctx``.

    With ``share_weights`` and a backend offering a ``generation_model`` (the ``single``
    backend) the engine generates with that module under the backend's autocast. Otherwise
    (FSDP, Megatron: sharded or wrapped weights) it loads its own
    unsharded copy on the backend's device; the algorithm refreshes it with
    ``update_weights(backend.full_state_dict())`` before each rollout. ``options`` are the
    decode path's switches (benchmarks turn parts off; default: the fast path).
    """
    from transformers import AutoTokenizer

    from reasonctl.models.loading import compute_dtype, load_pretrained, model_source
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    config = config or HFRolloutConfig()
    backend = ctx.backend
    if backend is None:
        raise RuntimeError("the hf rollout engine is built after the backend is set up")
    source = model_source(ctx)
    tokenizer = AutoTokenizer.from_pretrained(
        source.tokenizer_dir, trust_remote_code=ctx.config.model.trust_remote_code
    )
    decode_options: dict[str, Any] = {
        "max_batch_size": config.max_batch_size, "decode": config.decode,
        "cuda_graphs": config.cuda_graphs, "graph_batch_sizes": config.graph_batch_sizes,
        "compile_decode": config.compile, "fused_kernels": config.fused_kernels,
    }
    if options is not None:
        decode_options["options"] = options
    shared = getattr(backend, "generation_model", None)
    if config.share_weights and shared is not None:
        return HFRolloutEngine(
            shared, tokenizer, autocast=getattr(backend, "autocast", None),
            shares_policy_weights=True, **decode_options,
        )
    dtype = compute_dtype(ctx.config.model.dtype, backend.device)
    model = load_pretrained(source.model_dir, ctx.config.model, param_dtype=dtype,
                            device=backend.device)
    model.requires_grad_(False)
    return HFRolloutEngine(model, tokenizer, **decode_options)


@hookimpl
def register_rollout_engines(register: Registrar) -> None:
    """Register the embedded ``hf`` engine."""
    register("hf", build_hf_engine, config_model=HFRolloutConfig)
