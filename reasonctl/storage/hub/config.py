"""``[storage.hf]`` and ``hf://`` addresses: what can be checked without ``huggingface_hub``.

:class:`HubStorageConfig` is the config model of the ``hf`` storage; :func:`parse_hf_uri`
parses an address into a :class:`HubLocation`. The client that uses them is
:mod:`reasonctl.storage.hub.client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.storage import StorageError, parse_uri

REPO_TYPES = {"models": "model", "datasets": "dataset"}
"""URI path prefix -> Hub repository type (a URI without one names a model repository)."""


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

    def uri_problems(self, uri: str) -> list[str]:
        """What is wrong with ``hf://`` address ``uri`` (pre-flight of ``checkpoint.upload``)."""
        _, rest = parse_uri(uri)
        parts = [p for p in rest.split("/") if p]
        if parts and parts[0] in (*REPO_TYPES, "spaces"):
            parts = parts[1:]
        if len(parts) < 2:
            return ["needs a repository; expected hf://owner/repo[/path] (or hf://datasets/...)"]
        return []


@dataclass(frozen=True)
class HubLocation:
    """A parsed ``hf://`` URI."""

    repo_type: str
    repo_id: str
    revision: str | None
    path: str

    def uri(self, path: str) -> str:
        """The ``hf://`` URI of ``path`` in this repository and revision."""
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        rev = f"@{quote(self.revision, safe='')}" if self.revision else ""
        return f"hf://{prefix}{self.repo_id}{rev}/{path}".rstrip("/")


def parse_hf_uri(uri: str) -> HubLocation:
    """Parse ``hf://[datasets/]owner/repo[@revision][/path]``.

    A revision containing ``/`` (``refs/pr/1``) is written URL-encoded (``refs%2Fpr%2F1``).
    """
    scheme, rest = parse_uri(uri)
    parts = [p for p in rest.split("/") if p]
    repo_type = "model"
    if parts and parts[0] in REPO_TYPES:
        repo_type = REPO_TYPES[parts.pop(0)]
    if scheme != "hf" or len(parts) < 2:
        raise StorageError(
            f"{uri!r} is not a Hub URI; expected hf://owner/repo[@revision][/path] "
            "(or hf://datasets/owner/repo...)"
        )
    name, _, revision = parts[1].partition("@")
    return HubLocation(repo_type, f"{parts[0]}/{name}", unquote(revision) or None,
                       "/".join(parts[2:]))
