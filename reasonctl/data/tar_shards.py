"""Tar shards as streams of samples: shard lists, opening shards at an offset, grouping members.

A WebDataset shard is a plain tar file whose members are grouped into samples by *key*:
the member's path up to the first dot of its file name (``clips/0001.mp4`` and
``clips/0001.json`` form sample ``clips/0001`` with the fields ``mp4`` and ``json``).
Members of one sample are consecutive.

* :func:`expand_shards` turns ``shards`` options into a list of addresses: brace ranges
  (``{000000..000099}``) and lists (``{train,val}``) are expanded, local glob patterns are
  matched, and an ``s3://bucket/prefix/`` ending in ``/`` lists the ``.tar`` objects under it.
* :class:`ShardOpener` opens a shard from a byte offset: local files are seeked, remote ones
  are read through the storage plugin of their scheme (a ranged request when the storage
  has :class:`~reasonctl.core.protocols.ReadsStreams`, a download otherwise).
* :func:`read_samples` reads a shard from a sample's offset on and yields
  :class:`TarSample` values carrying the offset of the next sample, which is what a resumable
  position records. A truncated or corrupt shard raises :class:`ShardError` naming it.

Reading uses the standard library's ``tarfile`` in stream mode, so a shard is never seeked
backwards or held whole in memory; only uncompressed tar supports resuming from an offset.
"""

from __future__ import annotations

import glob
import itertools
import logging
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from reasonctl.core.errors import DataError
from reasonctl.core.uris import is_remote

log = logging.getLogger("reasonctl.data.webdataset")
READ_ATTEMPTS = 3
"""Times a shard is opened again after its stream breaks off, before it counts as bad."""
BRACES = re.compile(r"\{([^{}]*)\}")
RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


class ShardError(DataError):
    """A shard could not be read (missing, truncated or not a tar file); names the shard."""

    def __init__(self, shard: str, reason: str) -> None:
        super().__init__(f"{shard}: {reason}")
        self.shard = shard
        self.reason = reason


@dataclass
class TarSample:
    """One sample of a shard: its ``key``, member ``files`` by field (the name after the
    key's dot, lower case), the byte ``offset`` of its first member and ``next_offset``,
    where the following sample starts (``None`` after the shard's last sample)."""

    key: str
    files: dict[str, bytes]
    offset: int
    next_offset: int | None


def expand_braces(pattern: str) -> list[str]:
    """Every name ``pattern`` spells: ``{000..010}`` ranges (zero padding kept) and
    ``{a,b}`` alternatives, combined left to right."""
    parts: list[list[str]] = []
    last = 0
    for match in BRACES.finditer(pattern):
        parts.append([pattern[last : match.start()]])
        body = match.group(1)
        numbers = RANGE.match(body)
        if numbers:
            first, end = numbers.group(1), numbers.group(2)
            width = len(first) if first.startswith("0") or len(first) == len(end) else 0
            step = 1 if int(end) >= int(first) else -1
            parts.append([str(n).zfill(width)
                          for n in range(int(first), int(end) + step, step)])
        else:
            parts.append(body.split(","))
        last = match.end()
    parts.append([pattern[last:]])
    return ["".join(choice) for choice in itertools.product(*parts)]


def expand_shards(patterns: str | list[str], *, list_remote: Callable[[str], list[str]],
                  option: str) -> list[str]:
    """The shard addresses ``patterns`` name (see the module docstring), in order."""
    out: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        for name in expand_braces(pattern):
            if is_remote(name):
                if name.endswith("/"):
                    listed = [u for u in list_remote(name.rstrip("/")) if u.endswith(".tar")]
                    if not listed:
                        raise DataError(f"{option}: no .tar objects under {name}")
                    out.extend(listed)
                else:
                    out.append(name)
                continue
            path = Path(name).expanduser()
            if glob.has_magic(name):
                matched = sorted(glob.glob(str(path)))
                if not matched:
                    raise DataError(f"{option}: no file matches {name!r}")
                out.extend(matched)
            elif path.is_dir():
                found = sorted(str(p) for p in path.glob("*.tar"))
                if not found:
                    raise DataError(f"{option}: no .tar files in directory {path.absolute()}")
                out.extend(found)
            elif not path.is_file():
                raise DataError(f"{option}: shard not found: {path.absolute()} (relative "
                                f"paths resolve against {Path.cwd()})")
            else:
                out.append(str(path))
    if not out:
        raise DataError(f"{option}: no shards given; set it to tar files, e.g. "
                        "'s3://bucket/train/{000000..000099}.tar'")
    return out


