"""The trainer's view of its separate rollout workers (``ctx.rollout_workers``).

Built by the runner (:func:`reasonctl.runtime.composition.build_rollout_workers`) when
``rollout.placement = "separate"``. On the trainer's main process :meth:`RolloutWorkers.start`

1. finds the run's Redis: ``rollout.workers.redis_url``, or a ``redis-server`` it starts on
   127.0.0.1 with its append-only state in ``<output_dir>/redis`` (reused by ``--resume``);
2. registers the run (id, config with secrets redacted, streams and consumer groups) and
   counts one more trainer *incarnation* (weight versions carry it);
3. starts ``rollout.workers.count`` worker processes on this node, kept running by a
   :class:`~reasonctl.async_rl.supervisor.WorkerSupervisor` (a dead one is restarted,
   bounded), a trainer heartbeat, and the weight publisher of
   ``rollout.workers.weight_sync``;
4. writes ``<output_dir>/rollout_workers.json`` (run id and Redis URL; ``--resume`` reuses
   the run id) and prints the command that lets workers on other nodes join.

Every trainer process then connects to the same run. :meth:`RolloutWorkers.close` marks a
completed run done (every worker, started here or joined by hand, ends with exit 0; a Redis
the run started is stopped only once they have left), stops what it started and keeps the
Redis state on disk.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from reasonctl.async_rl.processes import LocalRedis
from reasonctl.async_rl.supervisor import WorkerSupervisor
from reasonctl.async_rl.transport import Transport
from reasonctl.async_rl.weight_sync import WeightPublisher, weight_dir
from reasonctl.async_rl.weight_transfer import publisher_for
from reasonctl.core.errors import ReasonctlError

if TYPE_CHECKING:
    from reasonctl.core.config.placement import RolloutWorkersSection
    from reasonctl.core.protocols import RunContext

STATE_FILE = "rollout_workers.json"


@dataclass
class RolloutWorkers:
    """The run's Redis transport, incarnation and (main process) what it started."""

    transport: Transport
    incarnation: int
    settings: RolloutWorkersSection
    publisher: WeightPublisher | None = None
    redis: LocalRedis | None = None
    supervisor: WorkerSupervisor | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _heartbeat: threading.Thread | None = None

    @property
    def run_id(self) -> str:
        """The run's id in Redis (``reasonctl worker rollout --run``)."""
        return self.transport.run_id

    @classmethod
    def start(cls, ctx: RunContext) -> RolloutWorkers:
        """Connect every trainer process to the run; on the main one, start its services."""
        backend = ctx.backend
        assert backend is not None
        settings = ctx.config.rollout.workers
        shared: dict[str, Any] = {}
        pool: RolloutWorkers | None = None
        if backend.is_main:
            pool = cls._start_main(ctx)
            shared = {"url": pool.transport.url, "run": pool.run_id, "inc": pool.incarnation}
        shared = json.loads(_share_text(json.dumps(shared), ctx))
        if pool is None:
            transport = Transport.open(shared["url"], shared["run"],
                                       timeout_s=settings.connect_timeout_s)
            pool = cls(transport, int(shared["inc"]), settings)
        return pool

    @classmethod
    def _start_main(cls, ctx: RunContext) -> RolloutWorkers:
        config, settings = ctx.config, ctx.config.rollout.workers
        state_path = ctx.output_dir / STATE_FILE
        previous = _read_state(state_path) if config.run.resume else {}
        run_id = previous.get("run_id") or f"{config.run.name}-{secrets.token_hex(4)}"
        redis = None
        url = settings.redis_url
        if url is None:
            directory = ctx.output_dir / "redis"
            if not config.run.resume:  # a new run keeps nothing of an earlier one here
                shutil.rmtree(directory, ignore_errors=True)
            redis = LocalRedis.start(directory)
            url = redis.url
        try:
            transport = Transport.open(url, run_id, timeout_s=settings.connect_timeout_s)
            transport.create_run(config.to_toml(redact=True), ctx.backend.world_size)
            pool = cls(transport, transport.next_incarnation(), settings, redis=redis)
            pool.publisher = _publisher(ctx, transport, url)
            pool._start_heartbeat()
            pool._start_local_workers(ctx, url)
        except BaseException:
            if redis is not None:
                redis.stop()
            raise
        state_path.write_text(json.dumps({"run_id": run_id, "redis_url": settings.redis_url}))
        ctx.info(f"rollout workers: run {run_id} on {url} (trainer incarnation "
                 f"{pool.incarnation}); more can join with `reasonctl worker rollout --redis "
                 f"{url} --run {run_id}`")
        return pool

    def _start_heartbeat(self) -> None:
        ttl = self.settings.heartbeat_ttl_s

        def beat() -> None:
            while not self._stop.is_set():
                try:
                    self.transport.beat("trainer", "0", ttl)
                except ReasonctlError:
                    pass  # the training loop reports a lost Redis on its next call
                if self.supervisor is not None:
                    self.supervisor.check()
                self._stop.wait(ttl / 4)

        self.transport.beat("trainer", "0", ttl)
        self._heartbeat = threading.Thread(target=beat, name="trainer-heartbeat", daemon=True)
        self._heartbeat.start()

    def _start_local_workers(self, ctx: RunContext, url: str) -> None:
        devices = worker_devices(ctx)
        tp = self.settings.tensor_parallel
        supervisor = WorkerSupervisor(self.settings.max_restarts, ctx.info)
        for index in range(self.settings.count):
            group = devices[index * tp : (index + 1) * tp]
            log = ctx.output_dir / "workers" / f"worker{index}.log"
            device, env = worker_placement(group)
            arguments = ["--redis", url, "--run", self.run_id, "--device", device]
            supervisor.start(f"{socket.gethostname()}-{os.getpid()}-w{index}", arguments, log,
                             env=env)
        self.supervisor = supervisor
        if supervisor.workers:
            ctx.info(f"started {len(supervisor.workers)} rollout worker(s) on "
                     f"{', '.join(devices)} (logs in {ctx.output_dir / 'workers'}; each "
                     f"restarted up to {self.settings.max_restarts} time(s) if it dies)")

    def close(self, status: str) -> None:
        """End of the run: a completed run is marked done (every worker exits); stop the
        heartbeat, the weight publisher, the started workers and Redis."""
        self._stop.set()
        completed = status == "completed"
        if completed and self.publisher is not None:  # the main process
            try:
                self.transport.set_state("done")
            except ReasonctlError:
                completed = False
        if self.publisher is not None:
            self.publisher.close()
        if self.supervisor is not None:  # a stopped run's workers wait for --resume elsewhere
            self.supervisor.close(finished=completed)
        if self.redis is not None:
            if completed:
                self._wait_for_workers_to_leave()
            self.redis.stop()

    def _wait_for_workers_to_leave(self) -> None:
        """Give the workers that joined by hand a heartbeat's time to see the run done and
        leave before the Redis they talk to stops (a dead one's heartbeat expires by then)."""
        deadline = time.monotonic() + self.settings.heartbeat_ttl_s
        try:
            while self.transport.live_workers() and time.monotonic() < deadline:
                time.sleep(0.1)
        except ReasonctlError:
            pass


