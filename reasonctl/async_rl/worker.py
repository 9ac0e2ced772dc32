"""A rollout worker: pulls prompt batches from Redis, generates, pushes rollouts back.

Started by ``reasonctl run`` for ``rollout.workers.count`` workers on the trainer's node, or
by hand on any node with ``reasonctl worker rollout --redis URL --run ID``. It reads the
run's model, rollout, backend and storage settings from Redis (the trainer stored them),
builds the configured rollout engine on its own device, and then, until the run is done:

1. takes over a prompt batch whose worker died (the janitor: ``XAUTOCLAIM`` of entries
   nobody refreshed for ``heartbeat_ttl_s``), else waits for a new one (``XREADGROUP``);
   a batch delivered more than ``max_deliveries`` times goes to the dead-letter stream;
2. fetches the newest staged weights when they differ from its own (a worker that joins
   mid-run starts with the current weights, fetched before it takes its first batch; a
   model whose names or shapes do not fit them stops the worker with a usage error);
3. samples ``rollout.n`` completions per prompt with the batch's seed and appends them,
   stamped with its weight version, to the trainer rank's stream while acknowledging the
   batch in one transaction. An exception is recorded and the batch is left to be
   redelivered (to this or another worker).

A heartbeat thread keeps the worker's TTL key alive, refreshes the batch in progress so
the janitor leaves it alone, and watches the run's state. The worker ends when the run is
marked done (the trainer completed it: the worker leaves the run's live workers at once,
so the trainer need not wait for its heartbeat to expire, and a Redis the trainer stops
afterwards is no error), or when the trainer's heartbeat has been gone for
``wait_timeout_s``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import tomllib
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.algorithms.rollouts import sampling_params
from reasonctl.async_rl.messages import PromptBatch, RolloutBatch, WeightVersion
from reasonctl.async_rl.transport import Entry, Transport
from reasonctl.async_rl.weight_sync import WeightReceiver, version_of
from reasonctl.async_rl.weight_transfer import receiver_for
from reasonctl.backends.distributed import resolve_device, run_device
from reasonctl.core.config.redaction import redact_text
from reasonctl.core.errors import ConfigError, ReasonctlError, UsageError
from reasonctl.core.protocols import RunContext

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.plugins import PluginHost

WORKER_SECTIONS = ("run", "model", "backend", "rollout", "environment", "storage")
"""The parts of the run's config a worker uses (the trainer alone reads data and scores)."""


