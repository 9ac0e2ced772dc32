"""The ``single`` backend plugin: one CPU or CUDA device (``[backend.single]``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reasonctl import hookimpl


class SingleBackendConfig(BaseModel):
    """``[backend.single]``: options of the one-device backend."""

    model_config = ConfigDict(extra="forbid")

    param_dtype: Literal["float32", "compute"] = Field(
        default="float32",
        description="float32: fp32 weights + autocast to model.dtype; compute: weights and "
        "optimizer state in model.dtype (less memory, less precise updates).",
    )
    logprob_chunk_tokens: int = Field(
        default=2048, gt=0,
        description="Tokens per chunk of the output projection + log-softmax.",
    )
    export_shard_size: str = Field(
        default="5GB", description="Largest safetensors shard of an export, e.g. '5GB'."
    )


    def config_problems(self, config: Any, *, world_size: int) -> list[str]:
        """Parallel layouts set for ``fsdp`` that a one-device run would silently ignore
        (:class:`~reasonctl.core.protocols.ValidatesRunConfig`)."""
        fsdp = config.component_config("backend", "fsdp")
        return [
            f"backend.fsdp.{key}: {value} splits {what} over processes of the fsdp backend, "
            "but backend.name = 'single' runs one process that holds everything; use "
            f"--backend fsdp --nproc-per-node N (N a multiple of {key}), or set {key} = 1"
            for key, what in (("cp", "sequences"), ("tp", "layers"))
            if (value := getattr(fsdp, key, 1)) > 1
        ]


def build_single_backend(config: SingleBackendConfig | None, **_: Any) -> Any:
    """Train on one device (CPU or one GPU)."""
    from reasonctl.backends.single import SingleDeviceBackend

    config = config or SingleBackendConfig()
    return SingleDeviceBackend(
        param_dtype=config.param_dtype,
        chunk_tokens=config.logprob_chunk_tokens,
        export_shard_size=config.export_shard_size,
    )


@hookimpl
def register_backends(register: Any) -> None:
    """Register the ``single`` backend."""
    register("single", build_single_backend, config_model=SingleBackendConfig)
