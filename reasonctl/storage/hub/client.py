"""The ``hf://`` storage client (imports huggingface_hub; loaded only when used).

Uploads use ``HfApi.upload_file`` / ``upload_folder`` (which, with ``hf_xet`` installed,
streams large folders in several commits and resumes by re-running). Downloads go to a
temporary directory next to the destination and are moved into place when complete, so the
destination never holds a partial download or ``huggingface_hub``'s bookkeeping files.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from reasonctl.core.errors import require
from reasonctl.core.storage import StorageError, describe_error, iter_files, remove_tree, retry
from reasonctl.storage.hub.config import HubLocation, HubStorageConfig, parse_hf_uri

require("huggingface_hub", extra="hub", what="hf:// storage")
from huggingface_hub import (  # noqa: E402
    CommitOperationDelete,
    HfApi,
    RepoFile,
    RepoFolder,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    HfHubHTTPError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

T = TypeVar("T")
_COMMIT_ID = re.compile(r"^[0-9a-f]{40}$")


def is_retryable(exc: BaseException) -> bool:
    """Server errors, rate limits and network failures are retried; client errors are not."""
    if isinstance(exc, (LocalTokenNotFoundError, EntryNotFoundError, OfflineModeIsEnabled,
                        ValueError, StorageError, FileNotFoundError)):
        return False
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return status >= 500 or status in (408, 429) or status == 0
    return True


def explain_error(exc: BaseException, loc: HubLocation) -> str:
    """A one-line description of a Hub failure with what to do about it."""
    if isinstance(exc, LocalTokenNotFoundError):
        return "not logged in to the Hub; set HF_TOKEN or run `hf auth login`"
    if isinstance(exc, OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE); unset it to use hf:// storage"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision {loc.revision!r} does not exist in {loc.repo_type} {loc.repo_id}"
    if isinstance(exc, RepositoryNotFoundError):
        return (f"{loc.repo_type} repository {loc.repo_id!r} not found or not accessible; check "
                "the name and that HF_TOKEN (or `hf auth login`) grants access")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        if exc.response.status_code == 401:
            return "the Hub rejected the token; set a valid HF_TOKEN or run `hf auth login`"
        if exc.response.status_code == 403:
            return (f"the token has no write access to {loc.repo_id!r}; use a token with write "
                    "permission for this namespace")
    return describe_error(exc)


class HubStorage:
    """Files and folders in Hugging Face Hub repositories."""

    def __init__(self, config: HubStorageConfig) -> None:
        self.config = config
        self.endpoint = config.endpoint or os.environ.get("HF_ENDPOINT") or None
        self.api = HfApi(endpoint=self.endpoint)
        self._ready: set[tuple[str, str, str]] = set()

    def __repr__(self) -> str:
        return f"HubStorage(endpoint={self.api.endpoint!r})"

    # --- Storage protocol ---------------------------------------------------------------

    def put_file(self, local: Path, uri: str) -> None:
        """Upload one file in one commit."""
        loc = parse_hf_uri(uri)
        if not loc.path:
            raise StorageError(f"{uri}: give a path in the repository, e.g. {loc.uri('file.bin')}")
        if not Path(local).is_file():
            raise StorageError(f"{local}: no such file to upload")
        revision = self._prepare_upload(loc)
        self._call(loc, f"upload to {uri}", lambda: self.api.upload_file(
            path_or_fileobj=str(local), path_in_repo=loc.path, repo_id=loc.repo_id,
            repo_type=loc.repo_type, revision=revision,
            commit_message=self._message(loc.path),
        ))

    def put_dir(self, local: Path, uri: str) -> None:
        """Upload a directory tree under the path of ``uri``."""
        loc = parse_hf_uri(uri)
        if not Path(local).is_dir():
            raise StorageError(f"{local}: no such directory to upload")
        if not iter_files(Path(local)):
            return
        revision = self._prepare_upload(loc)
        self._call(loc, f"upload to {uri}", lambda: self.api.upload_folder(
            folder_path=str(local), path_in_repo=loc.path or None, repo_id=loc.repo_id,
            repo_type=loc.repo_type, revision=revision,
            commit_message=self._message(loc.path or loc.repo_id),
        ))

    def get_file(self, uri: str, local: Path) -> Path:
        """Download one file to ``local``."""
        loc = parse_hf_uri(uri)
        local = Path(local)
        with _staging(local) as staging:
            self._call(loc, f"download {uri}", lambda: hf_hub_download(
                loc.repo_id, loc.path, repo_type=loc.repo_type, revision=self._revision(loc),
                local_dir=str(staging), endpoint=self.endpoint,
            ))
            local.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / loc.path, local)
        return local

    def get_dir(self, uri: str, local: Path) -> Path:
        """Download everything under the path of ``uri`` into ``local``."""
        loc = parse_hf_uri(uri)
        local = Path(local)
        with _staging(local) as staging:
            self._call(loc, f"download {uri}", lambda: snapshot_download(
                loc.repo_id, repo_type=loc.repo_type, revision=self._revision(loc),
                local_dir=str(staging), endpoint=self.endpoint,
                allow_patterns=[f"{loc.path}/*"] if loc.path else None,
            ))
            remove_tree(staging / ".cache" / "huggingface")
            if (staging / ".cache").is_dir() and not any((staging / ".cache").iterdir()):
                (staging / ".cache").rmdir()
            source = staging / loc.path if loc.path else staging
            files = iter_files(source) if source.is_dir() else []
            if not files:
                raise StorageError(f"{uri}: no files under this path")
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, local)
            else:
                for path, rel in files:
                    (local / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(path, local / rel)
        return local

    def list(self, uri: str) -> list[str]:
        """URIs of the files at or under ``uri``; empty when the repo or path is missing."""
        loc = parse_hf_uri(uri)

        def tree() -> list[str]:
            entries = self.api.list_repo_tree(
                loc.repo_id, path_in_repo=loc.path or None, recursive=True,
                revision=self._revision(loc), repo_type=loc.repo_type,
            )
            return sorted(e.path for e in entries if isinstance(e, RepoFile))

        try:
            paths = self._call(loc, f"list {uri}", tree)
        except StorageError as exc:
            if isinstance(exc.__cause__, (RepositoryNotFoundError, RevisionNotFoundError)):
                return []
            if isinstance(exc.__cause__, EntryNotFoundError):
                return [uri] if self.exists(uri) else []
            raise
        return [loc.uri(p) for p in paths]

    def exists(self, uri: str) -> bool:
        """Whether the repository (and revision), file or folder exists."""
        loc = parse_hf_uri(uri)
        try:
            if not loc.path:
                self._call(loc, f"look up {uri}", lambda: self.api.repo_info(
                    loc.repo_id, repo_type=loc.repo_type, revision=self._revision(loc)))
                return True
            found = self._call(loc, f"look up {uri}", lambda: self.api.get_paths_info(
                loc.repo_id, [loc.path], repo_type=loc.repo_type, revision=self._revision(loc)))
        except StorageError as exc:
            if isinstance(exc.__cause__, (RepositoryNotFoundError, RevisionNotFoundError)):
                return False
            raise
        return bool(found)

    def delete(self, uri: str) -> None:
        """Delete a file or folder in one commit (a whole repository is never deleted)."""
        loc = parse_hf_uri(uri)
        if not loc.path:
            raise StorageError(
                f"{uri}: refusing to delete a whole repository through storage; delete it on "
                "the Hub (or with `hf repo delete`) if that is really intended"
            )
        found = self._call(loc, f"look up {uri}", lambda: self.api.get_paths_info(
            loc.repo_id, [loc.path], repo_type=loc.repo_type, revision=self._revision(loc)))
        if not found:
            return
        is_folder = isinstance(found[0], RepoFolder)
        operation = CommitOperationDelete(
            path_in_repo=loc.path + ("/" if is_folder else ""), is_folder=is_folder
        )
        self._call(loc, f"delete {uri}", lambda: self.api.create_commit(
            loc.repo_id, [operation], repo_type=loc.repo_type, revision=self._revision(loc),
            commit_message=f"Delete {loc.path} with reasonctl",
        ))

    # --- helpers ------------------------------------------------------------------------

    def _revision(self, loc: HubLocation) -> str:
        return loc.revision or self.config.revision

    def _message(self, path: str) -> str:
        return self.config.commit_message.replace("{path}", path)

    def _prepare_upload(self, loc: HubLocation) -> str:
        """Create the repository and branch if missing (once per storage object)."""
        revision = self._revision(loc)
        if _COMMIT_ID.match(revision):
            raise StorageError(
                f"{loc.uri(loc.path)}: cannot upload to a commit id; name a branch instead"
            )
        key = (loc.repo_type, loc.repo_id, revision)
        if key in self._ready:
            return revision
        self._call(loc, f"create {loc.repo_id}", lambda: self.api.create_repo(
            loc.repo_id, repo_type=loc.repo_type, private=self.config.private, exist_ok=True))
        if revision != "main":
            self._call(loc, f"create branch {revision}", lambda: self.api.create_branch(
                loc.repo_id, branch=revision, repo_type=loc.repo_type, exist_ok=True))
        self._ready.add(key)
        return revision

    def _call(self, loc: HubLocation, what: str, action: Callable[[], T]) -> T:
        try:
            return retry(action, attempts=self.config.max_attempts,
                         backoff_s=self.config.backoff_s, what=what, retryable=is_retryable)
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"could not {what}: {explain_error(exc, loc)}",
                               permanent=not is_retryable(exc)) from exc


@contextmanager
def _staging(local: Path) -> Iterator[Path]:
    """A temporary directory next to a download destination, removed afterwards."""
    path = local.parent / f".{local.name}.hf-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["HubStorage"]
