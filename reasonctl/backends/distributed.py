"""Devices and process groups for the PyTorch backends."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reasonctl.core.errors import ReasonctlError

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig

DEFAULT_CPU_THREADS = 1
"""Torch threads of a CPU run when neither ``backend.cpu_threads`` nor ``OMP_NUM_THREADS``
says: the small models trained on a CPU run fastest on one thread, and several threads on
a busy machine wait on each other (``bench/cpu_threads.py``)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` is the process's CUDA device when there is one (``LOCAL_RANK``), else CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ReasonctlError(f"backend.device = {name!r} is not a device: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ReasonctlError(
                f"backend.device = {name!r} but CUDA is not available; use 'cpu' or 'auto'"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def run_device(config: RunConfig) -> torch.device:
    """The device of ``config.backend``, with the CPU thread count applied when it is the CPU
    (see :func:`use_cpu_threads`)."""
    device = resolve_device(config.backend.device)
    use_cpu_threads(device, config.backend.cpu_threads)
    return device


def use_cpu_threads(device: torch.device, threads: int | None) -> int:
    """Set torch's intra-op threads for work on ``device`` and return the count in use.

    On the CPU: ``threads`` (``backend.cpu_threads``) when set, else ``OMP_NUM_THREADS``
    when the user exported it (torch already read it), else :data:`DEFAULT_CPU_THREADS`.
    Other devices leave torch's setting alone.
    """
    if device.type == "cpu":
        if threads is None and not os.environ.get("OMP_NUM_THREADS", "").strip():
            threads = DEFAULT_CPU_THREADS
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
    return torch.get_num_threads()


@dataclass(frozen=True)
class ProcessGroupInfo:
    """This process's place in the default process group."""

    rank: int
    world_size: int
    created: bool
    """True when this call created the group (so the backend destroys it on close)."""


_launched_groups = 0
"""Default groups this process has created under a launcher (see :func:`init_process_group`)."""


def init_process_group(device: torch.device) -> ProcessGroupInfo:
    """Join the default process group: NCCL on CUDA, gloo on CPU.

    Under a launcher (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set: reasonctl's or torchrun)
    the group spans the launched processes; without it, a one-process group is created in memory so
    the FSDP backend also runs as a plain single process.

    A process may create the group again after a backend destroyed it (e.g. one backend
    after another in one job). The launcher's key-value store outlives the group and still
    holds the addresses and NCCL ids the earlier groups (default and sub-groups, whose
    names restart at 0) exchanged; a peer that reads one of those before its owner
    overwrites it connects to a closed socket ("Connection refused"). Every group after
    the first therefore rendezvouses under a fresh key prefix (every process creates its
    groups in the same order, so the prefixes agree).
    """
    global _launched_groups
    if dist.is_initialized():
        return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), created=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ReasonctlError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not; launch with "
                "`reasonctl run --nproc-per-node N` or torchrun"
            )
        if _launched_groups == 0:
            dist.init_process_group(backend=backend, device_id=device_id)
        else:
            store, rank, world_size = next(dist.rendezvous("env://"))
            store = dist.PrefixStore(f"reasonctl/group{_launched_groups}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank,
                                    world_size=world_size, device_id=device_id)
        _launched_groups += 1
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
    return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), created=True)


def mean_over_processes(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Scalar ``values`` averaged over every process of the job; a key ending in ``/max``
    takes the largest value of any process and one ending in ``/min`` the smallest (the
    mean of per-rank maxima is no maximum). For values that the ranks of a
    tensor/pipeline-parallel group share this is over data-parallel ranks. Every process
    must pass the same keys."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: float(v) for k, v in values.items()}
    out: dict[str, float] = {}
    for reduction, keys in _keys_by_reduction(values).items():
        tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                              device=device)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, reduction))
        if reduction == "SUM":
            tensor /= dist.get_world_size()
        out.update(zip(keys, tensor.tolist(), strict=True))
    return out


def _keys_by_reduction(values: dict[str, float]) -> dict[str, list[str]]:
    """Sorted keys of ``values`` per reduction (``SUM`` for a mean, ``MAX``, ``MIN``; the
    same on every process), empty ones left out so that no collective runs for nothing."""
    groups: dict[str, list[str]] = {"SUM": [], "MAX": [], "MIN": []}
    for key in sorted(values):
        reduction = "MAX" if key.endswith("/max") else "MIN" if key.endswith("/min") else "SUM"
        groups[reduction].append(key)
    return {reduction: keys for reduction, keys in groups.items() if keys}


def barrier_all() -> None:
    """Wait for every process of the job (no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: object) -> None:
    """Every rank's ``local`` stacked along dim 0 into ``output`` (``all_gather_single``
    where torch has it: torch 2.13 deprecates ``all_gather_into_tensor``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def reduce_scatter_into(output: torch.Tensor, stacked: torch.Tensor, group: object) -> None:
    """Sum over ranks of ``stacked`` (dim 0: one block per rank), this rank's block into
    ``output`` (``reduce_scatter_single`` where torch has it)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, stacked, group=group)
