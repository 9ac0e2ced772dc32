"""Pytest fixtures for testing reasonctl plugins offline."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.plugins import PluginHost


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A byte-level tokenizer with Qwen chat tokens and a chat template."""
    from reasonctl.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen2_config(tiny_tokenizer: Any) -> Any:
    """A 2-layer Qwen2 config sized for the tiny tokenizer."""
    from reasonctl.testing import tiny_qwen2_config as make_config

    return make_config(len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random tiny Qwen2 model + tokenizer directory (seed 0), shared per session."""
    from reasonctl.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture
def plugin_host() -> PluginHost:
    """A fresh plugin host with the installed plugins."""
    return PluginHost.load()


@pytest.fixture
def register_plugin() -> Iterator[Callable[..., None]]:
    """``register_plugin(obj, name=None)`` adds a plugin to every host for this test only."""
    from reasonctl.testing import registered_plugin

    with ExitStack() as stack:

        def register(plugin: Any, name: str | None = None) -> None:
            stack.enter_context(registered_plugin(plugin, name))

        yield register
