"""The plugin contract: every hook a reasonctl plugin may implement.

A plugin is any module or object with functions decorated by ``reasonctl.hookimpl`` whose
names match the specs below. Installable plugins declare an entry point in the group
``reasonctl``::

    [project.entry-points.reasonctl]
    my_plugin = "my_package.plugin"

Component hooks receive a ``register`` callable bound to the calling plugin, so every
component records its owner. Its signature is::

    register(name, factory, *, config_model=None, description="")

``config_model`` is a pydantic model; its fields become the typed config section of the
component (``[algorithm.<name>]``, ``[backend.<name>]``, ``[data.<name>]``,
``[rollout.<name>]``, ``[logging.<name>]``, ``[storage.<name>]``,
``[environment.<name>]``, or the extra keys of a
``[[rewards.components]]`` entry); unknown keys are rejected even when the model allows
extras. ``description`` defaults to the first line of the factory's docstring.

Every factory has the same signature, checked when it is registered::

    factory(config)              # or
    factory(config, *, ctx)      # opt-in: also receives the run's RunContext

``config`` is the validated instance of ``config_model`` (``None`` without one); ``ctx`` is
the :class:`~reasonctl.core.protocols.RunContext` of the run. Outside a run (a reward scored
by ``reasonctl rewards``-style tooling, a storage opened to upload an export, a component
built by ``reasonctl.testing.build_component`` without a context) a factory that takes
``ctx`` receives ``ctx=None``. The object returned must satisfy the kind's Protocol in
:mod:`reasonctl.core.protocols`; it is checked when built. Two plugins registering one name
for one kind make the name unavailable until one is disabled.

Implementations may accept fewer arguments than a spec lists: pluggy passes arguments by
name, so new arguments can be added to a spec without breaking existing plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    from reasonctl.core.protocols import RunContext
    from reasonctl.core.registry import Registrar
    from reasonctl.core.types import Metrics

hookspec = pluggy.HookspecMarker("reasonctl")


# --- components -------------------------------------------------------------------------


@hookspec
def register_datasets(register: Registrar) -> None:
    """Register dataset formats (``data.format``).

    The factory returns a :class:`~reasonctl.core.protocols.Dataset` (or a streamed
    :class:`~reasonctl.core.protocols.StreamsSamples`); its ``config_model``
    is validated under ``[data.<name>]``. Take ``ctx`` to read ``ctx.config.data.on_bad_row``
    (the runner applies ``max_samples``, ``system_prompt`` and ``prompt_template`` to every
    format). Example::

        register("csv_qa", CsvQaDataset, config_model=CsvQaConfig)
    """


@hookspec
def register_rewards(register: Registrar) -> None:
    """Register reward functions (``[[rewards.components]] name = ...``).

    The factory is called with the reward's config (the extra keys of its
    ``[[rewards.components]]`` entry, validated by ``config_model``) and returns a batched
    :class:`~reasonctl.core.protocols.Reward`.
    """


@hookspec
def register_algorithms(register: Registrar) -> None:
    """Register training algorithms (``--algo`` / ``algorithm.name``).

    The factory returns an :class:`~reasonctl.core.protocols.Algorithm`; its
    ``config_model`` is validated under ``[algorithm.<name>]``. The algorithm declares the
    parts it uses with ``needs()`` (:class:`~reasonctl.core.protocols.Needs`); the runner
    builds them before calling ``setup``.
    """


@hookspec
def register_backends(register: Registrar) -> None:
    """Register parallelism backends (``--backend`` / ``backend.name``).

    The factory returns a :class:`~reasonctl.core.protocols.Backend`; its ``config_model``
    is validated under ``[backend.<name>]``. The runner calls ``backend.setup(ctx)`` before
    building anything else.
    """


@hookspec
def register_storage(register: Registrar) -> None:
    """Register storage by URI scheme (``file``, ``s3``, ``hf`` ...).

    The registered name is the scheme; the factory returns a
    :class:`~reasonctl.core.protocols.Storage`; its ``config_model`` is validated under
    ``[storage.<scheme>]``.
    """


@hookspec
def register_rollout_engines(register: Registrar) -> None:
    """Register rollout engines (``rollout.engine``).

    The factory takes ``ctx`` (the backend is set up and ``ctx.model_source`` resolved) and
    returns a :class:`~reasonctl.core.protocols.RolloutEngine` ready to generate; its
    ``config_model`` is validated under ``[rollout.<name>]``. The runner builds the engine
    for algorithms that need one and for periodic evaluation; ``reasonctl eval`` builds it
    the same way.
    """


@hookspec
def register_loggers(register: Registrar) -> None:
    """Register metric loggers (``logging.loggers = [...]``).

    The factory takes ``ctx`` (for ``ctx.output_dir`` and the config) and returns a
    :class:`~reasonctl.core.protocols.Logger`; loggers are built on the main rank only.
    """


@hookspec
def register_environments(register: Registrar) -> None:
    """Register environments for multi-turn episodes with tools (``[environment] name``).

    The factory returns an :class:`~reasonctl.core.protocols.Environment`; its
    ``config_model`` is validated under ``[environment.<name>]``. For each completion it
    samples, a rollout starts an episode (``environment.start(sample)``); the policy
    generates until its turn ends, the episode answers with an observation whose tokens
    are appended to the same sequence without loss, until the episode is done or
    ``environment.max_turns`` is reached. Example::

        register("shell_game", ShellGame, config_model=ShellGameConfig)
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
