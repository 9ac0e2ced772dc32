"""Moving the trainer's weights to rollout workers: the mechanism interface and the file one.

The trainer's main process *stages* each new weight version once
(:meth:`WeightPublisher.stage`, fed by ``backend.full_state_dict()`` on every trainer rank)
and returns to training; workers fetch the newest staged version between prompt batches
(:meth:`WeightReceiver.fetch`), so a slow or dead worker never holds the trainer up.
Mechanisms (``rollout.workers.weight_sync``):

- ``broadcast`` (:mod:`reasonctl.async_rl.broadcast_sync`): a two-member process group per
  rollout replica, NCCL on CUDA and gloo on CPU, fed from a flat staging buffer;
- ``file`` (:class:`FilePublisher`): a safetensors file per version in a directory that
  both sides see (``/dev/shm`` on one node, a shared file system across nodes);
  :mod:`reasonctl.async_rl.weight_transfer` picks one.

Floating-point tensors travel in the rollout's compute dtype. Every version is stamped
with a :class:`~reasonctl.async_rl.messages.WeightVersion`, and staging reports its
milliseconds and bytes.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from reasonctl.async_rl.messages import WeightVersion

if TYPE_CHECKING:
    import torch

    from reasonctl.async_rl.transport import Transport


@dataclass(frozen=True)
class StageStats:
    """What staging one version cost."""

    milliseconds: float
    bytes: int


class WeightPublisher(Protocol):
    """The trainer's side (main process only)."""

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]],
              version: WeightVersion) -> StageStats:
        """Keep ``tensors`` as ``version`` and announce it in Redis."""
        ...

    def close(self) -> None:
        """Stop serving and release buffers."""
        ...


class WeightReceiver(Protocol):
    """A rollout worker's side."""

    def fetch(self, info: dict[str, str]) -> tuple[WeightVersion, list[tuple[str, torch.Tensor]]]:
        """The staged weights ``info`` (the Redis ``weights`` hash) announces."""
        ...

    def close(self) -> None:
        """Release process groups and buffers."""
        ...


