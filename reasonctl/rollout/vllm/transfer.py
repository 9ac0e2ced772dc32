"""reasonctl's weight-transfer backends for vLLM's native RL weight-update protocol.

vLLM (0.32) updates weights in a running engine through a four-step protocol on its
workers: ``init_weight_transfer_engine`` (once), then per update ``start_weight_update``,
``update_weights`` (one or more chunks) and ``finish_weight_update``; the backend that
moves the bytes is pluggable. This module registers two backends with vLLM's
``WeightTransferEngineFactory``:

- ``reasonctl_inprocess``: the worker runs in the trainer's own process (colocated
  engine, one worker). The trainer stages its ``(name, tensor)`` iterator under a ticket
  (:func:`stage`) and the worker loads the tensors straight from it: no copy beyond the
  load itself, no serialisation.
- ``reasonctl_gloo``: worker processes (a server, or tensor-parallel workers) receive
  packed buckets over a gloo group the trainer hosts (:mod:`.gloo`); each
  ``update_weights`` call carries one bucket's layout.

Both load through the model's ``load_weights`` inside vLLM's layerwise-reload lifecycle
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), as vLLM's own NCCL
backend does, so fused projections and post-load processing are handled by vLLM.

:func:`register_backends` is also the ``vllm.general_plugins`` entry point of the
``reasonctl`` distribution: vLLM calls it in every one of its processes (API server,
engine core, workers), so a server started anywhere with reasonctl installed knows the
backends. It registers names only.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from reasonctl.rollout.vllm import gloo
from reasonctl.rollout.vllm.config import GLOO_BACKEND, INPROCESS_BACKEND

_staged: dict[str, Iterable[tuple[str, torch.Tensor]]] = {}
_staged_lock = threading.Lock()


def stage(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hand ``named_tensors`` to an in-process worker; returns the ticket to send."""
    ticket = uuid.uuid4().hex
    with _staged_lock:
        _staged[ticket] = named_tensors
    return ticket


def unstage(ticket: str) -> None:
    """Drop a ticket that was not consumed (the update failed before loading)."""
    with _staged_lock:
        _staged.pop(ticket, None)


def register_backends() -> None:
    """Register both backends with vLLM (idempotent; the ``vllm.general_plugins`` hook)."""
    for name, cls_name in ((INPROCESS_BACKEND, "InProcessWeightTransferEngine"),
                           (GLOO_BACKEND, "GlooWeightTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, __name__, cls_name)
        except ValueError:  # registered already in this process
            pass


@dataclass
class InProcessInit(WeightTransferInitInfo):
    """``reasonctl_inprocess`` init info: the trainer's process id."""

    pid: int


@dataclass
class InProcessUpdate(WeightTransferUpdateInfo):
    """``reasonctl_inprocess`` update info: the ticket of the staged tensors."""

    ticket: str


@dataclass
class GlooInit(WeightTransferInitInfo):
    """``reasonctl_gloo`` init info: the trainer's store and the group's size."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 1800.0


@dataclass
class GlooUpdate(WeightTransferUpdateInfo):
    """``reasonctl_gloo`` update info: one bucket's layout (:class:`.gloo.BucketLayout`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class _Layerwise(WeightTransferEngine):  # type: ignore[type-arg]
    """Loads checkpoint-format weights inside vLLM's layerwise-reload lifecycle."""

    def start_weight_update(self) -> None:
        """Prepare every layer to take checkpoint-format weights."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Process what was loaded (layers loaded in full are processed already)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Not used: the trainer side is :class:`~.sender.GlooWeightSender` or
        :func:`stage` (defined because some vLLM releases declare it abstract)."""
        raise NotImplementedError("reasonctl sends weights with GlooWeightSender / stage()")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one chunk (waits for the device on CUDA only)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class InProcessWeightTransferEngine(_Layerwise):
    """Loads the tensors the trainer staged in this same process."""

    init_info_cls = InProcessInit
    update_info_cls = InProcessUpdate

    def init_transfer_engine(self, init_info: InProcessInit) -> None:
        """Check that the worker really shares the trainer's process."""
        if init_info.pid != os.getpid():
            raise RuntimeError(
                f"the {INPROCESS_BACKEND} weight transfer needs the vLLM worker in the "
                f"trainer's process (trainer pid {init_info.pid}, worker pid "
                f"{os.getpid()}); use the {GLOO_BACKEND} backend for worker processes"
            )

    def receive_weights(self, update_info: InProcessUpdate) -> None:
        """Load the staged tensors into the model."""
        with _staged_lock:
            named = _staged.pop(update_info.ticket, None)
        if named is None:
            raise RuntimeError(f"no weights staged under ticket {update_info.ticket!r}")
        self.model.load_weights(named)

    def shutdown(self) -> None:
        """Nothing to release."""


class GlooWeightTransferEngine(_Layerwise):
    """Receives packed buckets from the trainer (rank 0) over a gloo group."""

    init_info_cls = GlooInit
    update_info_cls = GlooUpdate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInit) -> None:
        """Join the trainer's group as rank ``rank_offset`` + this worker's global rank."""
        parallel = self.parallel_config
        rank = (parallel.data_parallel_index * parallel.world_size + parallel.rank
                + init_info.rank_offset)
        self.group = gloo.open_group(
            init_info.master_address, init_info.master_port, rank=rank,
            world_size=init_info.world_size, timeout_s=init_info.timeout_s,
        )

    def receive_weights(self, update_info: GlooUpdate) -> None:
        """Receive one bucket and load its tensors."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call "
                               "init_weight_transfer_engine first")
        layout = gloo.BucketLayout(update_info.names, update_info.dtypes, update_info.shapes)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        gloo.broadcast(self.group, buffer)
        self.model.load_weights(gloo.unpack(buffer, layout))

    def shutdown(self) -> None:
        """Leave the group."""
        self.group = None
