"""Registers the ``hf`` dataset format (implementation: :mod:`reasonctl.data.formats.hf`
and :mod:`reasonctl.data.formats.hf_dataset`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register the ``hf`` format."""
    from reasonctl.data.formats.hf import HfConfig
    from reasonctl.data.formats.hf_dataset import build_hf_dataset

    register("hf", build_hf_dataset, config_model=HfConfig,
             description="Hugging Face datasets (Hub name, local files or save_to_disk).")
