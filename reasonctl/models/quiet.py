"""transformers' own console output, turned down: reasonctl's console reports progress."""

from __future__ import annotations


def quiet_transformers() -> None:
    """Turn off transformers' per-file progress bars (our own console reports progress)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
