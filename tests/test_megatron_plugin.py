"""The ``megatron`` backend plugin: registration, ``[backend.megatron]`` validation, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from reasonctl.core.config import load_config
from reasonctl.core.errors import ConfigError, MissingDependencyError, ReasonctlError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import RunContext


def test_registered_with_a_typed_config_section() -> None:
    host = PluginHost.load()
    assert host.registry.get("backend", "megatron").owner.name == "backend-megatron"
    config = load_config(overrides=["backend.name=megatron", "backend.megatron.tp=2",
                                    "backend.megatron.pp=2", "backend.megatron.vpp=2"],
                         registry=host.registry)
    section = config.component_config("backend", "megatron")
    assert (section.tp, section.pp, section.vpp, section.use_distributed_optimizer) == (
        2, 2, 2, False)


def test_invalid_sections_are_reported() -> None:
    host = PluginHost.load()
    with pytest.raises(ConfigError, match=r"vpp > 1 \(interleaved pipeline\) needs pp > 1"):
        load_config(overrides=["backend.name=megatron", "backend.megatron.vpp=2"],
                    registry=host.registry)
    with pytest.raises(ConfigError, match="backend.megatron.tpp: unknown key; did you mean 'tp'"):
        load_config(overrides=["backend.name=megatron", "backend.megatron.tpp=2"],
                    registry=host.registry)


def test_setup_without_cuda_or_megatron_says_what_to_do(tmp_path: Path) -> None:
    host = PluginHost.load()
    config = load_config(overrides=["backend.name=megatron", "backend.device=cpu"],
                         registry=host.registry)
    ctx = RunContext(config=config, registry=host.registry, hooks=host.hooks,
                     output_dir=tmp_path)
    backend = host.registry.get("backend", "megatron").build(
        config.component_config("backend", "megatron"))
    with pytest.raises((ReasonctlError, MissingDependencyError)) as info:
        backend.setup(ctx)
    message = str(info.value)
    if isinstance(info.value, MissingDependencyError):
        assert "pip install -e '" in message and "[megatron]'" in message
    else:
        assert "needs CUDA GPUs" in message and "'single' or 'fsdp'" in message
