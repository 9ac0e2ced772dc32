"""Local filesystem storage: ``file:///abs/path`` URIs and plain paths.

Files are copied to a temporary name next to the destination and renamed into place, so a
reader never sees a half-written file; a directory copied to a new destination appears
all at once. Sources are never modified or deleted. Registered for the ``file`` scheme
by :mod:`reasonctl.plugins.storage.local`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.storage import StorageError, iter_files, join_uri, parse_uri, remove_tree


class LocalStorageConfig(BaseModel):
    """``[storage.file]``: local and network filesystem copies."""

    model_config = ConfigDict(extra="forbid")

    fsync: bool = Field(
        default=False,
        description="Flush each copied file to disk before publishing it (network filesystems).",
    )


def local_path(uri: str) -> Path:
    """The filesystem path of a ``file://`` URI or plain path."""
    scheme, rest = parse_uri(uri)
    if scheme != "file":
        raise StorageError(f"{uri} is not a local path or file:// URI")
    return Path(rest).expanduser()


class LocalStorage:
    """Copies files and directory trees between local paths."""

    def __init__(self, config: LocalStorageConfig | None = None) -> None:
        self.config = config or LocalStorageConfig()

    def put_file(self, local: Path, uri: str) -> None:
        """Copy ``local`` to the path of ``uri`` atomically."""
        self._copy_file(Path(local), local_path(uri))

    def put_dir(self, local: Path, uri: str) -> None:
        """Copy the tree ``local`` under the path of ``uri`` (existing files are replaced)."""
        self._copy_tree(Path(local), local_path(uri))

    def get_file(self, uri: str, local: Path) -> Path:
        """Copy the file at ``uri`` to ``local``."""
        source = local_path(uri)
        if not source.is_file():
            raise StorageError(f"{uri}: no such file")
        self._copy_file(source, Path(local))
        return Path(local)

    def get_dir(self, uri: str, local: Path) -> Path:
        """Copy the directory at ``uri`` to ``local``."""
        source = local_path(uri)
        if not source.is_dir():
            raise StorageError(f"{uri}: no such directory")
        self._copy_tree(source, Path(local))
        return Path(local)

    def list(self, uri: str) -> list[str]:
        """Paths (in ``uri``'s style) of the files under ``uri``, sorted."""
        path = local_path(uri)
        if path.is_file():
            return [uri]
        if not path.is_dir():
            return []
        return [join_uri(uri, rel) for _, rel in iter_files(path)]

    def exists(self, uri: str) -> bool:
        """Whether a file or directory exists at ``uri``."""
        return local_path(uri).exists()

    def delete(self, uri: str) -> None:
        """Delete the file or directory tree at ``uri`` (nothing happens if absent)."""
        remove_tree(local_path(uri))

    # --- copying ------------------------------------------------------------------------

    def _copy_file(self, source: Path, dest: Path) -> None:
        if not source.is_file():
            raise StorageError(f"{source}: no such file to copy")
        if dest.exists() and dest.samefile(source):
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            shutil.copyfile(source, tmp)
            shutil.copystat(source, tmp)
            if self.config.fsync:
                _fsync(tmp)
            if tmp.stat().st_size != source.stat().st_size:
                raise StorageError(
                    f"copy of {source} to {dest} is incomplete (disk full?); free space and retry"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def _copy_tree(self, source: Path, dest: Path) -> None:
        if not source.is_dir():
            raise StorageError(f"{source}: no such directory to copy")
        if dest.exists() and dest.samefile(source):
            return
        if dest.resolve().is_relative_to(source.resolve()):
            raise StorageError(f"cannot copy {source} into itself ({dest})")
        if dest.exists():
            for path, rel in iter_files(source):
                self._copy_file(path, dest / rel)
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            for path, rel in iter_files(source):
                self._copy_file(path, tmp / rel)
            os.replace(tmp, dest)
        finally:
            remove_tree(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

