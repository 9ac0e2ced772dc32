"""Composes a run from the config and drives the step loop.

The runner is the only composer. In one pass, top to bottom, it builds the backend and the
algorithm, sets the backend up (process group, model, optimizer), asks the algorithm what
it needs (:class:`~reasonctl.core.protocols.Needs`) and builds those parts into the
:class:`~reasonctl.core.protocols.RunContext` (:mod:`reasonctl.core.composition`: the
processor, dataset, reward set, reference model, rollout engine and evaluator), then calls
``algorithm.setup``, restores the newest checkpoint when resuming, runs ``algorithm.step``
until ``ctx.total_steps`` (evaluating every ``eval.every_steps``), sends metrics to loggers,
saves checkpoints, handles SIGTERM/SIGUSR1/SIGINT by saving and exiting, and exports the
final model. It knows nothing about models or ranks beyond what the backend tells it.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasonctl.core.checkpoint import CheckpointManager, load_rng_state, read_checkpoint
from reasonctl.core.composition import build_algorithm, build_backend, build_component, compose
from reasonctl.core.config import RunConfig, redact_text
from reasonctl.core.errors import ReasonctlError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import Algorithm, Closes, Logger, RunContext, algorithm_needs
from reasonctl.core.types import Metrics

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


@dataclass
class RunResult:
    """What a finished run produced."""

    status: str
    output_dir: Path
    steps: int
    last_metrics: Metrics = field(default_factory=dict)
    export_dir: Path | None = None
    checkpoint_dir: Path | None = None
    upload_failures: list[str] = field(default_factory=list)
    skipped_rows: int = 0


class StopRequest:
    """Records a stop signal; the loop checks it between steps."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._interrupts = 0

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT":
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self.signal_name = name

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signal_name is not None


