"""The plugin contract: every hook a reasonctl plugin may implement.

A plugin is any module or object with functions decorated by ``reasonctl.hookimpl`` whose
names match the specs below. Installable plugins declare an entry point in the group
``reasonctl``::

    [project.entry-points.reasonctl]
    my_plugin = "my_package.plugin"

Component hooks receive a ``register`` callable bound to the calling plugin, so every
component records its owner. Its signature is::

    register(name, factory, *, config_model=None, description="")

``factory`` builds the component; it is called with the component's validated config
(an instance of ``config_model``, or ``None`` without one). ``config_model`` is a pydantic
model; its fields become the typed config section of the component (``[algorithm.<name>]``,
``[backend.<name>]``, ``[data.<name>]``, ``[rollout.<name>]``, ``[logging.<name>]``, extra
keys of a ``[[rewards]]`` entry, ``[storage.<name>]``). Registering a name that another
plugin already registered for the same kind is an error naming both plugins.

Implementations may accept fewer arguments than a spec lists: pluggy passes arguments by
name, so new arguments can be added to a spec without breaking existing plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    from reasonctl.core.context import RunContext
    from reasonctl.core.registry import Registrar
    from reasonctl.core.types import Metrics

hookspec = pluggy.HookspecMarker("reasonctl")


# --- components -------------------------------------------------------------------------


@hookspec
def register_datasets(register: Registrar) -> None:
    """Register dataset formats (``data.format``).

    The factory is called with the format's config and returns a
    :class:`~reasonctl.core.protocols.Dataset`. Example::

        register("csv_qa", CsvQaDataset, config_model=CsvQaConfig)
    """


@hookspec
def register_rewards(register: Registrar) -> None:
    """Register reward functions (``[[rewards]] name = ...``).

    The factory is called with the reward's config (the extra keys of its ``[[rewards]]``
    entry, validated by ``config_model``) and returns a batched
    :class:`~reasonctl.core.protocols.Reward`.
    """


@hookspec
def register_algorithms(register: Registrar) -> None:
    """Register training algorithms (``--algo`` / ``algorithm.name``).

    The factory returns an :class:`~reasonctl.core.protocols.Algorithm`; its
    ``config_model`` is validated under ``[algorithm.<name>]``.
    """


@hookspec
def register_backends(register: Registrar) -> None:
    """Register parallelism backends (``--backend`` / ``backend.name``).

    The factory returns a :class:`~reasonctl.core.protocols.Backend`; its ``config_model``
    is validated under ``[backend.<name>]``.
    """


@hookspec
def register_storage(register: Registrar) -> None:
    """Register storage by URI scheme (``file``, ``s3``, ``hf`` ...).

    The registered name is the scheme; the factory returns a
    :class:`~reasonctl.core.protocols.Storage`.
    """


@hookspec
def register_rollout_engines(register: Registrar) -> None:
    """Register rollout engines (``rollout.engine``).

    The factory is called with the engine's config and returns a
    :class:`~reasonctl.core.protocols.RolloutEngine` after ``engine.setup(ctx, model)``.
    """


@hookspec
def register_loggers(register: Registrar) -> None:
    """Register metric loggers (``logging.loggers = [...]``).

    The factory is called with the logger's config and the run context and returns a
    :class:`~reasonctl.core.protocols.Logger`.
    """


@hookspec
def register_commands(app: Any) -> None:
    """Add CLI commands to the ``reasonctl`` Typer application.

    ``app`` is a ``typer.Typer``. Add commands with ``@app.command()`` or a sub-app with
    ``app.add_typer(sub, name=...)``; they are listed under a "Plugins" help panel. Keep
    heavy imports inside the command bodies so ``reasonctl --help`` stays fast.
    """


# --- lifecycle ----------------------------------------------------------------------------


@hookspec
def on_run_start(ctx: RunContext) -> None:
    """Called on every rank once components are built, before the first step."""


@hookspec
def on_step_end(ctx: RunContext, step: int, metrics: Metrics) -> None:
    """Called on every rank after each optimisation step with that step's metrics."""


@hookspec
def on_checkpoint_saved(ctx: RunContext, step: int, path: Path) -> None:
    """Called on the main rank after a complete checkpoint directory was written."""


@hookspec
def on_run_end(ctx: RunContext, status: str, error: BaseException | None) -> None:
    """Called on every rank when the run ends.

    ``status`` is ``"completed"``, ``"interrupted"`` (signal; a checkpoint was saved) or
    ``"failed"`` (``error`` holds the exception).
    """
