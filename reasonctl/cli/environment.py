"""What ``reasonctl env`` reports: versions, devices and importable extras."""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata
from typing import Any

from reasonctl.core.errors import install_command

EXTRAS = {
    "video": "av",
    "datasets": "datasets",
    "s3": "boto3",
    "hub": "huggingface_hub",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "megatron": "megatron.core",
    "vllm": "vllm",
}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def collect_environment() -> dict[str, Any]:
    """Versions of Python and key packages, CUDA devices, and which extras import."""
    info: dict[str, Any] = {
        "reasonctl": _version("reasonctl"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("torch", "transformers", "pydantic", "pluggy")},
        "extras": {extra: ("yes" if _importable(mod) else f"no ({install_command(extra)})")
                   for extra, mod in EXTRAS.items()},
    }
    try:
        import torch

        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = {"available": torch.cuda.is_available(), "version": torch.version.cuda,
                        "devices": ", ".join(devices) or "none"}
    except ImportError:
        info["cuda"] = {"available": False, "version": None, "devices": "torch not installed"}
    return info
