"""``reasonctl worker``: processes that join a run from any node.

``reasonctl worker rollout --redis URL --run ID`` serves a run whose rollouts are generated
by separate workers (``rollout.placement = "separate"``) until the run is done.
"""

from __future__ import annotations

from typing import Annotated

import typer

from reasonctl.cli import common
from reasonctl.cli.common import SetOption, handle_errors


def worker_app() -> typer.Typer:
    """The ``worker`` command group."""
    app = typer.Typer(no_args_is_help=True, add_completion=False,
                      help="Join a run from any node (rollout workers).")
    app.command("rollout")(handle_errors(rollout_command))
    return app


def rollout_command(
    redis: Annotated[str, typer.Option("--redis", help="URL of the run's Redis "
                                       "(redis://host:port/db).")],
    run: Annotated[str, typer.Option("--run", help="The run id the trainer printed.")],
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    name: Annotated[str | None, typer.Option("--name", help="Worker name (default host-pid).")
                    ] = None,
    set_: SetOption = None,
    connect_timeout: Annotated[
        float, typer.Option("--connect-timeout", min=0.1, help="Seconds to reach Redis.")
    ] = 10.0,
) -> None:
    """Generate rollouts for a run with rollout.placement = "separate" until it is done."""
    from reasonctl.async_rl.worker import RolloutWorker

    worker = RolloutWorker.join(redis, run, host=common.host(), device=device, name=name,
                                overrides=list(set_ or []), connect_timeout_s=connect_timeout)
    reason = worker.run()
    common.console.print(f"worker {worker.name}: {worker.batches} prompt batches; {reason}",
                         highlight=False)
