"""The small files of a checkpoint: random states, the file list, and why a write failed.

Nothing read here runs code. Random states are saved as tensors, lists and numbers and read
back with ``torch.load(weights_only=True)``, which refuses anything else (a file crafted
to run code on load raises :class:`UnsafeCheckpointError`). Files written before this
format held NumPy arrays; those load too, with only NumPy's array reconstruction allowed.

The manifest lists every file of a checkpoint with its size, and the SHA-256 of the
small ones (the DCP ``.metadata`` pickle and the random states among them):
:func:`verify_files` checks them before anything is loaded, so a truncated download or a
swapped file is reported instead of deserialized.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
from pathlib import Path
from typing import Any

from reasonctl.core.errors import ReasonctlError

HASHED_MAX_BYTES = 16 * 1024 * 1024
"""Files up to this size get a SHA-256 in the manifest; larger ones (tensor shards) a size."""
_READ_BLOCK = 4 * 1024 * 1024


class UnsafeCheckpointError(ReasonctlError):
    """A checkpoint file holds something other than tensors and plain data."""


class CheckpointIntegrityError(ReasonctlError):
    """A checkpoint's files do not match the list its manifest recorded."""


# --- random states ------------------------------------------------------------------------


def save_rng_state(path: Path) -> None:
    """Save Python, NumPy and torch (CPU and CUDA) random states of this process."""
    import numpy as np
    import torch

    version, python_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, path)


def load_rng_state(path: Path) -> bool:
    """Restore random states saved by :func:`save_rng_state`; False when the file is absent.

    Raises :class:`UnsafeCheckpointError` when the file holds anything but tensors and
    plain data.
    """
    import numpy as np
    import torch

    if not path.is_file():
        return False
    state = load_plain(path)
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    else:  # written before random states were plain data: a tuple
        random.setstate(python)
    if isinstance(numpy_state, dict):
        np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32),
                             numpy_state["position"], numpy_state["has_gauss"],
                             numpy_state["cached_gaussian"]))
    else:
        np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def load_plain(path: Path) -> Any:
    """``torch.load`` of a file that may hold only tensors, plain data and NumPy arrays."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as exc:
        raise UnsafeCheckpointError(
            f"{path}: refusing to load it: it holds objects other than tensors and plain data "
            f"({_unpickling_reason(exc)}). Checkpoints must come from a trusted place; this "
            "one may have been tampered with. Resume from another checkpoint "
            "(run.resume = 'PATH')"
        ) from exc


def _unpickling_reason(exc: BaseException) -> str:
    """The line of torch's refusal that says what was found (not its generic advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "unsupported" in line.lower() or "blocked" in line.lower():
            return line[:300]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _numpy_array_globals() -> list[Any]:
    """What unpickling a NumPy array needs (reconstruction of arrays and dtypes, no code)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # NumPy >= 2
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    names = [np.ndarray, np.dtype, _reconstruct]
    names += [type(np.dtype(kind)) for kind in ("uint32", "int64", "float64")]
    return names


# --- file list ----------------------------------------------------------------------------


def file_list(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": n, "sha256": hex}}`` of every file under ``directory``
    (``sha256`` only for files up to :data:`HASHED_MAX_BYTES`)."""
    listing: dict[str, dict[str, Any]] = {}
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(dirpath) / name
            size = path.stat().st_size
            entry: dict[str, Any] = {"size": size}
            if size <= HASHED_MAX_BYTES:
                entry["sha256"] = _sha256(path)
            listing[path.relative_to(directory).as_posix()] = entry
    return dict(sorted(listing.items()))


def verify_files(directory: Path, listing: dict[str, dict[str, Any]] | None) -> list[str]:
    """Problems found comparing ``directory`` with the ``listing`` of its manifest.

    Files that appear after the manifest was written (an upload marker) are not checked.
    An empty list means every recorded file is present with its size and checksum.
    """
    if not listing:
        return []
    problems = []
    for name, entry in listing.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != entry.get("size"):
            problems.append(f"{name} has {size} bytes, the manifest recorded {entry.get('size')}")
        elif entry.get("sha256") and _sha256(path) != entry["sha256"]:
            problems.append(f"{name} does not match the SHA-256 the manifest recorded")
    return problems


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


# --- why a write failed -------------------------------------------------------------------


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "an input/output error (failing disk or network file system)",
}


def write_failure_reason(exc: BaseException) -> str:
    """A short reason for a failed checkpoint write, e.g. ``the disk is full (rank 1: ...)``.

    Understands torch's ``CheckpointException`` (a ``BaseException`` collecting each
    rank's error) as well as plain ``OSError`` and anything else.
    """
    causes = _rank_failures(exc)
    parts = []
    for rank, cause in causes:
        where = f"rank {rank}: " if rank is not None else ""
        parts.append(f"{where}{type(cause).__name__}: {_first_line(cause)}")
    errors = [cause for _, cause in causes]
    reason = next((_REASONS[e.errno] for e in _walk(errors) if isinstance(e, OSError)
                   and e.errno in _REASONS), None)
    detail = "; ".join(parts[:4]) + (f" (and {len(parts) - 4} more)" if len(parts) > 4 else "")
    return f"{reason} ({detail})" if reason else detail


def _rank_failures(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch is installed with reasonctl
        CheckpointException = ()  # type: ignore[assignment]
    if isinstance(exc, CheckpointException):
        found = []
        for rank, failure in sorted(exc.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            found.append((rank, cause))
        return found or [(None, exc)]
    return [(None, exc)]


def _walk(errors: list[BaseException]) -> list[BaseException]:
    """The errors and their causes and contexts."""
    out: list[BaseException] = []
    pending = list(errors)
    while pending:
        error = pending.pop(0)
        if error in out:
            continue
        out.append(error)
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else repr(exc)
