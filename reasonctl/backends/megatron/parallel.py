"""megatron-core's model-parallel state: tensor, pipeline and data-parallel groups.

The launched processes are split as ``world = dp x pp x tp`` (megatron's default order:
tensor-parallel ranks are adjacent, so a TP group stays inside one node); data
parallelism takes whatever ``tp x pp`` leaves.
"""

from __future__ import annotations

from reasonctl.backends.layout import model_parallel_problems
from reasonctl.backends.megatron.model import ModelParallelSizes
from reasonctl.backends.megatron.weights import ParallelGroups
from reasonctl.core.errors import ConfigError


def check_sizes(sizes: ModelParallelSizes, world_size: int) -> int:
    """The data-parallel size ``world / (tp x pp)``; a config error when it does not divide."""
    problems = model_parallel_problems(world_size, tp=sizes.tp, pp=sizes.pp)
    if problems:
        raise ConfigError(problems)
    return world_size // (sizes.tp * sizes.pp)


def initialize(sizes: ModelParallelSizes, *, seed: int) -> ParallelGroups:
    """Create megatron's process groups and seed its model-parallel RNG (CUDA)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp if sizes.vpp > 1 else None,
    )
    model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(
        tp_size=sizes.tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_size=sizes.pp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        vpp_size=sizes.vpp,
        tp_group=parallel_state.get_tensor_model_parallel_group() if sizes.tp > 1 else None,
        pp_group=parallel_state.get_pipeline_model_parallel_group() if sizes.pp > 1 else None,
    )


def data_parallel_coordinates() -> tuple[int, int]:
    """``(rank, size)`` of this process in its data-parallel group."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size())


def destroy() -> None:
    """Tear megatron's groups down (the default process group is left alone)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
