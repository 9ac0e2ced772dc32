"""The offline tiny models by name: ``model.name_or_path = "tiny-random"`` (and its
vision-language and diffusers siblings) resolved to a directory created once in the cache
(:mod:`reasonctl.models.tiny`, :mod:`reasonctl.models.tiny_vl`,
:mod:`reasonctl.diffusion.tiny`)."""

from __future__ import annotations

import os

from reasonctl.models.tiny import (
    TINY_ALIAS,
    TINY_VERSION,
    TINY_VL_ALIASES,
    cache_root,
    make_tiny_model_dir,
)


def resolve_tiny_alias(name_or_path: str) -> str:
    """Return a local directory for ``tiny-random``, ``tiny-random-vl`` (Qwen2.5-VL) or
    ``tiny-random-qwen3-vl`` (created once), else the input unchanged.

    ``tiny-random-wan``, ``tiny-random-sd3`` and ``tiny-random-cosmos`` are tiny diffusers
    pipelines (:mod:`reasonctl.diffusion.tiny`).
    """
    if name_or_path.startswith(TINY_ALIAS + "-"):
        from reasonctl.diffusion.tiny import TINY_PIPELINES, resolve_tiny_pipeline

        if name_or_path in TINY_PIPELINES:
            return resolve_tiny_pipeline(name_or_path)
    if name_or_path == TINY_ALIAS:
        make = make_tiny_model_dir
    elif name_or_path in TINY_VL_ALIASES:
        from reasonctl.models import tiny_vl

        make = (tiny_vl.make_tiny_qwen2_5_vl_dir if TINY_VL_ALIASES[name_or_path] == "qwen2_5_vl"
                else tiny_vl.make_tiny_qwen3_vl_dir)
    else:
        return name_or_path
    target = cache_root() / f"{name_or_path}-{TINY_VERSION}"
    if not (target / "config.json").is_file():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        make(tmp)
        if target.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(target)
    return str(target)
