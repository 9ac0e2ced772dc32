"""Registers the ``jsonl`` dataset format (implementation: :mod:`reasonctl.data.formats.jsonl`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register the ``jsonl`` format."""
    from reasonctl.data.formats.jsonl import JsonlConfig, build_jsonl_dataset

    register("jsonl", build_jsonl_dataset, config_model=JsonlConfig,
             description="Chat or prompt/answer rows, one JSON object per line.")
