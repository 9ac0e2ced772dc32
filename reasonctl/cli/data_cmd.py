"""``reasonctl data check``: read the configured data set once and report its problems."""

from __future__ import annotations

from typing import Annotated

import typer

from reasonctl.cli.common import ConfigOption, SetOption, handle_errors


def data_app() -> typer.Typer:
    """The ``data`` command group."""
    app = typer.Typer(no_args_is_help=True)
    app.command("check")(handle_errors(check_command))
    return app


def check_command(
    config: ConfigOption = None,
    set_: SetOption = None,
    algo: Annotated[
        str | None,
        typer.Option("--algo", help="Encode as this algorithm does (algorithm.name)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Threads reading media files.")
    ] = None,
) -> None:
    """Read every row and media file of the run's data: counts, token lengths, truncations
    and every bad row as file:line: reason. Exits 1 when a row is bad, 2 on config errors."""
    from reasonctl.cli import common
    from reasonctl.core.config.preflight import data_path_problems
    from reasonctl.core.errors import ConfigError
    from reasonctl.data.check import check_data

    cfg = common.load(config, set_, common.flag_values(algo=algo))
    problems = data_path_problems(cfg)
    if problems:  # as `reasonctl run` reports them before it loads anything (exit 2)
        raise ConfigError(problems)
    report = check_data(cfg, common.host().registry, workers=workers)
    for line in report.lines():
        typer.echo(line)
    if not report.ok:
        raise typer.Exit(1)
