"""Registers the ``hf`` storage scheme (Hugging Face Hub repositories).

The config model is :class:`reasonctl.storage.hub.config.HubStorageConfig`; the client,
which imports ``huggingface_hub``, is :class:`reasonctl.storage.hub.client.HubStorage` and
is imported only when an ``hf://`` URI is used (``pip install 'reasonctl[hub]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar
    from reasonctl.storage.hub.client import HubStorage
    from reasonctl.storage.hub.config import HubStorageConfig


def build_hub_storage(config: HubStorageConfig | None) -> HubStorage:
    """Create a :class:`~reasonctl.storage.hub.client.HubStorage` (imports the client)."""
    from reasonctl.storage.hub.client import HubStorage
    from reasonctl.storage.hub.config import HubStorageConfig

    return HubStorage(config or HubStorageConfig())


@hookimpl
def register_storage(register: Registrar) -> None:
    """Register the ``hf`` scheme."""
    from reasonctl.storage.hub.config import HubStorageConfig

    register("hf", build_hub_storage, config_model=HubStorageConfig,
             description="Hugging Face Hub repositories (hf://owner/repo[@revision]).")
