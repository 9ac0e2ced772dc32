"""The ``reasonctl`` command line.

Commands import heavy packages (torch, transformers) inside their bodies, so ``--help``,
``plugins`` and ``config`` stay fast. Exit codes: 0 success, 1 run failure, 2 usage or
configuration error.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.markup import escape

from reasonctl.cli import common
from reasonctl.cli.common import ConfigOption, SetOption, console, fail, handle_errors
from reasonctl.cli.config_cmd import config_app
from reasonctl.cli.data_cmd import data_app
from reasonctl.cli.eval_cmd import eval_command
from reasonctl.cli.export_cmd import export_command
from reasonctl.cli.infer_cmd import infer_command
from reasonctl.cli.plugins_cmd import plugins_command
from reasonctl.cli.rewards_cmd import rewards_app
from reasonctl.cli.serve_rewards_cmd import serve_rewards_command
from reasonctl.cli.upload_cmd import upload_command
from reasonctl.cli.worker_cmd import worker_app
from reasonctl.core.config import redact_text
from reasonctl.core.plugins import PluginHost, env_flag

PLUGINS_PANEL = "Plugins"


def _version_callback(value: bool) -> None:
    if not value:
        return
    from importlib import metadata

    from reasonctl import __version__

    typer.echo(f"reasonctl {__version__}")
    host = common.host()
    dists = sorted({(r.distribution, r.version) for r in host.records if r.distribution})
    for dist, version in dists:
        if dist != "reasonctl":
            typer.echo(f"  plugin distribution: {dist} {version}")
    typer.echo(f"  python {sys.version.split()[0]}, pydantic {metadata.version('pydantic')}, "
               f"pluggy {metadata.version('pluggy')}")
    raise typer.Exit()


def build_app(host: PluginHost) -> typer.Typer:
    """The Typer application with built-in and plugin commands."""
    app = typer.Typer(
        name="reasonctl",
        help="Post-train reasoning models: SFT and GRPO-family RL, extensible with plugins.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
    )

    @app.callback()
    def root(
        version: Annotated[
            bool,
            typer.Option("--version", callback=_version_callback, is_eager=True,
                         help="Show the version and installed plugin distributions."),
        ] = False,
        strict_plugins: Annotated[
            bool,
            typer.Option("--strict-plugins",
                         help="Fail when any plugin cannot be loaded "
                              "(also REASONCTL_STRICT_PLUGINS=1)."),
        ] = False,
    ) -> None:
        """reasonctl: post-training for reasoning models."""

    app.command("run")(run_command)
    app.command("plugins")(plugins_command)
    app.add_typer(config_app(), name="config", help="Show, validate or describe the config.")
    app.add_typer(data_app(), name="data", help="Check the configured data set.")
    app.command("env")(env_command)
    app.command("eval")(handle_errors(eval_command))
    app.command("infer")(handle_errors(infer_command))
    app.command("export")(handle_errors(export_command))
    app.add_typer(rewards_app(), name="rewards", help="Score completions with a config's rewards.")
    app.command("upload")(handle_errors(upload_command))
    app.command("serve-rewards")(serve_rewards_command)
    app.add_typer(worker_app(), name="worker", help="Join a run from any node (rollout workers).")
    _add_plugin_commands(app, host)
    return app


def _add_plugin_commands(app: typer.Typer, host: PluginHost) -> None:
    plugin_app = typer.Typer()
    host.add_commands(plugin_app)
    for command in plugin_app.registered_commands:
        command.rich_help_panel = PLUGINS_PANEL
        app.registered_commands.append(command)
    for group in plugin_app.registered_groups:
        group.rich_help_panel = PLUGINS_PANEL
        app.registered_groups.append(group)


# --- run -----------------------------------------------------------------------------------


@handle_errors
def run_command(
    algo: Annotated[str | None, typer.Option("--algo", help="Algorithm (algorithm.name).")] = None,
    backend: Annotated[
        str | None, typer.Option("--backend", help="Parallelism backend (backend.name).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="run.output_dir (used exactly as given).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Resume from the newest complete checkpoint.")
    ] = False,
    resume_with_changes: Annotated[
        bool, typer.Option("--resume-with-changes",
                           help="Resume even if settings changed since the checkpoint: print "
                                "the changes and apply them (run.resume_with_changes).")
    ] = False,
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", min=1, help="Processes per node.")
    ] = 1,
    nnodes: Annotated[
        str, typer.Option("--nnodes", help="Nodes: N, or MIN:MAX for an elastic run.")
    ] = "1",
    node_rank: Annotated[
        int | None, typer.Option("--node-rank", min=0,
                                 help="This node's rank (multi-node; 0 holds the output lock).")
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous (multi-node).")
    ] = None,
    rdzv_id: Annotated[
        str | None, typer.Option("--rdzv-id", help="Rendezvous id, the same on every node "
                                 "(default: from the output directory).")
    ] = None,
    rdzv_timeout: Annotated[
        int, typer.Option("--rdzv-timeout", min=1, help="Seconds to wait for the nodes.")
    ] = 900,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", min=0, help="Restarts of the worker group after "
                          "a failure (each resumes from the newest checkpoint).")
    ] = 0,
) -> None:
    """Train: SFT, GRPO or any installed algorithm, as configured."""
    from reasonctl.core.config.loading import InvalidConfigError

    values = common.flag_values(algo=algo, backend=backend, output_dir=output_dir, resume=resume,
                                resume_with_changes=resume_with_changes)
    try:
        cfg = common.load(config, set_, values)
    except InvalidConfigError as exc:  # every problem at once: the world's ones too
        if common.inside_launcher():
            raise
        from reasonctl.runtime.composition import with_preflight_problems

        raise with_preflight_problems(exc, common.host().registry) from None
    if common.inside_launcher():  # a worker: the launcher checked the flags and layout
        from reasonctl.cli.launched import prepare_worker

        prepare_worker(cfg)
    else:
        from reasonctl.cli.launch_plan import plan_launch
        from reasonctl.runtime.composition import preflight

        plan = plan_launch(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                           max_restarts=max_restarts, rdzv_timeout_s=rdzv_timeout,
                           output_dir=cfg.run.output_dir)
        counts = plan.process_counts()
        if max(counts) > 1 and cfg.backend.name == "single":
            fail("the 'single' backend runs one process; use --backend fsdp (or megatron) with "
                 "--nproc-per-node > 1", code=2)
        for processes in counts:  # the layout of every process count the run may have
            preflight(cfg, common.host().registry, processes=processes)
        if max(counts) > 1 or plan.max_restarts > 0:
            from reasonctl.cli.launch import launch_workers

            forwarded = common.forwarded_run_args(algo, backend, config, set_, output_dir,
                                                  resume, resume_with_changes)
            raise typer.Exit(launch_workers(forwarded, plan, output_dir=cfg.run.output_dir))
    from reasonctl.runtime.runner import run

    result = run(cfg, host=common.host())
    common.report_result(result)


# --- env -----------------------------------------------------------------------------------


@handle_errors
def env_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show versions, CUDA devices and which optional extras are importable."""
    from reasonctl.cli.environment import collect_environment

    info = collect_environment()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if isinstance(value, dict):
            typer.echo(f"{key}:")
            for sub, val in value.items():
                typer.echo(f"  {sub}: {val}")
        elif isinstance(value, list):
            typer.echo(f"{key}: {', '.join(map(str, value)) or 'none'}")
        else:
            typer.echo(f"{key}: {value}")


def main() -> None:
    """Console-script entry point."""
    from reasonctl.cli.launch import exit_quickly_after_launch

    common.install_redacting_excepthooks()
    strict = "--strict-plugins" in sys.argv[1:] or env_flag("REASONCTL_STRICT_PLUGINS")
    try:
        host = common.init_host(strict=strict)
    except Exception as exc:  # strict mode: a broken plugin is fatal
        console.print(f"[red]error:[/] {escape(redact_text(str(exc)))}", highlight=False)
        sys.exit(1)
    app = build_app(host)
    with exit_quickly_after_launch():
        app()
