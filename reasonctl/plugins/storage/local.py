"""Registers the ``file`` storage scheme (local and mounted paths, also plain paths).

The implementation and its config model are in :mod:`reasonctl.storage.local`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_storage(register: Registrar) -> None:
    """Register the ``file`` scheme (also used for plain paths)."""
    from reasonctl.storage.local import LocalStorage, LocalStorageConfig

    register("file", LocalStorage, config_model=LocalStorageConfig,
             description="Local or mounted filesystem paths (file:// or plain paths).")
