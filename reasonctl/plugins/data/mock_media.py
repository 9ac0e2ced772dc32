"""Registers the ``mock_media`` dataset format of diffusion smoke runs
(:mod:`reasonctl.diffusion.datasets`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register ``mock_media``."""
    from reasonctl.diffusion.datasets import MockMediaConfig, build_mock_media_dataset

    register("mock_media", build_mock_media_dataset, config_model=MockMediaConfig,
             description="Synthetic prompts (and images) for diffusion smoke runs.")
