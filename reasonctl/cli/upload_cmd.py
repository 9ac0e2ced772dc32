"""``reasonctl upload OUTPUT_DIR``: push what a run could not upload (``pending-uploads/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from reasonctl.core.errors import ReasonctlError


def upload_command(
    path: Annotated[Path, typer.Argument(
        help="A run's output directory (or a directory under its pending-uploads/).")],
    config: Annotated[list[str] | None, typer.Option(
        "--config", "-c", help="TOML config with [storage.<scheme>] settings; repeatable."
    )] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="Override a key, e.g. --set storage.s3.max_attempts=10."
    )] = None,
) -> None:
    """Push the files a run kept because their upload failed or was cut short.

    Each snapshot under ``pending-uploads/`` goes to the targets its record still lists; a
    snapshot every target has is deleted. Exits 1 when something is still missing.
    """
    from reasonctl.cli import common
    from reasonctl.core.pending_uploads import find_pending, push_pending
    from reasonctl.core.uploads import push

    if not path.exists():
        raise ReasonctlError(f"{path}: no such directory (cwd: {Path.cwd()})")
    if not find_pending(path):
        typer.echo(f"nothing to upload under {path}")
        return
    run_config = common.load(config, set_, values={})
    missing = push_pending(common.host().registry, run_config, path, push=push,
                           log=lambda line: typer.echo(line, err=True))
    if missing:
        listing = "\n".join(f"  - {line}" for line in missing)
        raise ReasonctlError(f"{len(missing)} upload(s) still missing:\n{listing}\nThe files "
                             "are kept; run the command again once the target is reachable")
    typer.echo("every pending upload is done")
