"""The ``fsdp`` backend plugin: FSDP2 / HSDP over the launched processes (``[backend.fsdp]``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reasonctl import hookimpl


class FSDPBackendConfig(BaseModel):
    """``[backend.fsdp]``: sharding layout and memory/speed trade-offs."""

    model_config = ConfigDict(extra="forbid")

    dp_replicate: int = Field(
        default=1, ge=1,
        description="Replicas of the sharded group (HSDP), e.g. the number of nodes.",
    )
    dp_shard: int = Field(
        default=-1,
        description="Ranks each parameter is sharded over; -1: world_size / dp_replicate.",
    )
    tp: int = Field(
        default=1, ge=1,
        description="Tensor-parallel ranks per model replica: the attention and MLP "
        "projections of every block are split over them (DTensor), and FSDP shards over "
        "the data-parallel ranks (world_size / tp).",
    )
    cp: int = Field(
        default=1, ge=1,
        description="Context-parallel ranks per sequence: every sequence is split over them "
        "(load-balanced chunks, keys/values gathered in attention) for rows too long for "
        "one device; data parallel over world_size / (cp x tp). Qwen2/2.5/3 and Qwen-VL "
        "language towers, and the Wan, SD3 and Cosmos diffusion transformers (their "
        "latent tokens split).",
    )
    reshard_after_forward: Literal["default", "always", "never"] = Field(
        default="default",
        description="When a block frees its gathered parameters after forward: default: "
        "every block but the last (backward needs it at once); always: every block (least "
        "memory, the last block gathered twice); never: none, as ZeRO-2 (no second "
        "all-gather in backward, but every rank holds the whole model's weights from "
        "forward to backward). The root (embeddings, output head) always stays gathered. "
        "true / false are read as default / never.",
    )
    param_dtype: Literal["float32", "compute"] = Field(
        default="float32",
        description="As backend.single.param_dtype: float32 shards and optimizer state with "
        "compute in model.dtype, or compute: shards, gradients and optimizer state in "
        "model.dtype (half the memory and traffic, faster; small updates can round away).",
    )
    reduce_dtype: Literal["float32", "compute"] = Field(
        default="float32",
        description="Dtype gradients are reduced (reduce-scattered) in: float32, or compute "
        "(model.dtype: half the traffic, less precise sums over many ranks).",
    )
    prefetch: int = Field(
        default=1, ge=0, le=8,
        description="Blocks whose weights are gathered ahead of use in forward and backward "
        "(more overlap, one more gathered block of memory each); 0: FSDP's implicit order.",
    )
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = Field(
        default="every_micro_batch",
        description="When gradients are reduced over ranks: after every micro-batch, or "
        "once after the step's last (fewer reductions; full-size gradients kept on every "
        "rank until then).",
    )
    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _boolean_spelling(cls, value: Any) -> Any:
        """The earlier boolean spelling: ``true`` was today's default, ``false`` never."""
        if isinstance(value, bool):
            return "default" if value else "never"
        return value

    logprob_chunk_tokens: int = Field(
        default=2048, gt=0,
        description="Tokens per chunk of the output projection + log-softmax.",
    )
    export_shard_size: str = Field(
        default="5GB", description="Largest safetensors shard of an export, e.g. '5GB'."
    )


    def layout_problems(self, config: Any, *, processes: int) -> list[str]:
        """The mesh on ``processes`` processes and, for a local model directory, the heads
        ``tp`` splits (:class:`~reasonctl.core.protocols.ValidatesProcessLayout`)."""
        from reasonctl.backends.layout import (
            fsdp_layout_problems,
            local_model_config,
            model_split_problems,
        )

        problems = fsdp_layout_problems(processes, dp_replicate=self.dp_replicate,
                                        dp_shard=self.dp_shard, cp=self.cp, tp=self.tp)
        if self.tp > 1:
            problems += model_split_problems(local_model_config(config.model.name_or_path),
                                             "backend.fsdp.tp", self.tp)
        return problems

    def data_parallel_size(self, *, processes: int) -> int:
        """``processes / (cp x tp)``: the ranks data is split over."""
        from reasonctl.backends.layout import fsdp_data_parallel_size

        return fsdp_data_parallel_size(processes, cp=self.cp, tp=self.tp)


def build_fsdp_backend(config: FSDPBackendConfig | None, **_: Any) -> Any:
    """Shard the model over processes with FSDP2 (HSDP with dp_replicate > 1)."""
    from reasonctl.backends.fsdp import FSDPBackend

    config = config or FSDPBackendConfig()
    return FSDPBackend(
        dp_replicate=config.dp_replicate,
        dp_shard=config.dp_shard,
        tp=config.tp,
        cp=config.cp,
        reshard_after_forward=config.reshard_after_forward,
        param_dtype=config.param_dtype,
        reduce_dtype=config.reduce_dtype,
        prefetch=config.prefetch,
        gradient_sync=config.gradient_sync,
        chunk_tokens=config.logprob_chunk_tokens,
        export_shard_size=config.export_shard_size,
    )


@hookimpl
def register_backends(register: Any) -> None:
    """Register the ``fsdp`` backend."""
    register("fsdp", build_fsdp_backend, config_model=FSDPBackendConfig)
