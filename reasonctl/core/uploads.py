"""Background uploads of checkpoints and exports to the ``checkpoint.upload`` targets.

Each target URI gets :data:`WORKERS_PER_TARGET` threads, so training never waits for the
network, a slow target does not hold back the others, and the paths submitted at one step
(a checkpoint and the final export) upload in parallel. A failed upload is retried
(``checkpoint.upload_attempts``, with exponential backoff) unless the error is permanent
(no credentials, access denied, no such bucket): then it, and every later upload to that
target, fails at once with that reason. :meth:`Uploader.check_access` checks credentials
and targets before training. The end of the run waits at most ``checkpoint.upload_wait_s``
for pending uploads; a second signal stops the wait early. Uploads never delete or modify
local files.

Submitting a path first snapshots it as hard links (no data is copied) into a directory
unique to this run, ``<output_dir>/pending-uploads/<run id>/<n>/``, with a record of its
targets (:mod:`reasonctl.core.pending_uploads`): pruning old checkpoints
(``checkpoint.keep``) or a later run cannot remove files from under a pending upload. The
snapshot is removed once every target has the files; what failed stays there, is named in
the report, and ``reasonctl upload OUTPUT_DIR`` pushes it later. The upload of a checkpoint
directory (one holding ``manifest.json``) ends with a marker file, :data:`UPLOAD_MARKER`.
With ``run.resume = true`` and no local checkpoint,
:meth:`Uploader.pull_latest_checkpoint_if_missing` downloads the newest checkpoint that
carries it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.core.checkpoint import CheckpointManager
from reasonctl.core.errors import ReasonctlError, UsageError
from reasonctl.core.pending_uploads import PENDING_DIR, PendingRecord, new_run_id
from reasonctl.core.protocols import check_storage_access
from reasonctl.core.remote_checkpoints import UPLOAD_MARKER, pull_newest_checkpoint, push
from reasonctl.core.signals import SignalAbandon, StopRequest
from reasonctl.core.storage import (
    StorageError,
    describe_error,
    describe_local,
    is_permanent,
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

WORKERS_PER_TARGET = 2


class SourceGone(StorageError):
    """The local files of a pending upload no longer exist."""


@dataclass
class UploadJob:
    """One submitted path, shared by the workers of all targets."""

    relative: str
    local: Path
    source: Path
    directory: Path
    record: PendingRecord
    finished: set[str] = field(default_factory=set)
    """Targets that have the files."""
    failures: dict[str, UploadFailure] = field(default_factory=dict)


@dataclass
class UploadFailure:
    """An upload that did not complete."""

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
    ``attempts``, ``backoff_s`` and ``wait_s`` default to ``checkpoint.upload_attempts``,
    10 s and ``checkpoint.upload_wait_s``.
    """

    def __init__(
        self,
        registry: Registry,
        config: RunConfig,
        output_dir: Path,
        *,
        attempts: int | None = None,
        backoff_s: float = 10.0,
        wait_s: float | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.output_dir = Path(output_dir)
        self.targets = [t.rstrip("/") for t in config.checkpoint.upload]
        self.attempts = attempts or config.checkpoint.upload_attempts
        self.backoff_s = backoff_s
        self.wait_s = wait_s or config.checkpoint.upload_wait_s
        self.pending_root = self.output_dir / PENDING_DIR / new_run_id()
        self._log = log or _stderr
        self._storages: dict[str, Storage] = {
            target: open_storage(registry, target, config) for target in self.targets
        }
        self._queues: dict[str, queue.Queue[UploadJob | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._jobs: list[UploadJob] = []
        self._dead: dict[str, str] = {}
        """Targets that failed permanently, with the reason."""
        self._closed = False
        self._report: list[str] | None = None
        for target in self.targets:
            jobs: queue.Queue[UploadJob | None] = queue.Queue()
            self._queues[target] = jobs
            for index in range(WORKERS_PER_TARGET):
                thread = threading.Thread(
                    target=self._work, args=(target, jobs), daemon=True,
                    name=f"reasonctl-upload-{parse_uri(target)[0]}-{index}",
                )
                self._threads.append(thread)
                thread.start()

    def check_access(self) -> None:
        """Check every target's credentials and location before training.

        A permanent problem (no or wrong credentials, access denied, no such bucket) raises
        :class:`~reasonctl.core.errors.UsageError` (exit code 2); a temporary one (endpoint
        unreachable) is reported and the uploads retry later.
        """
        for target, storage in self._storages.items():
            try:
                check_storage_access(storage, target)
            except Exception as exc:
                if not is_permanent(exc):
                    self._log(f"warning: checkpoint.upload {target}: {describe_error(exc)}; "
                              "uploads will be retried during the run")
                    continue
                raise UsageError(f"checkpoint.upload: {describe_error(exc)}. Fix the "
                                 "credentials or the target, or remove it from "
                                 "checkpoint.upload; nothing was trained") from exc

    # --- submitting -----------------------------------------------------------------------

    def submit(self, local_path: Path, relative: str) -> None:
        """Queue ``local_path`` (file or directory) for ``<target>/<relative>`` on every target."""
        if self._report is not None:
            raise ReasonctlError("Uploader.submit() called after finish()")
        local_path = Path(local_path)
        if not local_path.exists():
            raise StorageError(f"cannot upload {local_path}: it does not exist")
        relative = relative.strip("/")
        with self._lock:
            directory = self.pending_root / f"{len(self._jobs) + 1:05d}"
        source, snapshot = self._snapshot(local_path, directory)
        record = PendingRecord(str(local_path), snapshot,
                               {join_uri(t, relative): "pending" for t in self.targets})
        record.save(directory)
        job = UploadJob(relative, local_path, source, directory, record)
        with self._lock:
            self._jobs.append(job)
        for jobs in self._queues.values():
            jobs.put(job)

    def pending(self) -> int:
        """Submitted paths not yet finished on every target."""
        with self._lock:
            return sum(1 for job in self._jobs if not self._settled(job))

    def _settled(self, job: UploadJob) -> bool:
        return len(job.finished) + len(job.failures) >= len(self.targets)

    def _snapshot(self, local: Path, directory: Path) -> tuple[Path, str | None]:
        """Hard-link ``local`` into ``directory``; fall back to ``local`` itself."""
        directory.mkdir(parents=True)
        if self.pending_root.resolve().is_relative_to(local.resolve()):
            return local, None
        dest = directory / local.name
        try:
            if local.is_file():
                os.link(local, dest)
            else:
                dest.mkdir()
                for path, rel in iter_files(local):
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, dest / rel)
        except OSError:  # no hard links here (other filesystem, FAT, ...): upload in place
            remove_tree(dest)
            return local, None
        return dest, local.name

    # --- workers --------------------------------------------------------------------------

    def _work(self, target: str, jobs: queue.Queue[UploadJob | None]) -> None:
        storage = self._storages[target]
        while (job := jobs.get()) is not None:
            if self._closed:
                return
            uri = join_uri(target, job.relative)
            attempts = 0

            def attempt(job: UploadJob = job, uri: str = uri) -> None:
                nonlocal attempts
                attempts += 1
                self._upload(storage, job, uri)

            started = time.monotonic()
            try:
                if target in self._dead:
                    raise StorageError(self._dead[target], permanent=True)
                retry(attempt, attempts=self.attempts, backoff_s=self.backoff_s,
                      what=f"upload of {job.local} to {uri}",
                      retryable=lambda exc: not is_permanent(exc))
            except Exception as exc:
                error = describe_error(exc)
                if is_permanent(exc):
                    self._dead.setdefault(target, error)
                failure = UploadFailure(uri, job.source, error, attempts)
                with self._lock:
                    job.failures[target] = failure
                if not self._closed:
                    self._log(f"upload failed: {failure.message()}")
            else:
                with self._lock:
                    job.finished.add(target)
                files, size = describe_local(job.source)
                self._log(f"uploaded {job.local} to {uri} ({files} file(s), "
                          f"{size / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s)")
            self._release(job)

    def _upload(self, storage: Storage, job: UploadJob, uri: str) -> None:
        if not job.source.exists():
            raise SourceGone(f"{job.local} was deleted locally before it could be uploaded",
                             permanent=True)
        push(storage, job.source, uri)

    def _release(self, job: UploadJob) -> None:
        """Drop the snapshot of a job every target has (unless the run is past waiting)."""
        with self._lock:
            done = not self._closed and len(job.finished) == len(self.targets)
        if done:
            remove_tree(job.directory)

    # --- end of run -----------------------------------------------------------------------

    def finish(self, stop: StopRequest | None = None) -> list[str]:
        """Wait for pending uploads, report failures on stderr and return them as lines.

        Waits at most ``wait_s``; under ``stop`` a second signal ends the wait. What is not
        uploaded by then is reported with the failures and stays in :attr:`pending_root`.
        Calling it again returns the same report.
        """
        if self._report is not None:
            return self._report
        for jobs in self._queues.values():
            for _ in range(WORKERS_PER_TARGET):
                jobs.put(None)
        cut_short = self._wait(stop)
        with self._lock:
            self._closed = True
            jobs_now = list(self._jobs)
        failures: list[UploadFailure] = []
        for job in jobs_now:
            for target in self.targets:
                if target in job.finished:
                    job.record.pending.pop(join_uri(target, job.relative), None)
                    continue
                failure = job.failures.get(target) or UploadFailure(
                    join_uri(target, job.relative), job.source, cut_short or "not uploaded", 0)
                job.record.pending[failure.uri] = failure.error
                failures.append(failure)
            if job.record.pending:
                job.record.save(job.directory)
            else:
                remove_tree(job.directory)
        for directory in (self.pending_root, self.pending_root.parent):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        self._report = [f.message() for f in failures]
        if failures:
            lines = [f"Upload report: {len(failures)} upload(s) did not complete; "
                     "missing remotely:"]
            lines += [f"  - {line}" for line in self._report]
            lines.append(f"The files are kept in {self.pending_root} (hard links: no extra "
                         "space while the originals exist). Push them with: reasonctl upload "
                         f"{self.output_dir} (or reasonctl export <local copy> --to <uri>)")
            self._log("\n".join(lines))
        return self._report

    def _wait(self, stop: StopRequest | None) -> str:
        """Join the workers until done or the deadline; why the wait was cut short, or ''."""
        count = self.pending()
        if not count:
            return ""
        self._log(f"waiting for {count} pending upload(s) to finish (at most "
                  f"{self.wait_s:g} s, checkpoint.upload_wait_s)...")
        deadline = time.monotonic() + self.wait_s
        phase = stop.phase("upload wait", f"the pending uploads (their files stay in "
                                          f"{self.pending_root})") if stop else nullcontext()
        try:
            with phase:
                for thread in self._threads:
                    while thread.is_alive():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return (f"not uploaded within checkpoint.upload_wait_s "
                                    f"({self.wait_s:g} s)")
                        thread.join(timeout=min(left, 0.5))
        except SignalAbandon as exc:
            return f"not uploaded: the wait was abandoned on {exc.signal_name}"
        return ""

    # --- resume ---------------------------------------------------------------------------

    def pull_latest_checkpoint_if_missing(self, checkpoints: CheckpointManager) -> Path | None:
        """With ``run.resume = true`` and no local checkpoint, download the newest uploaded
        one (:func:`~reasonctl.core.remote_checkpoints.pull_newest_checkpoint`)."""
        if self.config.run.resume is not True or checkpoints.latest() is not None:
            return None
        return pull_newest_checkpoint(self._storages, checkpoints, self._log)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["UPLOAD_MARKER", "UploadFailure", "Uploader", "push"]


def upload_access_problems(config: RunConfig, registry: Registry, *,
                           skip: Collection[int] = (),
                           log: Callable[[str], None] | None = None) -> list[str]:
    """``checkpoint.upload.N: ...`` for each target its storage refuses (``reasonctl config
    validate``): the storage's :class:`~reasonctl.core.protocols.ChecksAccess` check, as a
    run makes it before training, of every target but those in ``skip`` (indices already
    found malformed). A permanent refusal (credentials, access denied, no such bucket) or a
    missing optional package is a problem; a temporary one (an endpoint that does not
    answer) is logged as a warning, since a run would retry it."""
    from reasonctl.core.errors import MissingDependencyError

    problems = []
    for index, uri in enumerate(config.checkpoint.upload):
        if index in skip:
            continue
        target = uri.rstrip("/")
        try:
            check_storage_access(open_storage(registry, target, config), target)
        except Exception as exc:
            if isinstance(exc, MissingDependencyError) or is_permanent(exc):
                problems.append(f"checkpoint.upload.{index}: {describe_error(exc)}")
            else:
                (log or _stderr)(f"warning: checkpoint.upload.{index} {target}: "
                                 f"{describe_error(exc)}; a run retries its uploads")
    return problems
