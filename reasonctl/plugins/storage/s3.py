"""S3 and S3-compatible object storage: ``s3://bucket/prefix``.

Endpoint, region and credentials come from the standard AWS sources (environment such as
``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``; ``~/.aws/config`` and ``~/.aws/credentials``; instance roles) unless
``[storage.s3]`` sets the endpoint or region. Credentials are never part of the config.
Request-level retries follow the AWS settings (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``);
on top of them every file is retried with exponential backoff. ``boto3`` is imported only
when an ``s3://`` URI is used (``pip install 'reasonctl[s3]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reasonctl import hookimpl
from reasonctl.core.registry import Registrar

if TYPE_CHECKING:
    from reasonctl.plugins.storage.s3_client import S3Storage

MIB = 1024 * 1024


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


def build_s3_storage(config: S3StorageConfig | None) -> S3Storage:
    """Create an :class:`~reasonctl.plugins.storage.s3_client.S3Storage` (imports boto3)."""
    from reasonctl.plugins.storage.s3_client import S3Storage

    return S3Storage(config or S3StorageConfig())


@hookimpl
def register_storage(register: Registrar) -> None:
    """Register the ``s3`` scheme."""
    register("s3", build_s3_storage, config_model=S3StorageConfig,
             description="S3 and S3-compatible object stores (s3://bucket/prefix).")
