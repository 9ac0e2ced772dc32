"""Registers the ``sft`` algorithm (implementation: :mod:`reasonctl.algorithms.sft`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.algorithms.sft_config import SFTConfig
    from reasonctl.core.registry import Registrar


def build_sft(config: SFTConfig | None) -> Any:
    """Supervised fine-tuning on the assistant turns of chat samples."""
    from reasonctl.algorithms.sft import SFTAlgorithm
    from reasonctl.algorithms.sft_config import SFTConfig

    return SFTAlgorithm(config or SFTConfig())


@hookimpl
def register_algorithms(register: Registrar) -> None:
    """Register the ``sft`` algorithm."""
    from reasonctl.algorithms.sft_config import SFTConfig

    register("sft", build_sft, config_model=SFTConfig)
