"""``reasonctl export PATH --to URI``: push an existing export (or checkpoint) to storage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from reasonctl.core.storage import StorageError, describe_local, open_storage


def export_command(
    path: Annotated[Path, typer.Argument(help="An export directory (e.g. RUN/export/final).")],
    to: Annotated[str, typer.Option(
        "--to", help="Target URI: s3://bucket/prefix, hf://owner/repo[@revision], or a path."
    )],
    config: Annotated[list[str] | None, typer.Option(
        "--config", "-c", help="TOML config with [storage.<scheme>] settings; repeatable."
    )] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a key, e.g. --set storage.s3.part_size_mb=128."
    )] = None,
) -> None:
    """Upload ``path`` to ``to`` with the storage plugin of the URI's scheme.

    A directory is uploaded as a tree, a file as one object. A checkpoint directory also
    gets the upload marker, so ``run.resume`` can pull it. Storage settings come from the
    ``[storage.<scheme>]`` sections of ``--config`` files, the environment and ``--set``.
    Raises :class:`~reasonctl.core.storage.StorageError` (exit code 1) when the push fails;
    the local files are never modified.
    """
    from reasonctl.cli import common
    from reasonctl.core.uploads import push

    if not path.exists():
        raise StorageError(f"{path}: no such file or directory to export (cwd: {Path.cwd()})")
    run_config = common.load(config, set_, values={})
    storage = open_storage(common.host().registry, to, run_config)
    files, size = describe_local(path)
    started = time.monotonic()
    push(storage, path, to)
    typer.echo(f"pushed {path} to {to} ({files} file(s), {size / 2**20:.1f} MiB, "
               f"{time.monotonic() - started:.1f} s)")
