"""Storage URIs: parse them, open the storage plugin of a scheme, fetch remote models once.

A storage URI is ``<scheme>://<rest>``; anything without a scheme is a local path and is
handled by the ``file`` storage. The storage plugin registered under the scheme name
(``file``, ``s3``, ``hf`` ...) is built with its ``[storage.<scheme>]`` config section.
This module imports no plugin and no optional package.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from reasonctl.core.errors import ReasonctlError
from reasonctl.core.uris import is_remote, join_uri, parse_uri

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import Storage
    from reasonctl.core.registry import Registry

CACHE_ENV = "REASONCTL_CACHE"
T = TypeVar("T")
log = logging.getLogger("reasonctl.storage")


class StorageError(ReasonctlError):
    """A storage operation failed; the message names the URI and what to do.

    ``permanent`` marks failures another attempt cannot fix (no credentials, access
    denied, no such bucket or repository): they are reported at once, not retried.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def is_permanent(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` cannot help."""
    if isinstance(exc, StorageError):
        return exc.permanent
    return isinstance(exc, (PermissionError, FileNotFoundError, NotADirectoryError,
                            IsADirectoryError))


def open_storage(registry: Registry, uri: str, config: RunConfig | None = None) -> Storage:
    """Build the storage plugin that handles ``uri``'s scheme with its config section.

    ``config`` supplies ``[storage.<scheme>]``; without it the plugin's defaults apply. An
    unknown scheme raises :class:`~reasonctl.core.errors.UnknownComponentError` listing the
    installed storage schemes.
    """
    scheme, _ = parse_uri(uri)
    spec = registry.get("storage", scheme)
    section = config.component_config("storage", scheme) if config is not None else None
    return spec.build(section)


def retry(
    action: Callable[[], T],
    *,
    attempts: int,
    backoff_s: float,
    what: str,
    retryable: Callable[[BaseException], bool] = lambda exc: True,
    max_backoff_s: float = 60.0,
    deadline: float | None = None,
) -> T:
    """Call ``action`` up to ``attempts`` times with exponential backoff between failures.

    The wait before retry ``n`` (1-based) is ``backoff_s * 2**(n-1)`` (at most
    ``max_backoff_s``) times a random factor in [0.5, 1.5) so parallel clients spread out.
    Exceptions for which ``retryable`` is false, and the last failure, propagate unchanged;
    so does a failure whose retry would start after ``deadline`` (``time.monotonic()``).
    """
    for attempt in range(1, max(1, attempts) + 1):
        try:
            return action()
        except Exception as exc:
            if attempt >= attempts or not retryable(exc):
                raise
            delay = min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise
            log.warning(
                "%s failed (attempt %d of %d): %s; retrying in %.1f s",
                what, attempt, attempts, describe_error(exc), delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception with credential values scrubbed."""
    from reasonctl.core.config import redact_text

    text = str(exc).strip() or repr(exc)
    if isinstance(exc, ReasonctlError):
        return redact_text(text)
    return redact_text(f"{type(exc).__name__}: {text}")


# --- remote models -----------------------------------------------------------------------


def cache_root() -> Path:
    """Root of reasonctl's download cache: ``REASONCTL_CACHE`` or ``~/.cache/reasonctl``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "reasonctl").expanduser()


def model_cache_dir(uri: str) -> Path:
    """Where the model at ``uri`` is kept once downloaded: ``<cache>/models/<hash>``."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:20]
    return cache_root() / "models" / digest


def fetch_model(registry: Registry, config: RunConfig | None, uri: str) -> Path:
    """A local directory holding the model at ``uri``, downloading it the first time.

    Local paths are returned unchanged (not copied). A remote model is downloaded with its
    storage plugin into a temporary directory, which is renamed to
    :func:`model_cache_dir` only once complete, so an interrupted download is never
    mistaken for a model. Concurrent callers on one machine (several ranks) wait for one
    download. Delete the directory to download again.
    """
    scheme, rest = parse_uri(uri)
    if scheme == "file":
        return Path(rest).expanduser()
    target = model_cache_dir(uri)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.is_dir():
            return target
        partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            storage = open_storage(registry, uri, config)
            storage.get_dir(uri, partial)
            if not partial.is_dir() or not any(partial.iterdir()):
                raise StorageError(
                    f"No files found at {uri}; check the bucket/repository and path "
                    "(model.name_or_path or --model)"
                )
            partial.rename(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    log.info("downloaded %s to %s", uri, target)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (a no-op where ``fcntl`` is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def iter_files(root: Path) -> list[tuple[Path, str]]:
    """Files under ``root`` (recursively, following links to files) with their POSIX paths
    relative to ``root``, sorted by relative path."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            out.append((path, path.relative_to(root).as_posix()))
    return sorted(out, key=lambda item: item[1])


def describe_local(path: Path) -> tuple[int, int]:
    """``(number of files, total bytes)`` of a file or directory tree."""
    if path.is_file():
        return 1, path.stat().st_size
    files = iter_files(path)
    return len(files), sum(p.stat().st_size for p, _ in files)


def remove_tree(path: Path) -> None:
    """Delete a staging or temporary directory or file if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


__all__ = [
    "StorageError",
    "cache_root",
    "describe_error",
    "describe_local",
    "fetch_model",
    "is_permanent",
    "is_remote",
    "iter_files",
    "join_uri",
    "model_cache_dir",
    "open_storage",
    "parse_uri",
    "remove_tree",
    "retry",
]
