"""Checkpoint directories: atomic writes, lineage, newest-complete lookup, keep-N pruning.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/`` holding the backend's distributed
state under ``state/``, per-rank random states (plain tensors, see
:mod:`reasonctl.core.checkpoint_files`) and ``manifest.json`` (step, lineage, the list of
files with sizes and checksums, config, algorithm state). It is written as
``.tmp-step_<N>`` and renamed only once complete, so a crash never leaves a directory that
looks complete. Directories without a manifest are torn: they are skipped and reported.

Lineage (:mod:`reasonctl.core.lineage`): each manifest names its parent, the checkpoint
written (or resumed from) before it in the same run. "Newest" means last written, and
pruning keeps the newest ``keep`` checkpoints of the current lineage, never the one just
written and never another branch's. :meth:`CheckpointManager.retire` moves the checkpoints
that are not ancestors of the resume point to ``retired-<time>/`` at the start of a run.

Every step of a write that can fail (the directory, an export into it, random states, the
backend's state, the commit) is followed by an agreement between all processes
(``agree(ok) -> all ok``): a failure on any rank, even a ``BaseException`` such as torch's
``CheckpointException``, becomes :class:`CheckpointWriteError` on every rank, and no rank
is left waiting in a collective the others abandoned.

A backend may write its state in the background (``checkpoint.async_save``): its
``write_state`` then returns a future once the state is staged in host memory, and
training goes on. The checkpoint is committed (manifest, rename, pruning, ``on_commit``)
by the main rank when the write has finished: polled after every step, and waited for
before the next checkpoint starts and when the run ends. At most one write is in flight.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from reasonctl.core.checkpoint_files import (
    file_list,
    load_rng_state,
    save_rng_state,
    write_failure_reason,
)
from reasonctl.core.errors import ReasonctlError
from reasonctl.core.lineage import ancestors, lineage_of, next_serial, write_order
from reasonctl.core.signals import SignalAbandon

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
RETIRED_PREFIX = "retired-"
T = TypeVar("T")


@dataclass
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str | None:
        """The checkpoint's lineage id (``None`` for one written before lineages)."""
        record = lineage_of(self)
        return record.get("id") if record else None


