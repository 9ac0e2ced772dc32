"""The ``megatron`` backend plugin: megatron-core TP/PP/DP (``[backend.megatron]``).

Needs the ``megatron`` extra (``pip install 'reasonctl[megatron]'``) and CUDA GPUs; the
import of megatron-core happens when the backend is set up, so this plugin always loads.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reasonctl import hookimpl


class MegatronBackendConfig(BaseModel):
    """``[backend.megatron]``: how the model is split over the launched GPUs.

    The processes form ``dp x pp x tp``: tensor parallel inside a node, pipeline stages
    across, data parallel over what remains (``world_size / (tp x pp)``).
    """

    model_config = ConfigDict(extra="forbid")

    tp: int = Field(default=1, ge=1, description="Tensor-parallel size (GPUs per layer).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel stages.")
    vpp: int = Field(
        default=1, ge=1,
        description="Virtual pipeline chunks per stage (interleaved 1F1B); needs pp > 1.",
    )
    micro_batch_size: int | None = Field(
        default=None, gt=0,
        description="Rows per pipeline micro-batch: splits the algorithm's micro-batches "
        "further (more micro-batches shrink the pipeline bubble). Default: keep them.",
    )
    use_distributed_optimizer: bool = Field(
        default=False,
        description="Shard optimizer state and float32 main weights over data-parallel "
        "ranks (megatron's DistributedOptimizer). Needs Transformer Engine or Apex: with "
        "torch's Adam, megatron-core cannot restore its checkpoints.",
    )
    export_shard_size: str = Field(
        default="5GB", description="Largest safetensors shard of an export, e.g. '5GB'."
    )

    @model_validator(mode="after")
    def _check(self) -> MegatronBackendConfig:
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp > 1 (interleaved pipeline) needs pp > 1")
        return self


    def layout_problems(self, config: Any, *, processes: int) -> list[str]:
        """``tp x pp`` on ``processes`` processes, CUDA, and for a local model directory the
        heads and layers they split
        (:class:`~reasonctl.core.protocols.ValidatesProcessLayout`)."""
        from reasonctl.backends.layout import local_model_config, megatron_layout_problems

        return megatron_layout_problems(
            processes, tp=self.tp, pp=self.pp, vpp=self.vpp, device=config.backend.device,
            model=local_model_config(config.model.name_or_path))

    def data_parallel_size(self, *, processes: int) -> int:
        """``processes / (tp x pp)``: the ranks data is split over."""
        return max(1, processes // (self.tp * self.pp))


def build_megatron_backend(config: MegatronBackendConfig | None, **_: Any) -> Any:
    """Split the model over GPUs with megatron-core tensor/pipeline/data parallelism."""
    from reasonctl.backends.megatron.backend import MegatronBackend, MegatronSettings
    from reasonctl.backends.megatron.model import ModelParallelSizes

    config = config or MegatronBackendConfig()
    return MegatronBackend(MegatronSettings(
        sizes=ModelParallelSizes(tp=config.tp, pp=config.pp, vpp=config.vpp),
        micro_batch_size=config.micro_batch_size,
        use_distributed_optimizer=config.use_distributed_optimizer,
        export_shard_size=config.export_shard_size,
    ))


@hookimpl
def register_backends(register: Any) -> None:
    """Register the ``megatron`` backend."""
    register("megatron", build_megatron_backend, config_model=MegatronBackendConfig)