def worker_devices(ctx: RunContext) -> list[str]:
    """The devices of the workers this node starts: ``rollout.workers.devices``, else the
    CUDA devices after the trainer's (``cpu`` without CUDA)."""
    settings = ctx.config.rollout.workers
    wanted = settings.count * settings.tensor_parallel
    if settings.devices:
        return list(settings.devices)
    assert ctx.backend is not None
    if ctx.backend.device.type != "cuda":
        return ["cpu"] * wanted
    import torch

    first = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = torch.cuda.device_count()
    if first + wanted > available:
        raise ReasonctlError(
            f"rollout.workers: {settings.count} worker(s) x tensor_parallel "
            f"{settings.tensor_parallel} need GPUs {first}..{first + wanted - 1} after the "
            f"trainer's {first}, but this node has {available}; lower rollout.workers.count, "
            "set rollout.workers.devices, or start workers on other nodes (count = 0)")
    return [f"cuda:{i}" for i in range(first, first + wanted)]


def worker_placement(group: list[str], environ: dict[str, str] | None = None
                     ) -> tuple[str, dict[str, str] | None]:
    """The ``--device`` and environment of a worker on the devices ``group``.

    One device: that device, this process's environment. Several CUDA devices (a
    tensor-parallel replica): the worker sees only them (``CUDA_VISIBLE_DEVICES``, mapped
    through this process's own list when it has one) and runs on ``cuda:0``, where vLLM's
    tensor-parallel processes take the visible devices in order.
    """
    environ = dict(os.environ if environ is None else environ)
    if len(group) == 1 or not all(d.startswith("cuda") for d in group):
        return group[0], None
    indices = [int(d.partition(":")[2] or 0) for d in group]
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if max(indices) >= len(visible):
            raise ReasonctlError(f"rollout.workers.devices: {group} are not all among the "
                                 f"visible devices (CUDA_VISIBLE_DEVICES={','.join(visible)})")
        ids = [visible[i] for i in indices]
    else:
        ids = [str(i) for i in indices]
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return "cuda:0", environ


def _publisher(ctx: RunContext, transport: Transport, url: str) -> WeightPublisher:
    from reasonctl.models.loading import compute_dtype

    assert ctx.backend is not None
    settings = ctx.config.rollout.workers
    device = ctx.backend.device
    return publisher_for(
        settings.weight_sync, transport, device=device,
        wire_dtype=compute_dtype(ctx.config.model.dtype, device),
        directory=weight_dir(settings.weight_dir, transport.run_id, ctx.output_dir),
        address=_reachable_address(url), timeout_s=settings.sync_timeout_s)


def _reachable_address(url: str) -> str:
    """This host's address as seen on the route to Redis (where workers come from)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return master or socket.gethostname()


def _read_state(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _share_text(text: str, ctx: RunContext) -> str:
    """``text`` of the main process, on every trainer process (a byte broadcast)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    assert ctx.backend is not None
    device = ctx.backend.device if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if not ctx.backend.is_main:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return bytes(data.cpu().tolist()).decode()
