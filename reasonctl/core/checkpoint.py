"""Checkpoint directories: atomic writes, newest-complete lookup, keep-N pruning.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/`` holding the backend's distributed
state under ``state/``, per-rank RNG states and ``manifest.json`` (step, config hash,
algorithm state). It is written as ``.tmp-step_<N>`` and renamed only once complete, so a
crash never leaves a directory that looks complete. Directories without a manifest are
torn: they are skipped and reported.

A backend may write its state in the background (``checkpoint.async_save``): its
``write_state`` then returns a future once the state is staged in host memory, and
training goes on. The checkpoint is committed (manifest, rename, pruning, ``on_commit``)
by the main rank when the write has finished: polled after every step, and waited for
before the next checkpoint starts and when the run ends. At most one write is in flight.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path
    manifest: dict[str, Any]


class CheckpointWriteError(RuntimeError):
    """A checkpoint's state could not be written (earlier checkpoints are intact)."""


@dataclass
class _PendingCheckpoint:
    """A checkpoint whose state is being written in the background."""

    step: int
    tmp: Path
    future: Future[Any]
    manifest: dict[str, Any]
    on_commit: Callable[[Path], None] | None
    committed: bool = False
    """Committed by the main rank's :meth:`CheckpointManager.poll` already."""


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; only the main rank touches the layout."""

    def __init__(self, root: Path, *, keep: int, is_main: bool,
                 barrier: Callable[[], None] = lambda: None, rank: int = 0) -> None:
        self.root = Path(root)
        self.keep = keep
        self.is_main = is_main
        self.barrier = barrier
        self.rank = rank
        self.torn: list[Path] = []
        self.pending: _PendingCheckpoint | None = None
        """The checkpoint being written in the background, if any."""
        self.last_committed: Path | None = None
        """The newest checkpoint this manager committed (on every rank after :meth:`wait`)."""

    def step_dir(self, step: int) -> Path:
        """The final directory of the checkpoint at ``step``."""
        return self.root / f"step_{step}"

    def save(
        self,
        step: int,
        write_state: Callable[[Path], Future[Any] | None],
        manifest: dict[str, Any],
        *,
        on_commit: Callable[[Path], None] | None = None,
        before_state: Callable[[Path], None] | None = None,
    ) -> Path | None:
        """Write a checkpoint collectively (every rank calls it).

        ``before_state(tmp_directory)`` (optional) runs first on every rank, e.g. to export
        the model into the checkpoint; ``write_state(state_directory)`` is the backend's
        distributed save. When it returns ``None`` the state is on disk: the main rank
        writes the manifest, renames the directory and prunes old ones, calls
        ``on_commit(final_directory)``, and the final directory is returned. When it
        returns a future the write goes on in the background and ``None`` is returned;
        the checkpoint is committed by :meth:`poll` or :meth:`wait`. A write still in
        flight from an earlier call is waited for first.
        """
        self.wait()
        tmp = self.root / f".tmp-step_{step}"
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        if before_state is not None:
            before_state(tmp)
        save_rng_state(tmp / f"rng_rank{self.rank}.pt")
        future = write_state(tmp / "state")
        if future is not None:
            self.pending = _PendingCheckpoint(step, tmp, future, manifest, on_commit)
            return None
        self.barrier()
        if self.is_main:
            self._commit(step, tmp, manifest, on_commit)
        self.barrier()
        self.last_committed = self.step_dir(step)
        return self.last_committed

    def poll(self) -> None:
        """Commit the background write if it has finished well (main rank; not collective).

        A finished write on the main rank means every rank's state is on disk: the
        distributed save completes on the coordinating rank only after gathering every
        rank's write results. A failed write is left for :meth:`wait` to report on every
        rank."""
        pending = self.pending
        if (not self.is_main or pending is None or pending.committed
                or not pending.future.done() or pending.future.exception() is not None):
            return
        self._commit(pending.step, pending.tmp, pending.manifest, pending.on_commit)
        pending.committed = True

    def wait(self) -> None:
        """Wait for a background write and commit it if :meth:`poll` has not (collective:
        every rank holds a pending write from the same :meth:`save` until this call)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        error: CheckpointWriteError | None = None
        try:
            pending.future.result()
        except Exception as exc:
            error = CheckpointWriteError(
                f"writing the checkpoint of step {pending.step} to {pending.tmp} failed: "
                f"{type(exc).__name__}: {exc}. Earlier checkpoints are intact; check the "
                "disk (space, permissions) and resume from the newest complete one")
            error.__cause__ = exc
        self.barrier()
        if error is not None:
            raise error
        if self.is_main and not pending.committed:
            self._commit(pending.step, pending.tmp, pending.manifest, pending.on_commit)
        self.last_committed = self.step_dir(pending.step)
        self.barrier()

    def _commit(self, step: int, tmp: Path, manifest: dict[str, Any],
                on_commit: Callable[[Path], None] | None) -> Path:
        """Manifest, rename, prune and ``on_commit`` (main rank)."""
        final = self.step_dir(step)
        payload = {"step": step, "saved_at": time.time(), **manifest}
        (tmp / MANIFEST).write_text(json.dumps(payload, indent=2, default=str))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        self.last_committed = final
        if on_commit is not None:
            on_commit(final)
        return final

    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first; torn directories are recorded in ``torn``."""
        found: list[CheckpointInfo] = []
        self.torn = []
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            if child.name.startswith(".tmp-step_"):
                self.torn.append(child)
                continue
            match = STEP_DIR.match(child.name)
            if not match or not child.is_dir():
                continue
            manifest_path = child / MANIFEST
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                self.torn.append(child)
                continue
            found.append(CheckpointInfo(int(match.group(1)), child, manifest))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or ``None``."""
        complete = self.complete()
        return complete[-1] if complete else None

    def prune(self) -> None:
        """Delete the oldest complete checkpoints beyond ``keep``; never the newest."""
        complete = self.complete()
        for info in complete[: max(0, len(complete) - max(self.keep, 1))]:
            shutil.rmtree(info.path, ignore_errors=True)


def read_checkpoint(path: Path) -> CheckpointInfo:
    """Load a checkpoint directory given explicitly (``run.resume = "path"``)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); point run.resume at a "
            "checkpoints/step_<N> directory or set run.resume = true for the newest one"
        )
    manifest = json.loads(manifest_path.read_text())
    return CheckpointInfo(int(manifest["step"]), path, manifest)


def save_rng_state(path: Path) -> None:
    """Save Python, NumPy and torch (CPU and CUDA) random states of this rank."""
    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, path)


def load_rng_state(path: Path) -> bool:
    """Restore random states saved by :func:`save_rng_state`; False when the file is absent."""
    import numpy as np
    import torch

    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True
