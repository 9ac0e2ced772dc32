"""Storage URIs: ``scheme://rest`` or a plain local path."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://(.*)$", re.DOTALL)


def parse_uri(uri: str) -> tuple[str, str]:
    """Split ``uri`` into ``(scheme, rest)``; a plain path gives ``("file", path)``.

    The scheme is lower-cased. ``file:///abs/path`` gives ``("file", "/abs/path")``.
    """
    match = _SCHEME.match(uri)
    if match is None:
        return "file", uri
    return match.group(1).lower(), match.group(2)


def is_remote(uri: str) -> bool:
    """True when ``uri`` has a scheme other than ``file``."""
    return parse_uri(uri)[0] != "file"


def join_uri(base: str, *parts: str) -> str:
    """``base`` with ``parts`` appended, separated by single slashes."""
    tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
    if not tail:
        return base
    return f"{base.rstrip('/')}/{tail}" if base.rstrip("/") else f"/{tail}"


__all__ = ["is_remote", "join_uri", "parse_uri"]
