"""Resumable training state with megatron's ``dist_checkpointing``.

The checkpoint holds the model chunks' sharded state dicts (``model``, or ``model0``,
``model1``... with virtual pipeline stages), the optimizer's sharded state and small
common values (the optimizer step count). Tensors are written as global tensors with the
``torch_dist`` format (torch DCP underneath), so a checkpoint loads with a different
number of processes and a different tp/pp split: the optimizer's float32 main weights and
Adam moments are saved per parameter, and a distributed optimizer's state
``fully_reshardable`` (gathered per parameter into that canonical layout) for the same
reason. megatron writes with helper processes started by ``multiprocessing`` "spawn", so
the main script must be import-safe (``if __name__ == "__main__":``), as the CLI is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(chunks: Sequence[torch.nn.Module], optimizer: Any, *, is_loading: bool
                   ) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if len(chunks) == 1:
        state["model"] = chunks[0].sharded_state_dict()
    else:
        for index, chunk in enumerate(chunks):
            state[f"model{index}"] = chunk.sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    return state


def save_state(directory: Path, chunks: Sequence[torch.nn.Module], optimizer: Any,
               common: dict[str, Any]) -> None:
    """Write model, optimizer and ``common`` values (all ranks call it)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state["common"] = dict(common)
    dist_checkpointing.save(state, str(directory))


def load_state(directory: Path, chunks: Sequence[torch.nn.Module], optimizer: Any
               ) -> dict[str, Any]:
    """Restore model and optimizer from :func:`save_state`; returns the ``common`` values."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint state directory {directory} does not exist")
    state = _sharded_state(chunks, optimizer, is_loading=True)
    state["common"] = {}
    loaded = dist_checkpointing.load(state, str(directory))
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{index}"])
    optimizer.load_state_dict(loaded["optimizer"])
    return dict(loaded.get("common") or {})
