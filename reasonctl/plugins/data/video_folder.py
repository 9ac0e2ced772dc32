"""Registers the ``video_folder`` dataset format (:mod:`reasonctl.data.formats.video_folder`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register the ``video_folder`` format."""
    from reasonctl.data.formats.video_folder import VideoFolderConfig, build_video_folder_dataset

    register("video_folder", build_video_folder_dataset, config_model=VideoFolderConfig,
             description="videos/*.mp4 matched to metas/* captions or labels.")
