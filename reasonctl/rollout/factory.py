"""Building the embedded ``hf`` engine for a run (the factory the ``hf`` plugin registers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl.rollout.config import HFRolloutConfig

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.rollout.options import DecodeOptions


def build_hf_engine(config: HFRolloutConfig | None, *, ctx: RunContext,
                    options: DecodeOptions | None = None) -> Any:
    """Build the engine for the run in ``ctx``.

    With ``share_weights`` and a backend offering a ``generation_model`` (the ``single``
    backend) the engine generates with that module under the backend's autocast. Otherwise
    (FSDP, Megatron: sharded or wrapped weights; or no backend, as in ``reasonctl eval``) it
    loads its own unsharded copy of ``ctx.model_source`` on the backend's device (or
    ``backend.device``); the trainer refreshes it with ``update_weights`` before each
    rollout. ``rollout.hf.dtype`` other than ``auto`` always gives the engine a copy of
    its own in that dtype. ``options`` are the decode path's switches (benchmarks turn
    parts off; default: the fast path).
    """
    from reasonctl.core.protocols import generation_model
    from reasonctl.models.loading import compute_dtype, ensure_model_source, load_pretrained
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    config = config or HFRolloutConfig()
    source = ensure_model_source(ctx)
    tokenizer = ctx.processor.tokenizer if ctx.processor is not None else _tokenizer(ctx)
    decode_options: dict[str, Any] = {
        "max_batch_size": config.max_batch_size, "decode": config.decode,
        "cuda_graphs": config.cuda_graphs, "graph_batch_sizes": config.graph_batch_sizes,
        "compile_decode": config.compile, "fused_kernels": config.fused_kernels,
    }
    if options is not None:
        decode_options["options"] = options
    backend = ctx.backend
    shared = generation_model(backend) if backend is not None else None
    if config.share_weights and shared is not None and config.dtype == "auto":
        return HFRolloutEngine(
            shared, tokenizer, autocast=backend.autocast,  # type: ignore[union-attr]
            shares_policy_weights=True, **decode_options,
        )
    if backend is not None:
        device = backend.device
    else:
        from reasonctl.backends.distributed import run_device

        device = run_device(ctx.config)
    dtype = compute_dtype(ctx.config.model.dtype if config.dtype == "auto" else config.dtype,
                          device)
    model = load_pretrained(source.model_dir, ctx.config.model, param_dtype=dtype, device=device)
    model.requires_grad_(False)
    return HFRolloutEngine(model, tokenizer, **decode_options)


def _tokenizer(ctx: RunContext) -> Any:
    from transformers import AutoTokenizer

    assert ctx.model_source is not None
    return AutoTokenizer.from_pretrained(
        ctx.model_source.tokenizer_dir, trust_remote_code=ctx.config.model.trust_remote_code
    )
