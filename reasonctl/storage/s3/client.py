"""The ``s3://`` storage client (imports boto3; loaded only when S3 is used).

Uploads go through boto3's transfer manager (multipart above the threshold, parallel parts
and files). Every object carries the sha256 of its content in its metadata
(``x-amz-meta-sha256``). After an upload the object's size and ETag are compared with the
values computed locally (:mod:`reasonctl.storage.s3.digest`); after a download the content
is checked against the stored sha256. Files whose remote size and ETag already match are
not uploaded again, so repeating an interrupted directory upload only sends what is missing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from reasonctl.core.errors import require
from reasonctl.core.storage import StorageError, iter_files, remove_tree, retry
from reasonctl.storage.s3.config import MIB, S3StorageConfig, split_s3_uri
from reasonctl.storage.s3.digest import FileDigest, file_digest, sha256_of
from reasonctl.storage.s3.errors import (
    S3IntegrityError,
    TransferFailed,
    error_code,
    explain_error,
    is_retryable,
)

boto3 = require("boto3", extra="s3", what="s3:// storage")
from boto3.s3.transfer import TransferConfig, create_transfer_manager  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

SHA256_METADATA = "sha256"
DELETE_BATCH = 1000
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-\d+)?$")
log = logging.getLogger("reasonctl.storage.s3")


class S3Storage:
    """Files and directories in an S3 bucket, addressed as ``s3://bucket/prefix``."""

    def __init__(self, config: S3StorageConfig) -> None:
        self.config = config
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                max_pool_connections=max(10, 2 * config.max_concurrency),
                s3={"addressing_style": config.addressing_style},
            ),
        )
        self.part_size = config.part_size_mb * MIB
        self._known_buckets: set[str] = set()
        self.threshold = config.multipart_threshold_mb * MIB
        self.transfer_config = TransferConfig(
            multipart_threshold=self.threshold,
            multipart_chunksize=self.part_size,
            max_concurrency=config.max_concurrency,
            preferred_transfer_client="classic",
        )

    def __repr__(self) -> str:
        return f"S3Storage(endpoint={self.client.meta.endpoint_url!r})"

    # --- Storage protocol ---------------------------------------------------------------

    def put_file(self, local: Path, uri: str) -> None:
        """Upload one file to the object ``uri``."""
        bucket, key = split_s3_uri(uri)
        if not key:
            raise StorageError(f"{uri}: give an object key, e.g. s3://{bucket}/path/file")
        if not Path(local).is_file():
            raise StorageError(f"{local}: no such file to upload")
        self._upload(bucket, {key: Path(local)}, uri)

    def put_dir(self, local: Path, uri: str) -> None:
        """Upload every file under ``local`` to ``uri/<relative path>``."""
        bucket, prefix = split_s3_uri(uri)
        if not Path(local).is_dir():
            raise StorageError(f"{local}: no such directory to upload")
        items = {_join_key(prefix, rel): path for path, rel in iter_files(Path(local))}
        self._upload(bucket, items, uri)

    def get_file(self, uri: str, local: Path) -> Path:
        """Download the object ``uri`` to ``local``."""
        bucket, key = split_s3_uri(uri)
        if self._head(bucket, key) is None:
            raise StorageError(f"{uri}: no such object")
        self._download(bucket, {key: Path(local)}, uri)
        return Path(local)

    def get_dir(self, uri: str, local: Path) -> Path:
        """Download every object under the prefix ``uri`` into ``local``."""
        bucket, prefix = split_s3_uri(uri)
        root = Path(local)
        items: dict[str, Path] = {}
        for obj in self._objects(bucket, prefix):
            rel = obj["Key"][len(prefix):].lstrip("/") if prefix else obj["Key"]
            target = (root / rel).resolve()
            if not rel or not target.is_relative_to(root.resolve()):
                raise StorageError(f"s3://{bucket}/{obj['Key']}: key escapes {root}; refusing")
            items[obj["Key"]] = root / rel
        if not items:
            raise StorageError(f"{uri}: no objects under this prefix")
        root.mkdir(parents=True, exist_ok=True)
        self._download(bucket, items, uri)
        return root

    def list(self, uri: str) -> list[str]:
        """URIs of the objects at or under ``uri``, sorted by key."""
        bucket, prefix = split_s3_uri(uri)
        return [f"s3://{bucket}/{obj['Key']}" for obj in self._objects(bucket, prefix)]

    def exists(self, uri: str) -> bool:
        """Whether an object or a non-empty prefix exists at ``uri``."""
        bucket, key = split_s3_uri(uri)
        if key and self._head(bucket, key) is not None:
            return True
        return next(iter(self._objects(bucket, key)), None) is not None

    def delete(self, uri: str) -> None:
        """Delete the object ``uri`` and every object under the prefix ``uri/``."""
        bucket, key = split_s3_uri(uri)
        keys = [obj["Key"] for obj in self._objects(bucket, key)]
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start:start + DELETE_BATCH]]
            response = self._call(
                "delete", uri, bucket,
                lambda b=batch: self.client.delete_objects(
                    Bucket=bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(
                    f"{uri}: could not delete {len(response['Errors'])} object(s), e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )

    # --- transfers ----------------------------------------------------------------------

    def _ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` when it is missing and ``create_bucket`` is on (once per bucket)."""
        if bucket in self._known_buckets or not self.config.create_bucket:
            return
        try:  # a listing, not HEAD: its errors carry a code (wrong key vs. access denied)
            self.client.list_objects_v2(Bucket=bucket, MaxKeys=1)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in {"404", "NoSuchBucket", "NotFound"}:
                raise
            region = self.client.meta.region_name
            args: dict[str, Any] = {"Bucket": bucket}
            if region and region != "us-east-1":
                args["CreateBucketConfiguration"] = {"LocationConstraint": region}
            log.warning("s3://%s does not exist; creating it (storage.s3.create_bucket)", bucket)
            self.client.create_bucket(**args)
        self._known_buckets.add(bucket)

    def _upload(self, bucket: str, items: dict[str, Path], where: str) -> None:
        if not items:
            return
        self._call("check bucket", f"s3://{bucket}", bucket, lambda: self._ensure_bucket(bucket))
        with ThreadPoolExecutor(max_workers=self.config.max_concurrency) as pool:
            digests = dict(zip(items, pool.map(
                lambda p: file_digest(p, self.part_size, self.threshold), items.values()
            ), strict=True))
        prefix = _common_prefix(list(items))
        remote = {o["Key"]: (o["Size"], o["ETag"].strip('"')) for o in self._objects(bucket, prefix)
                  if o["Key"] in items}
        pending = {k: p for k, p in items.items()
                   if remote.get(k) != (digests[k].size, digests[k].etag)}
        if len(pending) < len(items):
            log.info("%s: %d file(s) already uploaded and unchanged", where,
                     len(items) - len(pending))

        def one_round() -> None:
            failures: dict[str, BaseException] = {}
            with create_transfer_manager(self.client, self.transfer_config) as manager:
                futures = {
                    key: manager.upload(
                        str(path), bucket, key,
                        extra_args={"Metadata": {SHA256_METADATA: digests[key].sha256}},
                    )
                    for key, path in pending.items()
                }
                for key, future in futures.items():
                    try:
                        future.result()
                        if self.config.verify:
                            self._check_upload(bucket, key, digests[key])
                    except Exception as exc:
                        failures[key] = exc
            self._settle(pending, failures, "upload", where, bucket, len(items))

        if pending:
            self._retry(one_round, f"upload to {where}")

    def _download(self, bucket: str, items: dict[str, Path], where: str) -> None:
        pending = dict(items)

        def one_round() -> None:
            failures: dict[str, BaseException] = {}
            for path in pending.values():
                path.parent.mkdir(parents=True, exist_ok=True)
            with create_transfer_manager(self.client, self.transfer_config) as manager:
                futures = {key: manager.download(bucket, key, str(path))
                           for key, path in pending.items()}
                for key, future in futures.items():
                    try:
                        future.result()
                        if self.config.verify:
                            self._check_download(bucket, key, pending[key])
                    except Exception as exc:
                        if isinstance(exc, S3IntegrityError):
                            remove_tree(pending[key])
                        failures[key] = exc
            self._settle(pending, failures, "download", where, bucket, len(items))

        self._retry(one_round, f"download {where}")

    def _settle(self, pending: dict[str, Path], failures: dict[str, BaseException], action: str,
                where: str, bucket: str, total: int) -> None:
        """Drop finished keys from ``pending``; raise if any failed."""
        for key in [k for k in pending if k not in failures]:
            del pending[key]
        if failures:
            uris = {f"s3://{bucket}/{k}": exc for k, exc in failures.items()}
            raise TransferFailed(action, where, total, uris)

    def _retry(self, action: Any, what: str) -> None:
        retry(action, attempts=self.config.max_attempts, backoff_s=self.config.backoff_s,
              what=what, retryable=is_retryable)

    def _check_upload(self, bucket: str, key: str, digest: FileDigest) -> None:
        head = self._head(bucket, key)
        where = f"s3://{bucket}/{key}"
        if head is None:
            raise S3IntegrityError(f"{where}: object missing right after upload")
        etag = str(head.get("ETag", "")).strip('"')
        if head.get("ContentLength") != digest.size:
            raise S3IntegrityError(
                f"{where}: remote size {head.get('ContentLength')} != local {digest.size}"
            )
        if _MD5_ETAG.match(etag) and etag != digest.etag:
            raise S3IntegrityError(f"{where}: ETag {etag} != expected {digest.etag}")
        stored = head.get("Metadata", {}).get(SHA256_METADATA)
        if stored != digest.sha256:
            raise S3IntegrityError(f"{where}: stored sha256 {stored} != local {digest.sha256}")

    def _check_download(self, bucket: str, key: str, path: Path) -> None:
        head = self._head(bucket, key) or {}
        expected = head.get("Metadata", {}).get(SHA256_METADATA)
        size = path.stat().st_size
        if head.get("ContentLength") is not None and size != head["ContentLength"]:
            raise S3IntegrityError(
                f"s3://{bucket}/{key}: downloaded {size} bytes, expected {head['ContentLength']}"
            )
        if expected and sha256_of(path) != expected:
            raise S3IntegrityError(f"s3://{bucket}/{key}: downloaded content fails its sha256")

    # --- requests -----------------------------------------------------------------------

    def _head(self, bucket: str, key: str) -> dict[str, Any] | None:
        def head() -> dict[str, Any] | None:
            try:
                return self.client.head_object(Bucket=bucket, Key=key)
            except ClientError as exc:
                if error_code(exc)[1] == 404 or error_code(exc)[0] in ("404", "NoSuchKey"):
                    return None
                raise

        return self._call("read", f"s3://{bucket}/{key}", bucket, head)

    def _objects(self, bucket: str, key: str) -> Iterator[dict[str, Any]]:
        """Objects whose key is ``key`` or starts with ``key/`` (everything if empty)."""
        paginator = self.client.get_paginator("list_objects_v2")

        def pages() -> list[dict[str, Any]]:
            out = []
            for page in paginator.paginate(
                Bucket=bucket, Prefix=key, PaginationConfig={"PageSize": self.config.page_size}
            ):
                out.extend(page.get("Contents", []))
            return out

        for obj in self._call("list", f"s3://{bucket}/{key}", bucket, pages):
            name = obj["Key"]
            if name.endswith("/"):
                continue
            if not key or name == key or name.startswith(key + "/"):
                yield obj

    def _call(self, action: str, uri: str, bucket: str, request: Any) -> Any:
        """Run one request with retries; failures become a :class:`StorageError`."""
        try:
            return retry(request, attempts=self.config.max_attempts,
                         backoff_s=self.config.backoff_s, what=f"{action} {uri}",
                         retryable=is_retryable)
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"could not {action} {uri}: {explain_error(exc, bucket)}",
                               permanent=not is_retryable(exc)) from exc

    # --- start-of-run check -------------------------------------------------------------

    def check_access(self, uri: str) -> None:
        """Check the credentials and the bucket of ``uri`` with one listing request.

        A missing bucket is created when ``create_bucket`` is on. Raises
        :class:`StorageError` (``permanent`` for errors no retry fixes: no or wrong
        credentials, access denied, no such bucket).
        """
        bucket, prefix = split_s3_uri(uri)
        try:
            self.client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except ClientError as exc:
            if error_code(exc)[0] == "NoSuchBucket" and self.config.create_bucket:
                self._call("create bucket", f"s3://{bucket}", bucket,
                           lambda: self._ensure_bucket(bucket))
                return
            raise StorageError(f"cannot use {uri}: {explain_error(exc, bucket)}",
                               permanent=not is_retryable(exc)) from exc
        except Exception as exc:
            raise StorageError(f"cannot use {uri}: {explain_error(exc, bucket)}",
                               permanent=not is_retryable(exc)) from exc


def _join_key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def _common_prefix(keys: list[str]) -> str:
    """The longest ``/``-bounded common prefix of ``keys`` (the key itself for one key)."""
    if len(keys) == 1:
        return keys[0]
    parts = [k.split("/") for k in keys]
    common: list[str] = []
    for segments in zip(*parts, strict=False):
        if len(set(segments)) != 1:
            break
        common.append(segments[0])
    return "/".join(common[: min(len(p) for p in parts) - 1])


__all__ = ["S3Storage"]
