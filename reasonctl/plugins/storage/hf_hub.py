"""Hugging Face Hub storage: ``hf://owner/repo[@revision][/path]``.

``hf://datasets/owner/repo/...`` addresses a dataset repository. The repository (and the
branch named by ``@revision``) is created on first upload. The token comes from
``HF_TOKEN`` or the cached ``hf auth login``; it is never part of the config and never
printed. ``huggingface_hub`` is imported only when an ``hf://`` URI is used
(``pip install 'reasonctl[hub]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from reasonctl import hookimpl
from reasonctl.core.registry import Registrar

if TYPE_CHECKING:
    from reasonctl.plugins.storage.hf_client import HubStorage


class HubStorageConfig(BaseModel):
    """``[storage.hf]``: Hugging Face Hub uploads and downloads."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        default=None, description="Hub URL (default: HF_ENDPOINT or https://huggingface.co)."
    )
    private: bool = Field(
        default=True, description="Create missing repositories as private."
    )
    revision: str = Field(
        default="main", description="Branch used when the URI has no @revision."
    )
    commit_message: str = Field(
        default="Upload {path} with reasonctl",
        description="Commit message; {path} is replaced by the uploaded path in the repo.",
    )
    max_attempts: int = Field(default=5, gt=0, description="Attempts per operation.")
    backoff_s: float = Field(
        default=2.0, ge=0, description="First retry delay in seconds; doubles every attempt."
    )


def build_hub_storage(config: HubStorageConfig | None) -> HubStorage:
    """Create a :class:`~reasonctl.plugins.storage.hf_client.HubStorage` (imports the client)."""
    from reasonctl.plugins.storage.hf_client import HubStorage

    return HubStorage(config or HubStorageConfig())


@hookimpl
def register_storage(register: Registrar) -> None:
    """Register the ``hf`` scheme."""
    register("hf", build_hub_storage, config_model=HubStorageConfig,
             description="Hugging Face Hub repositories (hf://owner/repo[@revision]).")
