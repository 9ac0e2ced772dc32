"""Files waiting to be uploaded: ``<output_dir>/pending-uploads/<run id>/<n>/``.

Every path a run submits for upload is snapshotted there as hard links (no data copied)
next to a record, ``upload.json``, naming the targets it still has to reach. The run id
(UTC start time and a random suffix) makes the location unique to the run and never
reused, so no later run, pruning or resume deletes it. A snapshot is removed once every
target has it; what failed, was abandoned or was cut short by a crash stays, and
:func:`push_pending` (``reasonctl upload OUTPUT_DIR``) pushes it later.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.core.storage import describe_error, open_storage, remove_tree

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import Storage
    from reasonctl.core.registry import Registry

PENDING_DIR = "pending-uploads"
RECORD = "upload.json"


def new_run_id() -> str:
    """A name for this run's pending uploads that no other run uses."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"


@dataclass
class PendingRecord:
    """What one snapshot still has to reach.

    ``pending`` maps each target URI to the last error (``"pending"`` before any attempt);
    ``snapshot`` is the name of the hard-linked copy next to the record, or ``None`` when
    hard links were unavailable and ``source`` itself must be pushed.
    """

    source: str
    snapshot: str | None
    pending: dict[str, str] = field(default_factory=dict)

    def local(self, directory: Path) -> Path:
        """The files to push."""
        return directory / self.snapshot if self.snapshot else Path(self.source)

    def save(self, directory: Path) -> None:
        """Write the record into ``directory`` (replacing it atomically)."""
        tmp = directory / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(directory / RECORD)

    @classmethod
    def load(cls, directory: Path) -> PendingRecord:
        """Read the record in ``directory``."""
        data = json.loads((directory / RECORD).read_text())
        return cls(str(data["source"]), data.get("snapshot"), dict(data.get("pending", {})))


def find_pending(root: Path) -> list[Path]:
    """Directories holding a record under ``root`` (an output directory, its
    ``pending-uploads`` or one run's part of it), oldest first."""
    root = Path(root)
    base = root / PENDING_DIR if (root / PENDING_DIR).is_dir() else root
    return sorted(p.parent for p in base.rglob(RECORD))


def push_pending(
    registry: Registry,
    config: RunConfig | None,
    root: Path,
    *,
    push: Callable[[Storage, Path, str], None],
    log: Callable[[str], None],
) -> list[str]:
    """Push every pending snapshot under ``root`` to the targets it still misses.

    A snapshot that reaches all its targets is deleted; the records of the others are
    updated. Returns one line per upload still missing.
    """
    storages: dict[str, Storage] = {}
    missing: list[str] = []
    for directory in find_pending(root):
        record = PendingRecord.load(directory)
        local = record.local(directory)
        for uri in list(record.pending):
            if not local.exists():
                record.pending[uri] = f"{local} no longer exists"
                missing.append(f"{uri}: {record.pending[uri]}")
                continue
            try:
                if uri not in storages:
                    storages[uri] = open_storage(registry, uri, config)
                push(storages[uri], local, uri)
            except Exception as exc:
                record.pending[uri] = describe_error(exc)
                missing.append(f"{uri}: {record.pending[uri]} (local copy: {local})")
                log(f"upload failed: {uri}: {record.pending[uri]}")
                continue
            del record.pending[uri]
            log(f"uploaded {local} to {uri}")
        if record.pending:
            record.save(directory)
        else:
            remove_tree(directory)
            _remove_empty_parents(directory.parent, stop=Path(root))
    return missing


def _remove_empty_parents(directory: Path, *, stop: Path) -> None:
    """Remove ``directory`` and its parents while empty, up to ``pending-uploads``."""
    while directory.name and directory != stop and directory.is_dir() \
            and not any(directory.iterdir()):
        directory.rmdir()
        if directory.name == PENDING_DIR:
            break
        directory = directory.parent


__all__ = ["PENDING_DIR", "RECORD", "PendingRecord", "find_pending", "new_run_id",
           "push_pending"]
