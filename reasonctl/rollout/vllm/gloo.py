"""Weights over a gloo group: the transport between the trainer and vLLM worker processes.

The trainer is rank 0 of a small process group of its own (a ``TCPStore`` it hosts plus a
``ProcessGroupGloo``, created without touching ``torch.distributed``'s default group, so a
run's own process group is unaffected); every vLLM worker joins as rank 1, 2, ...
Tensors travel in buckets: each bucket is one byte buffer holding its tensors back to back
(each start aligned to :data:`ALIGN` bytes), sent with one broadcast and cut apart on the
receiving side from the bucket's :class:`BucketLayout`. Gloo moves host memory, so CUDA
tensors are staged through the host; it works wherever TCP does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

ALIGN = 64
"""Byte alignment of each tensor in a bucket (any dtype can be viewed from there)."""

STORE_PREFIX = "reasonctl-weights"


@dataclass
class BucketLayout:
    """What one bucket holds, in order: names, dtype names (``torch.<name>``) and shapes.

    Sent as JSON ahead of the bytes, so the receiver can allocate and cut the buffer.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (an ``update_info`` of the weight-transfer protocol)."""
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}

    @classmethod
    def from_tensors(cls, named: list[tuple[str, torch.Tensor]]) -> BucketLayout:
        """The layout of ``named`` tensors."""
        return cls([n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                   [list(t.shape) for _, t in named])

    def spans(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of each tensor in the bucket's buffer."""
        out, offset = [], 0
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
            out.append((offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return out

    @property
    def nbytes(self) -> int:
        """Size of the bucket's buffer."""
        spans = self.spans()
        return -(-(spans[-1][0] + spans[-1][1]) // ALIGN) * ALIGN if spans else 0


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def open_group(host: str, port: int, *, rank: int, world_size: int, timeout_s: float,
               store: Any = None) -> Any:
    """Join (rank 0: host) the weight group; ``store`` is rank 0's already open store."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0,
                                           timeout=timeout, wait_for_workers=False)
    prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(prefixed, rank, world_size, timeout)


def host_store(host: str, *, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's store on a free port of ``host``: ``(store, port)``."""
    store = torch.distributed.TCPStore(host, 0, world_size, is_master=True,
                                       timeout=timedelta(seconds=timeout_s),
                                       wait_for_workers=False)
    return store, int(store.port)


def broadcast(group: Any, buffer: torch.Tensor) -> None:
    """Broadcast ``buffer`` (CPU) from rank 0 to every rank of ``group``, in place."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([buffer], options).wait()


def pack(named: list[tuple[str, torch.Tensor]], layout: BucketLayout) -> torch.Tensor:
    """The bucket's byte buffer (on the host) holding ``named`` at ``layout``'s spans."""
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for (_, tensor), (offset, nbytes) in zip(named, layout.spans(), strict=True):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + nbytes].copy_(flat)
    return buffer


def unpack(buffer: torch.Tensor, layout: BucketLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a received bucket (views of ``buffer``)."""
    for name, dtype, shape, (offset, nbytes) in zip(
        layout.names, layout.dtypes, layout.shapes, layout.spans(), strict=True
    ):
        yield name, buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int,
            dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``named_tensors`` into lists of about ``bucket_bytes`` (a larger tensor is a
    bucket of its own), each tensor on the host and, when ``dtype`` is given, cast to it
    (floating tensors only). Consumes the input in order, one tensor at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.detach().to("cpu")
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
