"""Loading torch DCP checkpoints without running code from them, tensor shapes checked first.

torch's own reader unpickles the checkpoint's ``.metadata`` with :mod:`pickle` and its
default planner reads non-tensor values (the LR schedule's state) with
``torch.load(weights_only=False)``: a crafted checkpoint could run code on resume. Here
the metadata is unpickled by an unpickler that knows only DCP's metadata classes, torch
sizes and dtypes (:class:`SafeFileSystemReader`), and non-tensor values are read with
``weights_only=True`` (:class:`SafeLoadPlanner`). Before anything is read, the model's
tensors are compared with the checkpoint's, and every missing or differently shaped one is
named (:class:`~reasonctl.core.checkpoint.CheckpointMismatchError`).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from reasonctl.core.checkpoint_files import UnsafeCheckpointError
from reasonctl.core.errors import UsageError

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",
                     "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
            ("collections", "OrderedDict")}
MAX_LISTED = 20


class CheckpointMismatchError(UsageError):
    """The checkpoint's tensors do not fit the model built from the config."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata: its dataclasses, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """A DCP reader whose metadata cannot run code when unpickled."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, built only from DCP's own classes."""
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{path}: refusing to load it: {exc}. Checkpoints must come from a trusted "
                "place; this one may have been tampered with"
            ) from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} does not hold DCP checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor values only once ``torch.load(weights_only=True)`` accepts them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store a value read from the checkpoint after checking it is plain data.

        The weights-only load refuses any object other than tensors and plain containers
        and numbers; only then does torch's planner read the (now known-plain) bytes."""
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} holds objects other than "
                f"tensors and plain data: {exc}"
            ) from exc
        value.seek(0)
        super().load_bytes(read_item, value)


def load_state(state: dict[str, Any], directory: Path) -> None:
    """``dcp.load(state, directory)`` with the safe reader and planner, after checking that
    the tensors under ``state["model"]`` match the checkpoint's names and shapes."""
    reader = SafeFileSystemReader(str(directory))
    problems = model_mismatches(reader.read_metadata(), state.get("model", {}))
    if problems:
        listing = "\n".join(f"  - {line}" for line in problems[:MAX_LISTED])
        more = (f"\n  (and {len(problems) - MAX_LISTED} more)"
                if len(problems) > MAX_LISTED else "")
        raise CheckpointMismatchError(
            f"the checkpoint {Path(directory).parent} does not fit the model built from the "
            f"config ({len(problems)} tensor(s)):\n{listing}{more}\nResume with the model "
            "settings the checkpoint was written with, or start a new run in another "
            "run.output_dir"
        )
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
             no_dist=not dist.is_initialized())


def model_mismatches(metadata: Metadata, model_state: dict[str, Any]) -> list[str]:
    """``name: checkpoint [..], model [..]`` for each model tensor whose shape differs, and
    ``name: not in the checkpoint`` for each one it lacks."""
    saved = metadata.state_dict_metadata
    problems = []
    for name, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        entry = saved.get(f"model.{name}")
        if entry is None:
            problems.append(f"{name}: not in the checkpoint")
        elif isinstance(entry, TensorStorageMetadata) and \
                tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"{name}: checkpoint {list(entry.size)}, model "
                            f"{list(tensor.shape)}")
    return problems