class CheckpointWriteError(ReasonctlError, RuntimeError):
    """A checkpoint could not be written (earlier checkpoints are intact)."""


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
    commit_error: BaseException | None = None
    """Why :meth:`CheckpointManager.poll` could not commit it (reported by ``wait``)."""


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; only the main rank touches the layout.

    ``agree(ok)`` returns whether every process passed ``ok = True`` (collective; the
    default suits one process); ``barrier`` waits for every process.
    """

    def __init__(self, root: Path, *, keep: int, is_main: bool,
                 barrier: Callable[[], None] = lambda: None, rank: int = 0,
                 agree: Callable[[bool], bool] = lambda ok: ok) -> None:
        self.root = Path(root)
        self.keep = keep
        self.is_main = is_main
        self.barrier = barrier
        self.agree = agree
        self.rank = rank
        self.torn: list[Path] = []
        self.pending: _PendingCheckpoint | None = None
        """The checkpoint being written in the background, if any."""
        self.last_committed: Path | None = None
        """The newest checkpoint this manager committed (on every rank after :meth:`wait`)."""
        self.head_id: str | None = None
        """Lineage id of the parent of the next checkpoint (main rank): the last one
        committed, or the one the run resumed from (:meth:`begin`)."""
        self.head_step: int | None = None
        """Step of that parent."""

    def step_dir(self, step: int) -> Path:
        """The final directory of the checkpoint at ``step``."""
        return self.root / f"step_{step}"

    # --- lineage ----------------------------------------------------------------------------

    def begin(self, resumed: CheckpointInfo | None) -> None:
        """Start the lineage of this run at ``resumed`` (``None``: a fresh start)."""
        self.head_id = resumed.id if resumed is not None else None
        self.head_step = resumed.step if resumed is not None else None

    def retire(self, resumed: CheckpointInfo | None) -> tuple[Path, list[str]] | None:
        """Move every complete checkpoint that is not ``resumed`` or one of its ancestors to
        ``retired-<UTC time>/`` under the root (main rank). Returns where and which, or
        ``None`` when nothing was moved. Retired checkpoints are never resumed or pruned."""
        if not self.is_main:
            return None
        found = self.complete()
        keep: set[Path] = set()
        if resumed is not None:
            here = next((c for c in found if _same(c.path, resumed.path)), None)
            if here is not None:
                keep = {c.path for c in ancestors(here, found)}
        abandoned = [c for c in found if c.path not in keep]
        if not abandoned:
            return None
        target = self._retired_dir()
        for info in abandoned:
            info.path.rename(target / info.path.name)
        return target, [c.path.name for c in abandoned]

    def _retired_dir(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.root / f"{RETIRED_PREFIX}{stamp}"
        suffix = 1
        while target.exists():
            suffix += 1
            target = self.root / f"{RETIRED_PREFIX}{stamp}-{suffix}"
        target.mkdir(parents=True)
        return target

    # --- writing ----------------------------------------------------------------------------

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
        flight from an earlier call is waited for first. Any failure raises
        :class:`CheckpointWriteError` on every rank.
        """
        self.wait()
        tmp = self.root / f".tmp-step_{step}"
        self._step(step, tmp, lambda: self._make_tmp(tmp) if self.is_main else None)
        if before_state is not None:
            self._step(step, tmp, lambda: before_state(tmp))
        self._step(step, tmp, lambda: save_rng_state(tmp / f"rng_rank{self.rank}.pt"))
        future = self._step(step, tmp, lambda: write_state(tmp / "state"))
        if future is not None:
            self.pending = _PendingCheckpoint(step, tmp, future, manifest, on_commit)
            return None
        self._step(step, tmp, lambda: self._commit(step, tmp, manifest, on_commit)
                   if self.is_main else None)
        self.last_committed = self.step_dir(step)
        return self.last_committed

    def poll(self) -> None:
        """Commit the background write if it has finished well (main rank; not collective).

        A finished write on the main rank means every rank's state is on disk: the
        distributed save completes on the coordinating rank only after gathering every
        rank's write results. A failed write or commit is left for :meth:`wait` to report
        on every rank."""
        pending = self.pending
        if (not self.is_main or pending is None or pending.committed
                or pending.commit_error is not None or not pending.future.done()
                or pending.future.exception() is not None):
            return
        try:
            self._commit(pending.step, pending.tmp, pending.manifest, pending.on_commit)
            pending.committed = True
        except (KeyboardInterrupt, SystemExit, SignalAbandon):
            raise
        except BaseException as exc:
            pending.commit_error = exc

    def wait(self) -> None:
        """Wait for a background write and commit it if :meth:`poll` has not (collective:
        every rank holds a pending write from the same :meth:`save` until this call)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return

        def finish() -> None:
            pending.future.result()
            if pending.commit_error is not None:
                raise pending.commit_error
            if self.is_main and not pending.committed:
                self._commit(pending.step, pending.tmp, pending.manifest, pending.on_commit)

        self._step(pending.step, pending.tmp, finish)
        self.last_committed = self.step_dir(pending.step)

    def _step(self, step: int, tmp: Path, action: Callable[[], T]) -> T:
        """Run one part of a checkpoint write, then agree with every process that it worked."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = action()
        except (KeyboardInterrupt, SystemExit, SignalAbandon):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            error = exc
        if self.agree(error is None):
            return result
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a partial write took
        newest = self.latest()
        intact = (f"the newest complete checkpoint is {newest.path}" if newest is not None
                  else "no earlier checkpoint exists")
        reason = (write_failure_reason(error) if error is not None
                  else "another process failed (its own message names the reason)")
        message = (f"could not write the checkpoint of step {step} ({self.step_dir(step)}): "
                   f"{reason}. Earlier checkpoints are intact ({intact}); free disk space or "
                   "fix permissions, then resume with --resume")
        raise CheckpointWriteError(message) from error

    def _make_tmp(self, tmp: Path) -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def _commit(self, step: int, tmp: Path, manifest: dict[str, Any],
                on_commit: Callable[[Path], None] | None) -> Path:
        """Manifest, rename, prune and ``on_commit`` (main rank)."""
        final = self.step_dir(step)
        found = self.complete()
        checkpoint_id = uuid.uuid4().hex
        payload = {
            "step": step, "saved_at": time.time(),
            "lineage": {"id": checkpoint_id, "parent": self.head_id,
                        "parent_step": self.head_step, "serial": next_serial(found)},
            "files": file_list(tmp),
            **manifest,
        }
        (tmp / MANIFEST).write_text(json.dumps(payload, indent=2, default=str))
        if (final / MANIFEST).is_file():  # a complete checkpoint of another branch
            final.rename(self._retired_dir() / final.name)
        elif final.exists():  # torn
            shutil.rmtree(final)
        tmp.rename(final)
        self.head_id, self.head_step = checkpoint_id, step
        self.last_committed = final
        self.prune()
        if on_commit is not None:
            on_commit(final)
        return final

    # --- finding ----------------------------------------------------------------------------

    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints in write order; torn directories are recorded in ``torn``."""
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
        return sorted(found, key=write_order)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint written last, or ``None``."""
        complete = self.complete()
        return complete[-1] if complete else None

    def prune(self) -> None:
        """Delete the ancestors of the newest checkpoint beyond the newest ``keep`` of its
        lineage; never the newest one, never a checkpoint of another lineage."""
        complete = self.complete()
        if not complete:
            return
        head = next((c for c in complete if c.id is not None and c.id == self.head_id),
                    complete[-1])
        for info in ancestors(head, complete)[max(self.keep, 1):]:
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


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


__all__ = [
    "MANIFEST",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWriteError",
    "load_rng_state",
    "read_checkpoint",
    "save_rng_state",
]
