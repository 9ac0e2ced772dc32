"""``reasonctl config show|validate|schema``: the resolved config, its checks, its schema.

None of them imports torch, except ``validate`` when the config asks for a CUDA or MPS
device (to see whether one is present).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from reasonctl.cli import common
from reasonctl.cli.common import ConfigOption, SetOption, handle_errors
from reasonctl.core.config import ConfigSources, RunConfig, redact_text
from reasonctl.core.config.schema import drop_none
from reasonctl.core.config.sources import DEFAULT

AlgoOption = Annotated[str | None, typer.Option("--algo", help="algorithm.name")]
BackendOption = Annotated[str | None, typer.Option("--backend", help="backend.name")]
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def config_app() -> typer.Typer:
    """The ``config`` sub-commands."""
    app = typer.Typer(no_args_is_help=True)
    app.command("show")(handle_errors(show))
    app.command("validate")(handle_errors(validate))
    app.command("schema")(handle_errors(schema))
    return app


def show(
    config: ConfigOption = None,
    set_: SetOption = None,
    algo: AlgoOption = None,
    backend: BackendOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of TOML.")] = False,
    with_sources: Annotated[
        bool,
        typer.Option("--sources", help="Mark where each value came from: a file, a REASONCTL_* "
                                       "variable, a flag, a --set, or the default."),
    ] = False,
) -> None:
    """Print the resolved configuration with secrets redacted."""
    cfg, sources = common.load_with_sources(
        config, set_, common.flag_values(algo=algo, backend=backend)
    )
    if as_json and with_sources:
        data = cfg.to_dict(redact=True)
        origins = {_dotted(path): _origin(sources, path) for path, _ in _leaves(drop_none(data))}
        typer.echo(json.dumps({"config": data, "sources": origins}, indent=2))
    elif as_json:
        typer.echo(json.dumps(cfg.to_dict(redact=True), indent=2))
    elif with_sources:
        typer.echo(render_with_sources(cfg, sources))
    else:
        typer.echo(cfg.to_toml(redact=True))


def validate(
    config: ConfigOption = None,
    set_: SetOption = None,
    algo: AlgoOption = None,
    backend: BackendOption = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option("--nproc-per-node", min=1,
                     help="Also check the process layout `reasonctl run --nproc-per-node N` "
                          "would start (the launcher's check)."),
    ] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Number of nodes.")] = 1,
) -> None:
    """Check the configuration and what it needs (files, devices, upload targets and their
    credentials) without running; exit 2 listing every problem. With ``--nproc-per-node``
    the backend's layout on that many processes per node is checked as ``reasonctl run``
    checks it before it starts them."""
    from reasonctl.core.config.loading import InvalidConfigError
    from reasonctl.core.errors import ConfigError
    from reasonctl.runtime.composition import preflight, with_preflight_problems

    common.warn_plugin_errors()
    try:
        cfg = common.load(config, set_, common.flag_values(algo=algo, backend=backend))
    except InvalidConfigError as exc:  # every problem at once: the world's ones too
        raise with_preflight_problems(exc, common.host().registry) from None
    processes = None if nproc_per_node is None else nproc_per_node * nnodes
    if processes is not None and processes > 1 and cfg.backend.name == "single":
        raise ConfigError([f"backend.name: the 'single' backend runs one process, not "
                           f"{processes}; use --backend fsdp (or megatron)"])
    preflight(cfg, common.host().registry, processes=processes, check_access=True)
    layout = f" processes={processes}" if processes is not None else ""
    typer.echo(f"ok: algorithm={cfg.algorithm.name} backend={cfg.backend.name}{layout} "
               f"data={cfg.data.format} output_dir={cfg.run.output_dir}")


def schema() -> None:
    """Print the JSON Schema of the config: plugin sections and reward options included."""
    from reasonctl.core.config import config_json_schema

    typer.echo(json.dumps(config_json_schema(common.host().registry), indent=2))


# --- show --sources ----------------------------------------------------------------------


def render_with_sources(config: RunConfig, sources: ConfigSources) -> str:
    """The redacted config as dotted TOML keys, each followed by ``# <where it came from>``."""
    lines = []
    for path, value in _leaves(drop_none(config.to_dict(redact=True))):
        lines.append(f"{_dotted(path)} = {toml_value(value)}  # {_origin(sources, path)}")
    return "\n".join(lines)


def _leaves(data: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(data, dict) and (data or not prefix):
        for key, value in data.items():
            yield from _leaves(value, (*prefix, str(key)))
    elif not isinstance(data, dict):
        yield prefix, data


def _origin(sources: ConfigSources, path: tuple[str, ...]) -> str:
    return redact_text(sources.source_of(path) or DEFAULT)


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(_key(part) for part in path)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """``value`` as an inline TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + items + "}" if items else "{}"
    return json.dumps(str(value))
