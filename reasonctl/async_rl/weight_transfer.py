"""Which weight-transfer mechanism carries a version from the trainer to the rollout
workers: ``rollout.workers.weight_sync = "file"`` (safetensors files,
:mod:`~reasonctl.async_rl.weight_sync`) or ``"broadcast"`` (a process group per rollout
replica, :mod:`~reasonctl.async_rl.broadcast_sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.async_rl.weight_sync import (
    FilePublisher,
    FileReceiver,
    WeightPublisher,
    WeightReceiver,
)

if TYPE_CHECKING:
    import torch

    from reasonctl.async_rl.transport import Transport


def publisher_for(mechanism: str, transport: Transport, *, device: torch.device,
                  wire_dtype: torch.dtype, directory: Path, address: str,
                  timeout_s: float) -> WeightPublisher:
    """The trainer's publisher of ``mechanism`` (``broadcast`` or ``file``)."""
    if mechanism == "file":
        return FilePublisher(transport, directory, wire_dtype)
    if mechanism == "broadcast":
        from reasonctl.async_rl.broadcast_sync import BroadcastPublisher

        return BroadcastPublisher(transport, device=device, wire_dtype=wire_dtype,
                                  address=address, timeout_s=timeout_s)
    raise ValueError(f"unknown weight sync mechanism {mechanism!r}; use broadcast or file")


def receiver_for(info: dict[str, str], transport: Transport, *, name: str,
                 device: torch.device, timeout_s: float) -> WeightReceiver:
    """A worker's receiver for the mechanism ``info`` announces."""
    mechanism = info.get("mechanism")
    if mechanism == "file":
        return FileReceiver(device)
    if mechanism == "broadcast":
        from reasonctl.async_rl.broadcast_sync import BroadcastReceiver

        return BroadcastReceiver(transport, name=name, device=device, timeout_s=timeout_s)
    raise RuntimeError(f"the trainer announced an unknown weight mechanism {mechanism!r}")