# --- flat layout: many tensors as one buffer per dtype -----------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its dtype's flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class FlatLayout:
    """Tensors packed into one contiguous buffer per dtype, in a fixed order."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.sizes: dict[str, int] = {}
        for slot in slots:
            self.sizes[slot.dtype] = max(self.sizes.get(slot.dtype, 0), slot.offset + slot.numel)

    @classmethod
    def of(cls, tensors: list[tuple[str, torch.Tensor]]) -> FlatLayout:
        """The layout of ``tensors`` (already in their wire dtype)."""
        offsets: dict[str, int] = {}
        slots = []
        for name, tensor in tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            offset = offsets.get(dtype, 0)
            slots.append(Slot(name, dtype, tuple(tensor.shape), offset, tensor.numel()))
            offsets[dtype] = offset + tensor.numel()
        return cls(slots)

    def to_json(self) -> str:
        """The manifest published with each version."""
        return json.dumps([[s.name, s.dtype, list(s.shape), s.offset, s.numel]
                           for s in self.slots])

    @classmethod
    def from_json(cls, text: str) -> FlatLayout:
        """Inverse of :meth:`to_json`."""
        return cls([Slot(n, d, tuple(shape), int(o), int(k))
                    for n, d, shape, o, k in json.loads(text)])

    @property
    def digest(self) -> int:
        """A checksum of the manifest (both sides must agree on it)."""
        return zlib.crc32(self.to_json().encode())

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers."""
        import torch

        return sum(size * torch.empty((), dtype=getattr(torch, d)).element_size()
                   for d, size in self.sizes.items())

    def allocate(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Empty flat buffers on ``device``."""
        import torch

        return {d: torch.empty(size, dtype=getattr(torch, d), device=device)
                for d, size in self.sizes.items()}

    def views(self, buffers: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Each tensor as a view into ``buffers``."""
        return [(s.name, buffers[s.dtype][s.offset : s.offset + s.numel].view(s.shape))
                for s in self.slots]

    def fill(self, buffers: dict[str, torch.Tensor],
             tensors: Iterable[tuple[str, torch.Tensor]], wire_dtype: torch.dtype) -> None:
        """Copy ``tensors`` (in layout order) into ``buffers``, casting floats."""
        slots = iter(self.slots)
        for name, tensor in tensors:
            slot = next(slots, None)
            if slot is None or slot.name != name:
                raise RuntimeError(f"the trainer's weights changed layout at {name!r}; "
                                   "restart the workers")
            target = buffers[slot.dtype][slot.offset : slot.offset + slot.numel]
            target.copy_(as_wire(tensor, wire_dtype).reshape(-1))


def as_wire(tensor: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the dtype it travels in (floats in ``wire_dtype``)."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):  # a DTensor that the backend did not gather
        tensor = tensor.full_tensor()
    return tensor.to(wire_dtype) if tensor.is_floating_point() else tensor


def wire_nbytes(tensor: torch.Tensor, wire_dtype: torch.dtype) -> int:
    """Bytes ``tensor`` takes on the wire."""
    if not tensor.is_floating_point():
        return tensor.numel() * tensor.element_size()
    return tensor.numel() * wire_dtype.itemsize


def version_of(info: dict[str, str]) -> WeightVersion | None:
    """The staged version the ``weights`` hash announces (``None`` before the first)."""
    text = info.get("version")
    return WeightVersion.parse(text) if text else None


# --- the file mechanism --------------------------------------------------------------------------


class FilePublisher:
    """Writes each version as ``weights-<incarnation>-<step>.safetensors`` in ``directory``
    (renamed into place when complete); keeps the newest ``keep`` files."""

    mechanism = "file"

    def __init__(self, transport: Transport, directory: Path, wire_dtype: torch.dtype, *,
                 keep: int = 3) -> None:
        self.transport = transport
        self.directory = directory
        self.wire_dtype = wire_dtype
        self.keep = keep
        self.written: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]],
              version: WeightVersion) -> StageStats:
        """Write ``tensors`` to a new file and announce it."""
        from safetensors.torch import save_file

        started = time.perf_counter()
        state: dict[str, Any] = {}
        seen: set[int] = set()
        for name, tensor in tensors:
            wire = as_wire(tensor, self.wire_dtype).cpu()
            if wire.data_ptr() in seen:
                wire = wire.clone()  # tied weights: safetensors stores each name on its own
            seen.add(wire.data_ptr())
            state[name] = wire.contiguous()
        final = self.directory / f"weights-{version.incarnation}-{version.step}.safetensors"
        partial = final.with_suffix(".partial")
        save_file(state, str(partial))
        os.replace(partial, final)
        size = final.stat().st_size
        self.transport.set_weights({"mechanism": self.mechanism, "version": version.as_text(),
                                    "path": str(final), "bytes": str(size)})
        self.written.append(final)
        while len(self.written) > self.keep:  # a slow reader has its file open: unlink is safe
            self.written.pop(0).unlink(missing_ok=True)
        return StageStats((time.perf_counter() - started) * 1000, size)

    def close(self) -> None:
        """Nothing to release (files stay for a resumed run's workers until replaced)."""


class FileReceiver:
    """Loads the announced safetensors file onto ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fetch(self, info: dict[str, str]) -> tuple[WeightVersion, list[tuple[str, torch.Tensor]]]:
        """Read the file ``info["path"]`` names."""
        from safetensors.torch import load_file

        version = version_of(info)
        if version is None or info.get("mechanism") != "file":
            raise RuntimeError(f"no file weights announced (got {info})")
        path = info["path"]
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"weight file {path} is not readable here: weight_sync = 'file' needs "
                "rollout.workers.weight_dir on a file system the workers share")
        state = load_file(path, device=str(self.device))
        return version, list(state.items())

    def close(self) -> None:
        """Nothing to release."""


def weight_dir(configured: str | None, run_id: str, output_dir: Path) -> Path:
    """Where the file mechanism writes: the configured directory, else shared memory."""
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"reasonctl-{run_id}"
    return output_dir / "weights"

