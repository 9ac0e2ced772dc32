"""Registers the ``llava`` dataset format (implementation: :mod:`reasonctl.data.formats.llava`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register the ``llava`` format."""
    from reasonctl.data.formats.llava import LlavaConfig, build_llava_dataset

    register("llava", build_llava_dataset, config_model=LlavaConfig,
             description="LLaVA instruction data with <image>/<video> tags.")
