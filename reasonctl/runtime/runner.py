"""Composes a run from the config and drives the step loop.

The runner is the only composer. In one pass, top to bottom, it builds the backend and the
algorithm, sets the backend up (process group, model, optimizer), asks the algorithm what
it needs (:class:`~reasonctl.core.protocols.Needs`) and builds those parts into the
:class:`~reasonctl.core.protocols.RunContext` (:mod:`reasonctl.runtime.composition`: the
processor, dataset, reward set, reference model, rollout engine and evaluator), then calls
``algorithm.setup``, restores the newest checkpoint when resuming, runs ``algorithm.step``
until ``ctx.total_steps`` (evaluating every ``eval.every_steps``), sends metrics to loggers,
saves checkpoints, handles SIGTERM/SIGUSR1/SIGINT by saving and exiting, and exports the
final model. It knows nothing about models or ranks beyond what the backend tells it.

Around the loop: the output directory's lock, the resume point and its config check
(:mod:`reasonctl.core.resume`), checkpoints of abandoned branches moved aside, steps with a
non-finite loss or gradient norm stopped or skipped (``train.on_nonfinite``), signals
handled until the run returns (:mod:`reasonctl.core.signals`), and an export that fails on
any process fails on all of them.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasonctl.core.checkpoint import CheckpointInfo, CheckpointManager, load_rng_state
from reasonctl.core.config import RunConfig, redact_text
from reasonctl.core.errors import (
    NonFiniteError,
    ReasonctlError,
    RunAbandonedError,
    StopWithCheckpoint,
)
from reasonctl.core.output_lock import joins_a_launcher_lock, output_lock
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import (
    Algorithm,
    Closes,
    Logger,
    ReportsMemory,
    RunContext,
    algorithm_needs,
)
from reasonctl.core.resume import (
    check_resume_config,
    config_hash,
    config_record,
    select_resume_point,
)
from reasonctl.core.signals import SignalAbandon, StopRequest, stop_signals
from reasonctl.core.types import Metrics
from reasonctl.runtime.composition import build_algorithm, build_backend, build_component, compose


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
    nonfinite_steps: int = 0
    """Steps skipped for a non-finite loss or gradient norm (``train.on_nonfinite``)."""


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


def run(config: RunConfig, *, host: PluginHost, progress: bool = True) -> RunResult:
    """Run training as configured and return a :class:`RunResult`.

    ``host`` holds the plugins, loaded once by the caller (the CLI, or :func:`reasonctl.run`,
    which adds run-local plugins to it first). The main process holds the output
    directory's lock (:mod:`reasonctl.core.output_lock`; every process of a launcher that
    holds it joins it) and stop signals are handled (:mod:`reasonctl.core.signals`) from
    the start until the run returns.
    """
    stop = StopRequest()
    output_dir = Path(config.run.output_dir)
    locks = env_rank() == 0 or joins_a_launcher_lock()
    lock = output_lock(output_dir, log=_stderr) if locks else nullcontext()
    with stop_signals(stop), lock:
        return _run(config, host, progress, stop)


def _run(config: RunConfig, host: PluginHost, progress: bool, stop: StopRequest) -> RunResult:
    registry = host.registry
    output_dir = Path(config.run.output_dir)
    ctx = RunContext(config=config, registry=registry, hooks=host.hooks, output_dir=output_dir)
    resumed = _resume_point(ctx)
    if env_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.toml").write_text(config.to_toml(redact=True))
    seed_everything(config.run.seed)

    for record in host.errors:
        ctx.info(f"warning: {record.error} (skipped; see `reasonctl plugins`)")
    for line in host.shadow_warnings():
        ctx.info(line)
    backend = ctx.backend = build_backend(ctx)
    algorithm = build_algorithm(ctx)
    needs = algorithm_needs(algorithm, config.component_config("algorithm", config.algorithm.name))
    loggers: list[Logger] = []
    status, error = "failed", None
    result = RunResult(status="failed", output_dir=output_dir, steps=0)
    uploader = None
    try:
        if config.checkpoint.upload and env_rank() == 0:
            from reasonctl.core.uploads import Uploader

            uploader = Uploader(registry, config, output_dir)
            uploader.check_access()  # wrong credentials or bucket: fail before training
        backend.setup(ctx)
        checkpoints = ctx.checkpoints = CheckpointManager(
            output_dir / "checkpoints",
            keep=config.checkpoint.keep,
            is_main=backend.is_main,
            barrier=backend.barrier,
            rank=env_rank(),
            agree=lambda ok: not _any_process(ctx, not ok),
        )
        if resumed is None and config.run.resume is True and uploader is not None:
            uploader.pull_latest_checkpoint_if_missing(checkpoints)
        backend.barrier()
        if resumed is None and config.run.resume is True:
            resumed = _resume_point(ctx)  # pulled from the upload target
        checkpoints.begin(resumed)
        compose(ctx, needs)
        algorithm.setup(ctx)
        if resumed is not None:
            _restore(ctx, algorithm, resumed)
        _retire_abandoned(ctx, resumed)  # only once the resume point has loaded
        if backend.is_main and progress:
            loggers = _build_loggers(ctx)
        host.hooks.on_run_start(ctx)
        result.last_metrics = _loop(ctx, algorithm, loggers, uploader, stop, result)
        with stop.phase("checkpoint write", "the checkpoint being written (the complete ones "
                        "before it are kept)"):
            checkpoints.wait()  # a checkpoint still being written is committed now
        status = "interrupted" if ctx.stop_signal else "completed"
        result.checkpoint_dir = checkpoints.last_committed
        if status == "completed" and config.checkpoint.export_final:
            newest = result.checkpoint_dir
            kept = (f"the newest checkpoint {newest} is kept" if newest is not None
                    else "no checkpoint holds the final weights")
            with stop.phase("final export", f"the final export ({kept})"):
                result.export_dir = _export(ctx, output_dir / "export" / "final", uploader)
    except SignalAbandon as exc:
        error = RunAbandonedError(str(exc))
        raise error from None
    except BaseException as exc:
        error = exc
        raise
    finally:
        result.status = status if error is None else "failed"
        result.steps = ctx.step
        result.skipped_rows = ctx.skipped_rows
        if uploader is not None:
            result.upload_failures = uploader.finish(stop)
        for logger in loggers:
            logger.close()
        if ctx.rollout_workers is not None:
            ctx.rollout_workers.close(result.status)
        host.hooks.on_run_end(ctx, result.status, error)
        for part in (algorithm, ctx.engine, ctx.environment):
            if isinstance(part, Closes):
                part.close()
        backend.close()
    return result


def _resume_point(ctx: RunContext) -> CheckpointInfo | None:
    """The checkpoint to resume, after checking the config still fits it (every rank)."""
    info = select_resume_point(ctx.config, ctx.output_dir / "checkpoints", ctx.info)
    if info is None:
        if ctx.config.run.resume:
            ctx.info("run.resume: no complete checkpoint found; starting from scratch")
        return None
    check_resume_config(info, ctx.config, ctx.info)
    return info


def _retire_abandoned(ctx: RunContext, resumed: CheckpointInfo | None) -> None:
    """Move checkpoints that are not ancestors of the starting point aside (main rank)."""
    assert ctx.checkpoints is not None and ctx.backend is not None
    moved = ctx.checkpoints.retire(resumed)
    if moved is not None:
        target, names = moved
        why = (f"they do not lead to {resumed.path.name}" if resumed is not None
               else "this run starts from scratch (run.resume is off)")
        ctx.info(f"moved {len(names)} earlier checkpoint(s) ({', '.join(sorted(names))}) to "
                 f"{target}: {why}; they are no longer resumed, pruned or overwritten "
                 "(delete them when not needed)")
    ctx.backend.barrier()


def _restore(ctx: RunContext, algorithm: Algorithm, info: CheckpointInfo) -> None:
    assert ctx.backend is not None
    ctx.info(f"resuming from {info.path} (step {info.step})")
    ctx.backend.load_checkpoint(info.path / "state")
    algorithm.load_state_dict(info.manifest.get("algorithm", {}))
    if not load_rng_state(info.path / f"rng_rank{env_rank()}.pt"):
        load_rng_state(info.path / "rng_rank0.pt")
    ctx.step = info.step
    if ctx.step >= ctx.total_steps:
        ctx.info(f"checkpoint step {ctx.step} is at or past the run's {ctx.total_steps} "
                 "steps: nothing left to train")


def _build_loggers(ctx: RunContext) -> list[Logger]:
    return [build_component(ctx, "logger", "logging", name) for name in ctx.config.logging.loggers]


def _loop(ctx: RunContext, algorithm: Algorithm, loggers: list[Logger], uploader: Any,
          stop: StopRequest, result: RunResult) -> Metrics:
    assert ctx.backend is not None and ctx.checkpoints is not None
    config = ctx.config
    metrics: Metrics = {}
    every = config.checkpoint.every_steps
    if ctx.step < ctx.total_steps and _any_process(ctx, stop.requested):
        ctx.stop_signal = stop.signal_name or "signal"  # before the first step: nothing to save
        ctx.info(f"stopping before step {ctx.step + 1} on {ctx.stop_signal}")
        return metrics
    while ctx.step < ctx.total_steps:
        started = time.perf_counter()
        try:
            metrics = dict(algorithm.step(ctx))
        except StopWithCheckpoint as exc:
            raise _checkpointed(ctx, algorithm, uploader, exc) from exc
        ctx.step += 1
        metrics.setdefault("step_time_s", time.perf_counter() - started)
        if isinstance(ctx.backend, ReportsMemory):
            for key, value in ctx.backend.memory_metrics().items():
                metrics.setdefault(key, value)
        nonfinite = _nonfinite(metrics)
        if nonfinite and config.train.on_nonfinite == "skip":
            result.nonfinite_steps += 1
            metrics["nonfinite_steps"] = float(result.nonfinite_steps)
            ctx.info(f"step {ctx.step}: {nonfinite}; weights unchanged, step skipped "
                     f"(train.on_nonfinite = 'skip'; {result.nonfinite_steps} so far)")
        if ctx.evaluator is not None and ctx.step % config.eval.every_steps == 0:
            metrics.update(ctx.evaluator.evaluate(ctx))
        ctx.hooks.on_step_end(ctx, ctx.step, metrics)
        evaluated = any(key.startswith("eval/") for key in metrics)  # never left unlogged
        if evaluated or ctx.step % config.logging.every_steps == 0 or \
                ctx.step == ctx.total_steps:
            for logger in loggers:
                logger.log(metrics, ctx.step)
        if nonfinite and config.train.on_nonfinite == "stop":
            _stop_on_nonfinite(ctx, nonfinite)
        stop_now = _any_process(ctx, stop.requested)
        on_signal = stop_now and config.run.on_signal == "checkpoint"
        ctx.checkpoints.poll()
        if (every and ctx.step % every == 0) or on_signal:
            _save_checkpoint(ctx, algorithm, uploader)
        if stop_now:
            ctx.stop_signal = stop.signal_name or "signal"
            ctx.info(f"stopping at step {ctx.step} on {ctx.stop_signal}")
            break
    return metrics


def _checkpointed(ctx: RunContext, algorithm: Algorithm, uploader: Any,
                  stop: StopWithCheckpoint) -> StopWithCheckpoint:
    """Checkpoint the steps done (unless the newest checkpoint holds them); the error that
    ends the run, saying where that checkpoint is and how to go on."""
    assert ctx.checkpoints is not None
    ctx.checkpoints.wait()
    newest = ctx.checkpoints.last_committed
    if ctx.step == 0:
        return StopWithCheckpoint(f"{stop} No step was trained, so nothing was saved; start "
                                  "the run again once that is fixed.")
    if newest != ctx.checkpoints.step_dir(ctx.step):
        _save_checkpoint(ctx, algorithm, uploader)
        ctx.checkpoints.wait()
        newest = ctx.checkpoints.last_committed
    return StopWithCheckpoint(f"{stop} The {ctx.step} step(s) done are saved in {newest}; "
                              "once that is fixed, the same command with --resume continues "
                              "from there.")


def _nonfinite(metrics: Metrics) -> str:
    """``"non-finite loss (nan)"``-style description of the step's bad values, or ``""``."""
    bad = [f"{key} {metrics[key]}" for key in ("loss", "grad_norm")
           if key in metrics and not math.isfinite(float(metrics[key]))]
    return f"non-finite {' and '.join(bad)}" if bad else ""