def default_name() -> str:
    """``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def worker_config(text: str, overrides: list[str], device: str, host: PluginHost) -> RunConfig:
    """The run's config (TOML from Redis) as a worker sees it: its sections of
    :data:`WORKER_SECTIONS`, ``backend.device = device``, with the vllm engine
    ``rollout.vllm.tensor_parallel_size = rollout.workers.tensor_parallel``, then
    ``overrides``."""
    from reasonctl.core.config import load_config

    data = tomllib.loads(text)
    values = {k: v for k, v in data.items() if k in WORKER_SECTIONS}
    values.setdefault("backend", {})["device"] = device
    rollout = values.setdefault("rollout", {})
    tp = int(rollout.get("workers", {}).get("tensor_parallel", 1))
    if rollout.get("engine") == "vllm" and tp > 1:  # each worker's vLLM shards its replica
        rollout.setdefault("vllm", {})["tensor_parallel_size"] = tp
    return load_config(overrides=overrides, values=values, registry=host.registry)


class RolloutWorker:
    """One rollout replica of a run (see the module docstring)."""

    def __init__(self, transport: Transport, ctx: RunContext, engine: Any, *, name: str) -> None:
        self.transport = transport
        self.ctx = ctx
        self.engine = engine
        self.name = name
        self.settings = ctx.config.rollout.workers
        self.device = resolve_device(ctx.config.backend.device)
        self.version: WeightVersion | None = None
        self.receiver: WeightReceiver | None = None
        self.mechanism = ""
        self.current: str | None = None
        self.batches = 0
        self.first_sync_ms = 0.0
        """The fetch before the first batch, reported with that batch."""
        self._first_tried = False
        self._trainer_gone = False
        self._stop = threading.Event()
        self.finished: str | None = None
        """Why the run ended, once the heartbeat thread saw it end."""

    @classmethod
    def join(cls, url: str, run_id: str, *, host: PluginHost, device: str = "auto",
             name: str | None = None, overrides: list[str] | None = None,
             connect_timeout_s: float = 10.0) -> RolloutWorker:
        """Connect to run ``run_id`` at ``url`` and build the engine on ``device``."""
        from reasonctl.models.loading import ensure_model_source
        from reasonctl.runtime.composition import (
            build_environment,
            build_processor,
            build_rollout_engine,
        )

        try:  # before anything is loaded
            resolve_device(device)
        except ReasonctlError as exc:
            raise UsageError(f"--device {device} cannot be used on this node ({exc})"
                             ) from exc
        transport = Transport.open(url, run_id, timeout_s=connect_timeout_s)
        if not transport.exists():
            runs = transport.known_runs()
            known = (f"runs there: {', '.join(f'{r} ({s})' for r, s in runs.items())}" if runs
                     else "no run is registered there (check the URL's host, port and /DB)")
            raise ConfigError([f"--run: no run {run_id!r} in Redis at {redact_text(url)}; "
                               f"{known}. The trainer prints the run id when it starts (and "
                               "keeps it in <output_dir>/rollout_workers.json)"])
        config = worker_config(transport.config_text(), list(overrides or []), device, host)
        ctx = RunContext(config=config, registry=host.registry, hooks=host.hooks,
                         output_dir=Path(config.run.output_dir))
        target = run_device(config)
        if target.type == "cuda":  # kernels and CUDA graphs run on the current device
            import torch

            torch.cuda.set_device(target)
        ensure_model_source(ctx)
        ctx.processor = build_processor(ctx)  # the tokens a rollout never samples
        if config.environment.name:  # episodes (and their tools) run here
            ctx.environment = build_environment(ctx)
        engine = build_rollout_engine(ctx)
        return cls(transport, ctx, engine, name=name or default_name())

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        """Serve prompt batches until the run ends; return why it ended."""
        beat = threading.Thread(target=self._beat, name="worker-heartbeat", daemon=True)
        self.transport.beat("worker", self.name, self.settings.heartbeat_ttl_s)
        beat.start()
        trainer_seen = time.monotonic()
        _log(f"worker {self.name} joined run {self.transport.run_id} on {self.device}")
        try:
            while True:
                if self.finished:
                    return self.finished
                try:
                    state = self.transport.state()
                except ReasonctlError:
                    if self.finished:  # the trainer stopped its Redis after finishing
                        return self.finished
                    raise
                if state != "running":
                    return self._finish(state)
                now = time.monotonic()
                if self.transport.trainer_alive():
                    if self._trainer_gone:
                        self._trainer_gone = False
                        _log("the trainer is back")
                    trainer_seen = now
                elif now - trainer_seen > self.settings.wait_timeout_s:
                    return (f"no trainer for {self.settings.wait_timeout_s:g}s "
                            "(rollout.workers.wait_timeout_s)")
                elif not self._trainer_gone:
                    self._trainer_gone = True
                    _log("the trainer stopped heartbeating (stopped, failed or killed); waiting "
                         f"up to {self.settings.wait_timeout_s:g}s "
                         "(rollout.workers.wait_timeout_s) for it to continue with --resume")
                if self.version is None and self.batches == 0 and not self._first_tried:
                    self._first_sync()
                    continue
                try:
                    entry = self._next_entry()
                    if entry is not None:
                        self._serve(entry)
                except ReasonctlError:
                    if self.finished:
                        return self.finished
                    raise
        finally:
            self._stop.set()
            if self.receiver is not None:
                self.receiver.close()

    def _first_sync(self) -> None:
        """Fetch the current weights before taking a batch, so a model that does not fit
        them stops this worker (:class:`UsageError`) before it holds any batch; other
        failures are retried with the first batch (and reported against it)."""
        self._first_tried = True
        try:
            self.first_sync_ms = self._sync()
        except ReasonctlError:
            raise
        except Exception as exc:
            _log(f"fetching the current weights failed ({exc}); trying again with a batch")

    def _next_entry(self) -> Entry | None:
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        entry = self.transport.reclaim_prompt(self.name, min_idle_ms=ttl_ms)
        if entry is not None:
            _log(f"took over prompt batch {entry.id} (delivery {entry.deliveries})")
        else:
            entry = self.transport.read_prompt(self.name, block_ms=1000)
        if entry is not None and entry.deliveries > self.settings.max_deliveries:
            self.transport.dead_letter(entry, f"delivered {entry.deliveries} times, more than "
                                              "rollout.workers.max_deliveries")
            return None
        return entry

    def _serve(self, entry: Entry) -> None:
        self.current = entry.id
        try:
            batch = PromptBatch.from_fields(entry.fields)
            sync_ms = self._sync() + self.first_sync_ms
            self.first_sync_ms = 0.0
            assert self.version is not None
            started = time.perf_counter()
            params = sampling_params(self.ctx.config, seed=batch.seed,
                                     processor=self.ctx.processor)
            completions = self._rollouts(batch, params)
            result = RolloutBatch(step=batch.step, rank=batch.rank, attempt=batch.attempt,
                                  version=self.version, worker=self.name,
                                  completions=completions, deliveries=entry.deliveries,
                                  generate_s=time.perf_counter() - started, sync_ms=sync_ms)
            self.transport.complete_prompt(entry.id, batch.rank, result.to_fields())
            self.batches += 1
            _log(f"batch {batch.batch_id}: {result.tokens} tokens in {result.generate_s:.2f}s "
                 f"with weights {self.version.as_text()}"
                 + (f" (fetched in {sync_ms:.0f} ms)" if sync_ms else ""))
        except ReasonctlError:
            raise
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            _log(f"prompt batch {entry.id} failed; it will be delivered again:\n{text}")
            self.transport.record_error(entry.id, text)
        finally:
            self.current = None

    def _rollouts(self, batch: PromptBatch, params: Any) -> list[list[Any]]:
        """``rollout.n`` completions per prompt, or episodes of the run's environment."""
        if self.ctx.environment is None:
            return self.engine.generate(batch.prompts, params)
        from reasonctl.core.types import Sample
        from reasonctl.environments.episodes import episode_limits, run_episodes

        if len(batch.samples) != len(batch.prompts):
            raise ReasonctlError(f"prompt batch {batch.batch_id} carries no samples for its "
                                 "episodes; the trainer and this worker disagree on "
                                 "[environment]")
        assert self.ctx.processor is not None
        return run_episodes(self.engine, self.ctx.environment, self.ctx.processor.tokenizer,
                            [Sample.from_dict(s) for s in batch.samples], batch.prompts,
                            params, episode_limits(self.ctx.config))

    def _sync(self) -> float:
        """Fetch the newest staged weights unless this worker has them; milliseconds."""
        deadline = time.monotonic() + self.settings.wait_timeout_s
        info = self.transport.weights()
        while version_of(info) is None:
            if time.monotonic() > deadline:
                raise ReasonctlError("the trainer staged no weights within "
                                     f"{self.settings.wait_timeout_s:g}s")
            time.sleep(0.2)
            info = self.transport.weights()
        if version_of(info) == self.version:
            return 0.0
        started = time.perf_counter()
        if self.receiver is None or info.get("mechanism") != self.mechanism:
            if self.receiver is not None:
                self.receiver.close()
            self.mechanism = info.get("mechanism", "")
            self.receiver = receiver_for(info, self.transport, name=self.name,
                                         device=self.device,
                                         timeout_s=self.settings.sync_timeout_s)
        version, tensors = self.receiver.fetch(info)
        try:
            self.engine.update_weights(iter(tensors))
        except ValueError as exc:  # names or shapes differ: no batch can ever succeed here
            model = self.ctx.config.model.name_or_path
            raise UsageError(
                f"this worker's model ({model}) does not fit the trainer's weights: {exc}. "
                "A worker loads model.name_or_path from the run's config: give this node the "
                "trainer's model at that path and drop any --set model.* override") from exc
        self.version = version
        return (time.perf_counter() - started) * 1000

    def _finish(self, state: str) -> str:
        """The run is no longer running: leave its live workers; why the worker ends."""
        if self.finished is None:
            self.finished = ("the run finished (its trainer completed it)" if state == "done"
                             else f"the run ended ({state})")
            try:
                self.transport.leave(self.name)
            except ReasonctlError:
                pass  # Redis already stopped: nothing counts this worker as alive any more
        return self.finished

    def _beat(self) -> None:
        ttl = self.settings.heartbeat_ttl_s
        while not self._stop.wait(ttl / 4):
            try:
                state = self.transport.state()
                if state != "running":
                    self._finish(state)
                    return
                self.transport.beat("worker", self.name, ttl)
                current = self.current
                if current is not None:
                    self.transport.keep_alive(self.name, current)
            except ReasonctlError as exc:
                if self.finished:
                    return
                _log(f"heartbeat failed: {exc}")


def _log(message: str) -> None:
    print(f"[rollout worker] {message}", flush=True)
