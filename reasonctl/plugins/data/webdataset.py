"""Registers the ``webdataset`` dataset format (:mod:`reasonctl.data.formats.webdataset`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register the ``webdataset`` format."""
    from reasonctl.data.formats.webdataset import WebDatasetConfig
    from reasonctl.data.webdataset_stream import build_webdataset

    register("webdataset", build_webdataset, config_model=WebDatasetConfig,
             description="Tar shards (local or s3://) streamed with resumable positions.")