def _stop_on_nonfinite(ctx: RunContext, nonfinite: str) -> None:
    """End the run on a non-finite step (every process sees the same reduced metrics)."""
    assert ctx.checkpoints is not None
    ctx.checkpoints.wait()  # an earlier checkpoint still being written is kept
    newest = ctx.checkpoints.latest()
    kept = f"the newest checkpoint is {newest.path}" if newest else "no checkpoint was written"
    raise NonFiniteError(
        f"step {ctx.step}: {nonfinite}. The run stopped (train.on_nonfinite = 'stop'): this "
        f"step's update was not applied, nothing was exported, and {kept}. Lower train.lr, "
        "check train.max_grad_norm and the data, or set train.on_nonfinite = 'skip' to skip "
        "such steps"
    )


def _any_process(ctx: RunContext, flag: bool) -> bool:
    """Whether ``flag`` is true on any process of the job (collective on every process).

    Agreement spans every process, not just data-parallel ranks: tensor- or
    pipeline-parallel peers must stop (or give up a checkpoint) at the same point too.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    assert ctx.backend is not None
    device = ctx.backend.device if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _save_checkpoint(ctx: RunContext, algorithm: Algorithm, uploader: Any) -> Path | None:
    """Save (or, with ``checkpoint.async_save``, start saving) a checkpoint of this step."""
    assert ctx.backend is not None and ctx.checkpoints is not None
    manifest = {
        "config_hash": config_hash(ctx.config),
        "config": config_record(ctx.config),
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
    """Export on every process; a failure on any of them fails the export on all."""
    assert ctx.backend is not None
    error: BaseException | None = None
    try:
        ctx.backend.export(directory)
    except (KeyboardInterrupt, SystemExit, SignalAbandon):
        raise
    except BaseException as exc:
        error = exc
    if _any_process(ctx, error is not None):
        if error is not None:
            raise error
        raise ReasonctlError(f"exporting the model to {directory} failed on another process "
                             "(its own message names the reason)")
    ctx.backend.barrier()
    if ctx.is_main:
        ctx.info(f"exported model to {directory}")
        if uploader is not None:
            uploader.submit(directory, str(directory.relative_to(ctx.output_dir)))
    return directory


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def format_error(exc: BaseException) -> str:
    """A one-paragraph, secret-free description of a run failure for the CLI."""
    kind = "" if isinstance(exc, ReasonctlError) else f"{type(exc).__name__}: "
    return redact_text(f"{kind}{exc}")