@contextmanager
def stop_signals(handler: StopRequest) -> Iterator[None]:
    """Install ``handler`` for the stop signals (main thread only), restoring afterwards."""
    previous: dict[int, Any] = {}
    try:
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not in the main thread: leave signals alone
                break
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def env_rank() -> int:
    """This process's global rank from the launcher's environment (0 when not launched)."""
    import os

    return int(os.environ.get("RANK", "0"))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def config_hash(config: RunConfig) -> str:
    """A short hash of the config that determines training (``run`` section excluded)."""
    data = config.to_dict(redact=False)
    data.pop("run", None)
    data.pop("logging", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def run(config: RunConfig, *, host: PluginHost, progress: bool = True) -> RunResult:
    """Run training as configured and return a :class:`RunResult`.

    ``host`` holds the plugins, loaded once by the caller (the CLI, or :func:`reasonctl.run`,
    which adds run-local plugins to it first).
    """
    registry = host.registry
    output_dir = Path(config.run.output_dir)
    is_main = env_rank() == 0
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.toml").write_text(config.to_toml(redact=True))
    seed_everything(config.run.seed)

    ctx = RunContext(config=config, registry=registry, hooks=host.hooks, output_dir=output_dir)
    for record in host.errors:
        ctx.info(f"warning: {record.error} (skipped; see `reasonctl plugins`)")
    backend = ctx.backend = build_backend(ctx)
    algorithm = build_algorithm(ctx)
    needs = algorithm_needs(algorithm, config.component_config("algorithm", config.algorithm.name))
    loggers: list[Logger] = []
    status, error = "failed", None
    result = RunResult(status="failed", output_dir=output_dir, steps=0)
    uploader = None
    try:
        backend.setup(ctx)
        ctx.checkpoints = CheckpointManager(
            output_dir / "checkpoints",
            keep=config.checkpoint.keep,
            is_main=backend.is_main,
            barrier=backend.barrier,
            rank=env_rank(),
        )
        if config.checkpoint.upload and backend.is_main:
            from reasonctl.core.uploads import Uploader

            uploader = Uploader(registry, config, output_dir)
        if config.run.resume and uploader is not None:
            uploader.pull_latest_checkpoint_if_missing(ctx.checkpoints)
        backend.barrier()
        compose(ctx, needs)
        algorithm.setup(ctx)
        _maybe_resume(ctx, algorithm)
        if backend.is_main and progress:
            loggers = _build_loggers(ctx)
        host.hooks.on_run_start(ctx)
        result.last_metrics = _loop(ctx, algorithm, loggers, uploader)
        ctx.checkpoints.wait()  # a checkpoint still being written is committed now
        status = "interrupted" if ctx.stop_signal else "completed"
        result.checkpoint_dir = ctx.checkpoints.last_committed
        if status == "completed" and config.checkpoint.export_final:
            result.export_dir = _export(ctx, output_dir / "export" / "final", uploader)
    except BaseException as exc:
        error = exc
        raise
    finally:
        result.status = status if error is None else "failed"
        result.steps = ctx.step
        result.skipped_rows = ctx.skipped_rows
        if uploader is not None:
            result.upload_failures = uploader.finish()
        for logger in loggers:
            logger.close()
        host.hooks.on_run_end(ctx, result.status, error)
        for part in (algorithm, ctx.engine):
            if isinstance(part, Closes):
                part.close()
        backend.close()
    return result


def _maybe_resume(ctx: RunContext, algorithm: Algorithm) -> None:
    resume = ctx.config.run.resume
    if not resume or ctx.checkpoints is None or ctx.backend is None:
        return
    if isinstance(resume, str):
        info = read_checkpoint(Path(resume))
    else:
        info = ctx.checkpoints.latest()
        for torn in ctx.checkpoints.torn:
            ctx.info(f"skipping incomplete checkpoint {torn}")
        if info is None:
            ctx.info("run.resume: no complete checkpoint found; starting from scratch")
            return
    ctx.info(f"resuming from {info.path} (step {info.step})")
    ctx.backend.load_checkpoint(info.path / "state")
    algorithm.load_state_dict(info.manifest.get("algorithm", {}))
    if not load_rng_state(info.path / f"rng_rank{env_rank()}.pt"):
        load_rng_state(info.path / "rng_rank0.pt")
    ctx.step = info.step


def _build_loggers(ctx: RunContext) -> list[Logger]:
    return [build_component(ctx, "logger", "logging", name) for name in ctx.config.logging.loggers]


def _loop(ctx: RunContext, algorithm: Algorithm, loggers: list[Logger], uploader: Any) -> Metrics:
    assert ctx.backend is not None and ctx.checkpoints is not None
    config = ctx.config
    stop = StopRequest()
    metrics: Metrics = {}
    every = config.checkpoint.every_steps
    with stop_signals(stop):
        while ctx.step < ctx.total_steps:
            started = time.perf_counter()
            metrics = dict(algorithm.step(ctx))
            ctx.step += 1
            metrics.setdefault("step_time_s", time.perf_counter() - started)
            if ctx.evaluator is not None and ctx.step % config.eval.every_steps == 0:
                metrics.update(ctx.evaluator.evaluate(ctx))
            ctx.hooks.on_step_end(ctx, ctx.step, metrics)
            if ctx.step % config.logging.every_steps == 0 or ctx.step == ctx.total_steps:
                for logger in loggers:
                    logger.log(metrics, ctx.step)
            stop_now = _agreed_stop(ctx, stop)
            on_signal = stop_now and config.run.on_signal == "checkpoint"
            ctx.checkpoints.poll()
            if (every and ctx.step % every == 0) or on_signal:
                _save_checkpoint(ctx, algorithm, uploader)
            if stop_now:
                ctx.stop_signal = stop.signal_name or "signal"
                ctx.info(f"stopping at step {ctx.step} on {ctx.stop_signal}")
                break
    return metrics


def _agreed_stop(ctx: RunContext, stop: StopRequest) -> bool:
    """Whether any process received a stop signal (all processes must agree to stop).

    Agreement spans every process of the job, not just data-parallel ranks: tensor- or
    pipeline-parallel peers must stop at the same step too.
    """
    import torch
    import torch.distributed as dist

    requested = stop.requested
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return requested
    assert ctx.backend is not None
    device = ctx.backend.device if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1.0 if requested else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _save_checkpoint(ctx: RunContext, algorithm: Algorithm, uploader: Any) -> Path | None:
    """Save (or, with ``checkpoint.async_save``, start saving) a checkpoint of this step."""
    assert ctx.backend is not None and ctx.checkpoints is not None
    manifest = {
        "config_hash": config_hash(ctx.config),
        "algorithm": algorithm.state_dict(),
        "world_size": ctx.backend.world_size,
    }
    backend, step = ctx.backend, ctx.step
    asynchronous = ctx.config.checkpoint.async_save

    def write_state(directory: Path) -> Any:
        if asynchronous:
            return backend.save_checkpoint(directory, asynchronous=True)
        backend.save_checkpoint(directory)
        return None

    def committed(path: Path) -> None:  # on the main rank
        ctx.hooks.on_checkpoint_saved(ctx, step, path)
        if uploader is not None and ctx.config.checkpoint.upload_when == "every":
            uploader.submit(path, f"checkpoints/{path.name}")

    def export_into(directory: Path) -> None:
        _export(ctx, directory / "export", None)

    return ctx.checkpoints.save(
        step, write_state, manifest, on_commit=committed if ctx.is_main else None,
        before_state=export_into if ctx.config.checkpoint.export_every_checkpoint else None,
    )


def _export(ctx: RunContext, directory: Path, uploader: Any) -> Path:
    assert ctx.backend is not None
    ctx.backend.export(directory)
    ctx.backend.barrier()
    if ctx.is_main:
        ctx.info(f"exported model to {directory}")
        if uploader is not None:
            uploader.submit(directory, str(directory.relative_to(ctx.output_dir)))
    return directory


def format_error(exc: BaseException) -> str:
    """A one-paragraph, secret-free description of a run failure for the CLI."""
    kind = "" if isinstance(exc, ReasonctlError) else f"{type(exc).__name__}: "
    return redact_text(f"{kind}{exc}")

