"""Registers the ``s3`` storage scheme (S3 and S3-compatible object stores).

The config model is :class:`reasonctl.storage.s3.config.S3StorageConfig`; the client,
which imports ``boto3``, is :class:`reasonctl.storage.s3.client.S3Storage` and is imported
only when an ``s3://`` URI is used (``pip install 'reasonctl[s3]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar
    from reasonctl.storage.s3.client import S3Storage
    from reasonctl.storage.s3.config import S3StorageConfig


def build_s3_storage(config: S3StorageConfig | None) -> S3Storage:
    """Create an :class:`~reasonctl.storage.s3.client.S3Storage` (imports boto3)."""
    from reasonctl.storage.s3.client import S3Storage
    from reasonctl.storage.s3.config import S3StorageConfig

    return S3Storage(config or S3StorageConfig())


@hookimpl
def register_storage(register: Registrar) -> None:
    """Register the ``s3`` scheme."""
    from reasonctl.storage.s3.config import S3StorageConfig

    register("s3", build_s3_storage, config_model=S3StorageConfig,
             description="S3 and S3-compatible object stores (s3://bucket/prefix).")
