"""The trainer's side of the ``reasonctl_gloo`` weight transfer.

:class:`GlooWeightSender` hosts the gloo group (rank 0) and drives vLLM's weight-update
protocol through a control plane: the HTTP endpoints of a server (:class:`.http.ServerClient`)
or an in-process ``LLM``'s methods. Per update it calls ``start_weight_update``, then for
each bucket ``update_weights`` with the bucket's layout (the workers then wait in the
matching broadcast, so the call runs on a helper thread while this side broadcasts), then
``finish_weight_update``. Only torch is needed here: a trainer talking to a remote server
does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from reasonctl.rollout.vllm import gloo


class WeightUpdateControl(Protocol):
    """vLLM's weight-update control plane (its HTTP routes or ``LLM`` methods)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Have every worker join the transfer (blocks until they have)."""
        ...

    def start_weight_update(self) -> None:
        """Begin an update."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one bucket (blocks until loaded)."""
        ...

    def finish_weight_update(self) -> None:
        """End the update."""
        ...


class GlooWeightSender:
    """Sends full weights to ``workers`` vLLM worker processes in packed buckets.

    ``host`` is this machine's address as the workers reach it; ``dtype`` (the engine's)
    is what floating tensors are cast to before sending, halving the bytes of float32
    trainer weights for a bfloat16 engine.
    """

    def __init__(self, control: WeightUpdateControl, *, host: str, workers: int,
                 timeout_s: float, bucket_bytes: int, dtype: torch.dtype | None) -> None:
        self.control = control
        self.host = host
        self.workers = workers
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.group: Any = None
        self.store: Any = None
        self.sent_bytes = 0

    def connect(self) -> None:
        """Open the group: host its store, have the workers join, join as rank 0."""
        world = self.workers + 1
        self.store, port = gloo.host_store(self.host, world_size=world,
                                           timeout_s=self.timeout_s)
        init_info = {"master_address": self.host, "master_port": port,
                     "world_size": world, "rank_offset": 1, "timeout_s": self.timeout_s}
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(self.control.init_weight_transfer_engine, init_info)
            try:
                self.group = gloo.open_group(self.host, port, rank=0, world_size=world,
                                             timeout_s=self.timeout_s, store=self.store)
            finally:
                joined.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One whole update: every tensor of ``named_tensors``, bucket by bucket."""
        if self.group is None:
            raise RuntimeError("GlooWeightSender.send before connect()")
        self.control.start_weight_update()
        self.sent_bytes = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            for bucket in gloo.buckets(named_tensors, bucket_bytes=self.bucket_bytes,
                                       dtype=self.dtype):
                layout = gloo.BucketLayout.from_tensors(bucket)
                buffer = gloo.pack(bucket, layout)
                loaded = pool.submit(self.control.update_weights, layout.as_dict())
                gloo.broadcast(self.group, buffer)
                loaded.result()
                self.sent_bytes += layout.nbytes
        self.control.finish_weight_update()

    def close(self) -> None:
        """Leave the group and close the store."""
        self.group = None
        self.store = None
