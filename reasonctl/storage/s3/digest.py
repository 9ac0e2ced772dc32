"""What S3 computes for an uploaded file: its size, sha256 and ETag, hashed in one pass.

The ETag of a single-part upload is the MD5 of the content; that of a multipart upload is
the MD5 of the part MD5s followed by ``-<parts>``, with parts sized as boto3's transfer
manager sizes them (``s3transfer``'s ``ChunksizeAdjuster``, imported when a multipart
digest is computed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from reasonctl.storage.s3.config import MIB

READ_BLOCK = 8 * MIB


@dataclass(frozen=True)
class FileDigest:
    """Size, sha256 and the ETag S3 computes for a file uploaded with our part size."""

    size: int
    sha256: str
    etag: str


def file_digest(path: Path, part_size: int, multipart_threshold: int) -> FileDigest:
    """Hash ``path`` once: its sha256 and the ETag an upload with these settings yields."""
    size = path.stat().st_size
    multipart = size >= multipart_threshold
    chunk = _part_size(part_size, size) if multipart else size
    sha = hashlib.sha256()
    part = hashlib.md5(usedforsecurity=False)
    part_digests: list[bytes] = []
    filled = 0
    with open(path, "rb") as handle:
        while block := handle.read(READ_BLOCK):
            sha.update(block)
            view = memoryview(block)
            while view:
                take = len(view) if not multipart else min(len(view), chunk - filled)
                part.update(view[:take])
                filled += take
                view = view[take:]
                if multipart and filled == chunk:
                    part_digests.append(part.digest())
                    part, filled = hashlib.md5(usedforsecurity=False), 0
    if not multipart:
        return FileDigest(size, sha.hexdigest(), part.hexdigest())
    if filled:
        part_digests.append(part.digest())
    combined = hashlib.md5(b"".join(part_digests), usedforsecurity=False).hexdigest()
    return FileDigest(size, sha.hexdigest(), f"{combined}-{len(part_digests)}")


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's content."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(READ_BLOCK):
            sha.update(block)
    return sha.hexdigest()


def _part_size(part_size: int, size: int) -> int:
    """The part size boto3 uses for a file of ``size`` bytes (it grows past 10,000 parts)."""
    from s3transfer.utils import ChunksizeAdjuster

    return ChunksizeAdjuster().adjust_chunksize(part_size, size)
