"""``[storage.s3]`` and ``s3://`` addresses: what can be checked without ``boto3``.

:class:`S3StorageConfig` is the config model of the ``s3`` storage; :func:`split_s3_uri`
parses an address. The client that uses them is :mod:`reasonctl.storage.s3.client`.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reasonctl.core.storage import StorageError, parse_uri

MIB = 1024 * 1024
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class S3StorageConfig(BaseModel):
    """``[storage.s3]``: S3 transfer settings."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(
        default=None,
        description="S3-compatible endpoint, e.g. http://minio:9000 (default: AWS_ENDPOINT_URL "
        "or AWS).",
    )
    region: str | None = Field(default=None, description="Region (default: AWS config).")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="Bucket addressing; many S3-compatible servers need 'path'."
    )
    part_size_mb: int = Field(
        default=64, ge=5, le=5120, description="Multipart part size in MiB (S3 minimum: 5)."
    )
    multipart_threshold_mb: int = Field(
        default=64, ge=5, description="Files of at least this many MiB are uploaded in parts."
    )
    max_concurrency: int = Field(
        default=8, gt=0, description="Parallel part and file transfers."
    )
    max_attempts: int = Field(
        default=5, gt=0, description="Attempts per file before an upload or download fails."
    )
    backoff_s: float = Field(
        default=1.0, ge=0, description="First retry delay in seconds; doubles every attempt."
    )
    create_bucket: bool = Field(
        default=True,
        description="Create the bucket on first upload when it does not exist yet.",
    )
    verify: bool = Field(
        default=True,
        description="Check size and ETag (MD5) after each upload and the sha256 stored in "
        "object metadata after each download.",
    )
    page_size: int = Field(default=1000, gt=0, le=1000, description="Keys per listing request.")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    read_timeout_s: float = Field(default=60.0, gt=0)

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, value: str | None) -> str | None:
        if value and (urlsplit(value).username or urlsplit(value).password):
            raise ValueError(
                "endpoint_url must not contain credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or an AWS profile) instead"
            )
        return value

    def uri_problems(self, uri: str) -> list[str]:
        """What is wrong with ``s3://`` address ``uri`` (pre-flight of ``checkpoint.upload``)."""
        _, rest = parse_uri(uri)
        bucket = rest.split("/", 1)[0]
        if not bucket:
            return ["has no bucket; expected s3://BUCKET[/prefix]"]
        userinfo, at, _ = rest.partition("@")
        if "@" in bucket or (at and ":" in userinfo):
            return ["holds credentials; set them in the environment (AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY) or an AWS profile, not in the URI"]
        if not _BUCKET.match(bucket):
            return [f"has an invalid bucket name {bucket!r}; expected s3://BUCKET[/prefix]"]
        return []


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")`` (key without outer slashes)."""
    scheme, rest = parse_uri(uri)
    bucket, _, key = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise StorageError(f"{uri!r} is not an S3 URI; expected s3://bucket/prefix")
    return bucket, key.strip("/")
