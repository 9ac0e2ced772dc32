"""Shared pieces of the CLI: options, config loading, error handling, the plugin host."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape

from reasonctl.core.config import (
    ConfigSources,
    RunConfig,
    format_validation_errors,
    load_config_with_sources,
    redact_text,
)
from reasonctl.core.errors import (
    ComponentUnavailableError,
    ConfigError,
    ReasonctlError,
    UsageError,
)
from reasonctl.core.plugins import PluginHost

console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])

ConfigOption = Annotated[
    list[str] | None,
    typer.Option("--config", "-c", help="TOML config file; repeat to deep-merge (later wins)."),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key: --set train.lr=1e-5 (TOML literal)."),
]

_host: PluginHost | None = None


def init_host(*, strict: bool) -> PluginHost:
    """Load plugins once per CLI invocation."""
    global _host
    _host = PluginHost.load(strict=strict)
    return _host


def host() -> PluginHost:
    """The CLI's plugin host (loaded on first use)."""
    return _host if _host is not None else init_host(strict=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print an error and exit with ``code``."""
    console.print(f"[red]error:[/] {escape(redact_text(message))}", highlight=False,
                  soft_wrap=True)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print a warning (secrets redacted) and go on."""
    console.print(f"[yellow]warning:[/] {escape(redact_text(message))}", highlight=False,
                  soft_wrap=True)


def warn_plugin_errors() -> None:
    """Warn about every plugin that failed to load (its components are missing)."""
    for record in host().errors:
        warn(f"{record.error} (skipped; `reasonctl plugins --all` shows why)")
    for line in host().shadow_warnings():
        warn(line.removeprefix("warning: "))


def handle_errors(func: F) -> F:
    """Map exceptions to exit codes: config/usage errors 2, run failures 1.

    Config problems never print a traceback; an unexpected error prints one, redacted.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except (ConfigError, ComponentUnavailableError, UsageError) as exc:
            fail(str(exc), code=2)
        except ValidationError as exc:  # a component validating its own options late
            lines = "\n".join(f"  - {p}" for p in format_validation_errors(exc, BaseModel))
            fail(f"Invalid {exc.title} options:\n{lines}", code=2)
        except ReasonctlError as exc:
            fail(str(exc), code=1)
        except KeyboardInterrupt:
            fail("interrupted", code=130)
        except Exception as exc:
            trace = "".join(traceback.format_exception(exc))
            console.print(redact_text(trace), markup=False, highlight=False, soft_wrap=True)
            fail(f"{type(exc).__name__}: {exc}", code=1)

    return wrapper  # type: ignore[return-value]


def install_redacting_excepthooks() -> None:
    """Print uncaught exceptions (main thread and other threads) with secrets redacted.

    :func:`handle_errors` covers the commands; these hooks cover what escapes them (plugin
    loading, Typer itself, background threads).
    """
    import threading

    def print_redacted(exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(redact_text(text))
        sys.stderr.flush()

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        sys.stderr.write(f"Exception in thread {name}:\n")
        print_redacted(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = print_redacted
    threading.excepthook = thread_hook


def flag_values(**flags: Any) -> dict[str, Any]:
    """Map CLI flags onto config keys (unset flags are left out)."""
    values: dict[str, Any] = {}
    if flags.get("algo"):
        values.setdefault("algorithm", {})["name"] = flags["algo"]
    if flags.get("backend"):
        values.setdefault("backend", {})["name"] = flags["backend"]
    if flags.get("output_dir"):
        values.setdefault("run", {})["output_dir"] = flags["output_dir"]
    if flags.get("resume"):
        values.setdefault("run", {})["resume"] = True
    if flags.get("resume_with_changes"):
        values.setdefault("run", {})["resume_with_changes"] = True
    return values


def load(config: list[str] | None, set_: list[str] | None, values: dict[str, Any]) -> RunConfig:
    """Load and validate the config for a command (``--set`` > flags > environment > files)."""
    return load_with_sources(config, set_, values)[0]


def load_with_sources(
    config: list[str] | None, set_: list[str] | None, values: dict[str, Any]
) -> tuple[RunConfig, ConfigSources]:
    """:func:`load`, also returning where each value came from; a ``--set`` or variable
    for a backend the run does not use is a problem (it would be ignored)."""
    from reasonctl.core.config.unused_settings import unused_backend_settings

    loaded = load_config_with_sources(config or [], set_ or [], registry=host().registry,
                                      values=values, on_warning=warn)
    problems = unused_backend_settings(loaded[1], host().registry)
    if problems:
        raise ConfigError(problems)
    return loaded


def inside_launcher() -> bool:
    """True in a worker started by a launcher (``--nproc-per-node``, torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def forwarded_run_args(
    algo: str | None,
    backend: str | None,
    config: list[str] | None,
    set_: list[str] | None,
    output_dir: str | None,
    resume: bool,
    resume_with_changes: bool = False,
) -> list[str]:
    """The ``reasonctl run`` arguments each launched worker receives."""
    args = ["run"]
    if algo:
        args += ["--algo", algo]
    if backend:
        args += ["--backend", backend]
    for path in config or []:
        args += ["--config", path]
    for item in set_ or []:
        args += ["--set", item]
    if output_dir:
        args += ["--output-dir", output_dir]
    if resume:
        args.append("--resume")
    if resume_with_changes:
        args.append("--resume-with-changes")
    if "--strict-plugins" in sys.argv:
        args.insert(0, "--strict-plugins")
    return args


def report_result(result: Any) -> None:
    """Print the end-of-run summary and exit non-zero when uploads failed."""
    if os.environ.get("RANK", "0") != "0":
        return
    lines = [f"run {result.status}: {result.steps} steps, outputs in {result.output_dir}"]
    if result.export_dir:
        lines.append(f"exported model: {result.export_dir}")
    if result.skipped_rows:
        lines.append(f"skipped {result.skipped_rows} malformed data rows (data.on_bad_row=skip); "
                     f"each is listed in {result.output_dir / 'skipped_rows.jsonl'}")
    if result.nonfinite_steps:
        lines.append(f"skipped {result.nonfinite_steps} steps with a non-finite loss or "
                     "gradient norm (train.on_nonfinite=skip)")
    for line in lines:
        console.print(line, highlight=False)
    if result.upload_failures:
        for failure in result.upload_failures:
            console.print(f"[red]upload failed:[/] {escape(redact_text(failure))}",
                          highlight=False)
        fail("training finished but some uploads failed; the local copies listed above are "
             f"intact — push them later with `reasonctl upload {result.output_dir}`", code=1)
