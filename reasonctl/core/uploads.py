"""Background uploads of checkpoints and exports to the ``checkpoint.upload`` targets.

Each target URI gets one worker thread that uploads submitted paths in order, so training
never waits for the network and a slow target does not hold back the others. A failed
upload is retried with exponential backoff; what still failed is reported at the end of
the run with the local path to push again. Uploads never delete or modify local files.

Submitting a path first snapshots it as hard links under ``<output_dir>/.uploads/`` (no
data is copied), so pruning old checkpoints (``checkpoint.keep``) cannot remove files from
under a pending upload; the snapshot is removed once every target has the files. The upload
of a checkpoint directory (one holding ``manifest.json``) ends with a marker file,
:data:`UPLOAD_MARKER`. With ``run.resume = true`` and no local checkpoint,
:meth:`Uploader.pull_latest_checkpoint_if_missing` downloads the newest checkpoint that
carries it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.core.checkpoint import MANIFEST, CheckpointManager
from reasonctl.core.errors import ReasonctlError
from reasonctl.core.storage import (
    StorageError,
    describe_error,
    describe_local,
    iter_files,
    join_uri,
    open_storage,
    parse_uri,
    remove_tree,
    retry,
)

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import Storage
    from reasonctl.core.registry import Registry

UPLOAD_MARKER = ".upload-complete.json"
"""Written last into an uploaded checkpoint directory; its presence marks it complete."""
STAGING_DIR = ".uploads"
_REMOTE_STEP = re.compile(r"^step_(\d+)/(.+)$")


class SourceGone(StorageError):
    """The local files of a pending upload no longer exist."""


@dataclass
class UploadJob:
    """One submitted path, shared by the workers of all targets."""

    relative: str
    local: Path
    source: Path
    staging: Path | None
    remaining: int
    failed: bool = False


@dataclass
class UploadFailure:
    """An upload that did not complete after all attempts."""

    uri: str
    local: Path
    error: str
    attempts: int

    def message(self) -> str:
        """One line: what is missing where, why, and where the local copy is."""
        return (f"{self.uri}: {self.error} (after {self.attempts} attempt(s); "
                f"local copy: {self.local})")


class Uploader:
    """Uploads paths under the run's output directory to every ``checkpoint.upload`` URI.

    ``submit(path, relative)`` queues ``path`` for ``<target>/<relative>`` on each target and
    returns at once. ``finish()`` waits for pending uploads, prints a report of what is
    missing where (stderr) and returns it as lines. Storage plugins are built up front, so
    an unknown scheme or a missing optional dependency fails at the start of the run.
    """

    def __init__(
        self,
        registry: Registry,
        config: RunConfig,
        output_dir: Path,
        *,
        attempts: int = 3,
        backoff_s: float = 10.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.output_dir = Path(output_dir)
        self.targets = [t.rstrip("/") for t in config.checkpoint.upload]
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._log = log or _stderr
        self._storages: dict[str, Storage] = {
            target: open_storage(registry, target, config) for target in self.targets
        }
        self._queues: dict[str, queue.Queue[UploadJob | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._failures: list[tuple[UploadFailure, UploadJob]] = []
        self._pending = 0
        self._sequence = 0
        self._report: list[str] | None = None
        for target in self.targets:
            jobs: queue.Queue[UploadJob | None] = queue.Queue()
            thread = threading.Thread(
                target=self._work, args=(target, jobs), daemon=True,
                name=f"reasonctl-upload-{parse_uri(target)[0]}",
            )
            self._queues[target] = jobs
            self._threads.append(thread)
            thread.start()

    # --- submitting -----------------------------------------------------------------------

    def submit(self, local_path: Path, relative: str) -> None:
        """Queue ``local_path`` (file or directory) for ``<target>/<relative>`` on every target."""
        if self._report is not None:
            raise ReasonctlError("Uploader.submit() called after finish()")
        local_path = Path(local_path)
        if not local_path.exists():
            raise StorageError(f"cannot upload {local_path}: it does not exist")
        with self._lock:
            self._sequence += 1
            sequence = self._sequence
            self._pending += 1
        source, staging = self._snapshot(local_path, sequence)
        job = UploadJob(relative.strip("/"), local_path, source, staging, len(self.targets))
        for jobs in self._queues.values():
            jobs.put(job)

    def pending(self) -> int:
        """Submitted paths not yet finished on every target."""
        with self._lock:
            return self._pending

    def _snapshot(self, local: Path, sequence: int) -> tuple[Path, Path | None]:
        """Hard-link ``local`` into the staging area; fall back to ``local`` itself."""
        root = self.output_dir / STAGING_DIR
        if root.resolve().is_relative_to(local.resolve()):
            return local, None
        staging = root / f"{sequence:05d}"
        dest = staging / local.name
        try:
            if local.is_file():
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(local, dest)
            else:
                dest.mkdir(parents=True)
                for path, rel in iter_files(local):
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, dest / rel)
        except OSError:  # no hard links here (other filesystem, FAT, ...): upload in place
            remove_tree(staging)
            return local, None
        return dest, staging

    # --- workers --------------------------------------------------------------------------

    def _work(self, target: str, jobs: queue.Queue[UploadJob | None]) -> None:
        storage = self._storages[target]
        while (job := jobs.get()) is not None:
            uri = join_uri(target, job.relative)
            attempts = 0

            def attempt(job: UploadJob = job, uri: str = uri) -> None:
                nonlocal attempts
                attempts += 1
                self._upload(storage, job, uri)

            started = time.monotonic()
            try:
                retry(attempt, attempts=self.attempts, backoff_s=self.backoff_s,
                      what=f"upload of {job.local} to {uri}",
                      retryable=lambda exc: not isinstance(exc, SourceGone))
            except Exception as exc:
                failure = UploadFailure(uri, job.local, describe_error(exc), attempts)
                with self._lock:
                    job.failed = True
                    self._failures.append((failure, job))
                self._log(f"upload failed: {failure.message()}")
            else:
                files, size = describe_local(job.source)
                self._log(f"uploaded {job.local} to {uri} ({files} file(s), "
                          f"{size / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s)")
            finally:
                self._release(job)

    def _upload(self, storage: Storage, job: UploadJob, uri: str) -> None:
        if not job.source.exists():
            raise SourceGone(f"{job.local} was deleted locally before it could be uploaded")
        push(storage, job.source, uri)

    def _release(self, job: UploadJob) -> None:
        with self._lock:
            job.remaining -= 1
            done = job.remaining == 0
            if done:
                self._pending -= 1
        if done and job.staging is not None and not job.failed:
            remove_tree(job.staging)

    # --- end of run -----------------------------------------------------------------------

    def finish(self) -> list[str]:
        """Wait for pending uploads, report failures on stderr and return them as lines.

        Calling it again returns the same report.
        """
        if self._report is not None:
            return self._report
        if self.pending():
            self._log(f"waiting for {self.pending()} pending upload(s) to finish...")
        for jobs in self._queues.values():
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        for failure, job in self._failures:
            if job.staging is None:
                continue
            if job.local.exists():
                remove_tree(job.staging)
            else:  # pruned locally meanwhile: the snapshot is the copy left to push again
                failure.local = job.source
        staging_root = self.output_dir / STAGING_DIR
        if staging_root.is_dir() and not any(staging_root.iterdir()):
            staging_root.rmdir()
        self._report = [f.message() for f, _ in self._failures]
        if self._failures:
            lines = [f"Upload report: {len(self._failures)} upload(s) did not complete; "
                     "missing remotely:"]
            lines += [f"  - {line}" for line in self._report]
            lines.append("Local files were not deleted. Push again with: "
                         "reasonctl export <local copy> --to <uri>")
            self._log("\n".join(lines))
        return self._report

    # --- resume ---------------------------------------------------------------------------

    def pull_latest_checkpoint_if_missing(self, checkpoints: CheckpointManager) -> Path | None:
        """With ``run.resume = true`` and no local checkpoint, download the newest uploaded one.

        Looks under ``<target>/checkpoints/`` of every target for ``step_<N>`` directories
        holding both the manifest and :data:`UPLOAD_MARKER`, downloads the highest step into
        ``checkpoints/.tmp-step_<N>`` and renames it to ``step_<N>``. Returns the new
        directory, or ``None`` when nothing was pulled.
        """
        if self.config.run.resume is not True or checkpoints.latest() is not None:
            return None
        best: tuple[int, str] | None = None
        for target in self.targets:
            found = self._remote_checkpoints(target)
            if found and (best is None or max(found) > best[0]):
                best = (max(found), target)
        if best is None:
            self._log("run.resume: no local checkpoint and no complete uploaded checkpoint under "
                      f"{', '.join(join_uri(t, 'checkpoints') for t in self.targets)}; "
                      "starting from scratch")
            return None
        step, target = best
        uri = join_uri(target, f"checkpoints/step_{step}")
        tmp = checkpoints.root / f".tmp-step_{step}"
        remove_tree(tmp)
        checkpoints.root.mkdir(parents=True, exist_ok=True)
        self._log(f"run.resume: downloading checkpoint step {step} from {uri}")
        try:
            self._storages[target].get_dir(uri, tmp)
        except Exception as exc:
            remove_tree(tmp)
            raise StorageError(
                f"run.resume: could not download {uri}: {describe_error(exc)}. Fix access to "
                "the upload target, or set run.resume = false to start from scratch"
            ) from exc
        (tmp / UPLOAD_MARKER).unlink(missing_ok=True)
        final = checkpoints.step_dir(step)
        tmp.rename(final)
        self._log(f"run.resume: pulled checkpoint step {step} into {final}")
        return final

    def _remote_checkpoints(self, target: str) -> list[int]:
        """Steps of the complete checkpoints uploaded under ``target``."""
        base = join_uri(target, "checkpoints")
        try:
            uris = self._storages[target].list(base)
        except Exception as exc:
            raise StorageError(
                f"run.resume: could not list {base}: {describe_error(exc)}. Fix access to the "
                "upload target, or set run.resume = false to start from scratch"
            ) from exc
        files: dict[int, set[str]] = {}
        for uri in uris:
            if not uri.startswith(base + "/"):
                continue
            match = _REMOTE_STEP.match(uri[len(base) + 1:])
            if match:
                files.setdefault(int(match.group(1)), set()).add(match.group(2))
        complete = [s for s, names in files.items() if {MANIFEST, UPLOAD_MARKER} <= names]
        torn = sorted(set(files) - set(complete))
        if torn:
            self._log(f"run.resume: ignoring incomplete uploads under {base}: "
                      + ", ".join(f"step_{s}" for s in torn))
        return complete


def push(storage: Storage, local: Path, uri: str) -> None:
    """Upload a file or directory to ``uri``; a checkpoint directory gets its marker last.

    A checkpoint directory is one holding ``manifest.json``; :data:`UPLOAD_MARKER` is
    uploaded after all its files so a reader can tell a complete upload from a partial one.
    """
    local = Path(local)
    if local.is_file():
        storage.put_file(local, uri)
        return
    storage.put_dir(local, uri)
    if (local / MANIFEST).is_file():
        files, size = describe_local(local)
        with tempfile.TemporaryDirectory(prefix="reasonctl-upload-") as tmp:
            marker = Path(tmp) / UPLOAD_MARKER
            marker.write_text(json.dumps({"files": files, "bytes": size,
                                          "uploaded_at": time.time()}))
            storage.put_file(marker, join_uri(uri, UPLOAD_MARKER))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["UPLOAD_MARKER", "UploadFailure", "Uploader", "push"]
