"""Checkpoints in upload targets: pushing one with its completion marker, pulling the newest.

A checkpoint directory (one holding ``manifest.json``) is pushed with :func:`push`, which
uploads :data:`UPLOAD_MARKER` after all its files, so a reader can tell a complete upload
from a partial one. :func:`pull_newest_checkpoint` downloads the newest complete one into a
local checkpoints directory (``run.resume = true`` with no local checkpoint). A pulled
checkpoint is loaded like a local one: its files are checked against its manifest and
nothing in it is unpickled beyond tensors and plain data.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.core.checkpoint import MANIFEST, CheckpointManager
from reasonctl.core.storage import (
    StorageError,
    describe_error,
    describe_local,
    join_uri,
    remove_tree,
)

if TYPE_CHECKING:
    from reasonctl.core.protocols import Storage

UPLOAD_MARKER = ".upload-complete.json"
"""Written last into an uploaded checkpoint directory; its presence marks it complete."""
_REMOTE_STEP = re.compile(r"^step_(\d+)/(.+)$")


def push(storage: Storage, local: Path, uri: str) -> None:
    """Upload a file or directory to ``uri``; a checkpoint directory gets its marker last."""
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


def pull_newest_checkpoint(storages: dict[str, Storage], checkpoints: CheckpointManager,
                           log: Callable[[str], None]) -> Path | None:
    """Download the newest complete checkpoint uploaded under any target's ``checkpoints/``.

    Looks for ``step_<N>`` directories holding both the manifest and
    :data:`UPLOAD_MARKER`, downloads the highest step into ``checkpoints/.tmp-step_<N>`` and
    renames it to ``step_<N>``. Returns the new directory, or ``None`` when nothing was
    pulled.
    """
    best: tuple[int, str] | None = None
    for target, storage in storages.items():
        found = _remote_checkpoints(storage, target, log)
        if found and (best is None or max(found) > best[0]):
            best = (max(found), target)
    if best is None:
        log("run.resume: no local checkpoint and no complete uploaded checkpoint under "
            f"{', '.join(join_uri(t, 'checkpoints') for t in storages)}; starting from scratch")
        return None
    step, target = best
    uri = join_uri(target, f"checkpoints/step_{step}")
    tmp = checkpoints.root / f".tmp-step_{step}"
    remove_tree(tmp)
    checkpoints.root.mkdir(parents=True, exist_ok=True)
    log(f"run.resume: downloading checkpoint step {step} from {uri}")
    try:
        storages[target].get_dir(uri, tmp)
    except Exception as exc:
        remove_tree(tmp)
        raise StorageError(
            f"run.resume: could not download {uri}: {describe_error(exc)}. Fix access to "
            "the upload target, or set run.resume = false to start from scratch"
        ) from exc
    (tmp / UPLOAD_MARKER).unlink(missing_ok=True)
    final = checkpoints.step_dir(step)
    tmp.rename(final)
    log(f"run.resume: pulled checkpoint step {step} into {final}")
    return final


def _remote_checkpoints(storage: Storage, target: str, log: Callable[[str], None]) -> list[int]:
    """Steps of the complete checkpoints uploaded under ``target``."""
    base = join_uri(target, "checkpoints")
    try:
        uris = storage.list(base)
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
        log(f"run.resume: ignoring incomplete uploads under {base}: "
            + ", ".join(f"step_{s}" for s in torn))
    return complete


__all__ = ["UPLOAD_MARKER", "pull_newest_checkpoint", "push"]