class ShardOpener:
    """Opens shards from a byte offset (see the module docstring); ``storage_for(uri)``
    builds the storage plugin of a remote address, once per scheme."""

    def __init__(self, storage_for: Callable[[str], Any]) -> None:
        self.storage_for = storage_for
        self._storages: dict[str, Any] = {}
        self._downloads: dict[str, Path] = {}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def open(self, shard: str, start: int = 0) -> BinaryIO:
        """A binary stream of ``shard`` from byte ``start``."""
        if not is_remote(shard):
            try:
                handle = open(shard, "rb")
            except OSError as exc:
                raise ShardError(shard, f"cannot open: {exc.strerror or exc}") from None
            handle.seek(start)
            return handle
        scheme = shard.split("://", 1)[0]
        if scheme not in self._storages:
            self._storages[scheme] = self.storage_for(shard)
        storage = self._storages[scheme]
        from reasonctl.core.protocols import ReadsStreams
        from reasonctl.core.storage import StorageError

        try:
            if isinstance(storage, ReadsStreams):
                return storage.open_read(shard, start)
            local = self._download(storage, shard)
        except StorageError as exc:
            raise ShardError(shard, str(exc).removeprefix(f"{shard}: ")) from None
        handle = open(local, "rb")
        handle.seek(start)
        return handle

    def _download(self, storage: Any, shard: str) -> Path:
        if shard not in self._downloads:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="reasonctl-shards-")
            target = Path(self._tmp.name) / f"{len(self._downloads)}.tar"
            self._downloads[shard] = storage.get_file(shard, target)
        return self._downloads[shard]

    def close(self) -> None:
        """Remove downloaded shards."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp.name, ignore_errors=True)
            self._tmp = None
            self._downloads.clear()


def split_name(name: str) -> tuple[str, str]:
    """``dir/0001.seg.mp4`` -> ``("dir/0001", "seg.mp4")`` (key, field in lower case)."""
    directory, _, base = name.rpartition("/")
    stem, dot, field = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, field.lower() if dot else ""


def read_samples(opener: ShardOpener, shard: str, start: int = 0, *,
                 limit: int | None = None, attempts: int = READ_ATTEMPTS
                 ) -> Iterator[TarSample]:
    """The samples of ``shard`` from the one at byte ``start`` on (at most ``limit``).

    A read that breaks off (a dropped connection) is opened again at the first sample not
    yet returned, up to ``attempts`` times in a row; then the shard is reported as
    unreadable (:class:`ShardError`).
    """
    count, failures = 0, 0
    while True:
        try:
            for sample in _read_once(opener, shard, start, limit=None if limit is None
                                     else limit - count):
                yield sample
                count, failures = count + 1, 0
                if sample.next_offset is None:
                    return
                start = sample.next_offset
            return
        except _StreamBroken as exc:
            failures += 1
            if failures >= attempts:
                raise ShardError(shard, f"reading broke off {failures} times at byte {start} "
                                 f"({exc.__cause__})") from None
            log.warning("%s: reading broke off (%s); reopening at byte %d", shard,
                        exc.__cause__, start)


def _read_once(opener: ShardOpener, shard: str, start: int, *, limit: int | None
               ) -> Iterator[TarSample]:
    stream = _Tail(opener.open(shard, start))
    count = 0
    key: str | None = None
    files: dict[str, bytes] = {}
    first = start
    try:
        try:
            archive = tarfile.open(fileobj=stream, mode="r|")
        except (tarfile.TarError, EOFError, OSError) as exc:
            if start > 0 and "empty file" in str(exc):
                return
            raise ShardError(shard, f"not a readable tar file ({exc})") from None
        try:
            for info in archive:
                if not info.isfile():
                    continue
                name_key, field = split_name(info.name)
                offset = start + info.offset
                if key is not None and name_key != key:
                    yield TarSample(key, files, first, offset)
                    count += 1
                    if limit is not None and count >= limit:
                        return
                    files = {}
                if name_key != key:
                    key, first = name_key, offset
                handle = archive.extractfile(info)
                files[field] = handle.read() if handle is not None else b""
            problem = stream.end_problem(archive.offset)
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            raise ShardError(shard, f"corrupt or truncated tar data after sample {key!r} "
                             f"({problem})")
        if key is not None:
            yield TarSample(key, files, first, None)
    finally:
        stream.close()


class _StreamBroken(Exception):
    """Reading the underlying stream failed (the cause says why)."""


class _Tail:
    """A read-only stream that remembers the last bytes it returned, so the block where
    ``tarfile`` stopped can be checked: stream-mode ``tarfile`` ends quietly at an invalid
    header, which must not pass for the end of the archive."""

    KEEP = 1 << 16

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.tail = bytearray()
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        try:
            data = self.raw.read(size)
        except Exception as exc:  # a connection dropped: the caller reopens the shard
            raise _StreamBroken() from exc
        self.total += len(data)
        self.tail += data
        del self.tail[: max(0, len(self.tail) - self.KEEP)]
        return data

    def close(self) -> None:
        self.raw.close()

    def end_problem(self, offset: int) -> str | None:
        """What is wrong with the archive ending at ``offset`` (relative to the stream's
        start), or ``None`` for a proper end (zero blocks, or the end of the data)."""
        while len(self.tail) < self.KEEP:  # the header block may not have been read yet
            more = self.read(tarfile.BLOCKSIZE)
            if not more:
                break
        first = self.total - len(self.tail)
        if offset < first:
            return None  # cannot tell (should not happen: tarfile reads ahead)
        block = bytes(self.tail[offset - first : offset - first + tarfile.BLOCKSIZE])
        if not block or block.count(0) == len(block):
            return None
        return f"invalid tar header at byte {offset}"
