"""Weight sync by broadcast: one process group per rollout replica, NCCL on CUDA, gloo on CPU.

The trainer's main process hosts a ``TCPStore`` (its address is announced in Redis) and
keeps the newest weights in flat staging buffers (:class:`~.weight_sync.FlatLayout`). A
worker that wants them pushes a request (its name and a nonce) to Redis and joins a
two-member group ``<name>/<nonce>`` built on that store; a serving thread of the trainer
joins it too and broadcasts a header (version and layout checksum) and the buffers. The
groups are created outside ``torch.distributed``'s default group (``ProcessGroupNCCL`` /
``ProcessGroupGloo`` on a ``PrefixStore``), one per replica, with a timeout: a replica that
dies during set-up or transfer fails only its own group, after at most ``timeout_s``, and
never the trainer or the other replicas: each transfer starts with a one-element handshake
(where NCCL sets its communicator up) before it holds any staging buffer, and NCCL groups
are made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the failed communicator; the
default tears the whole process down), set once by the first publisher or receiver unless
the environment sets it. Up to three sets of staging buffers alternate, so a new version is
staged while a transfer of an older one is still running.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from reasonctl.async_rl.messages import WeightVersion
from reasonctl.async_rl.weight_sync import FlatLayout, StageStats, as_wire, version_of

if TYPE_CHECKING:
    import torch

    from reasonctl.async_rl.transport import Transport

MAX_BUFFER_SETS = 3
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def contain_nccl_failures(device: torch.device) -> None:
    """Make NCCL groups created from now on abort only their communicator on an error or
    timeout (mode 2) instead of ending the process (torch's default, mode 3); the trainer's
    own groups exist already. Call it on the main thread before any sync group exists."""
    if device.type == "cuda":
        os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def new_group(store: Any, rank: int, size: int, device: torch.device, timeout_s: float) -> Any:
    """A process group of ``size`` on ``store`` outside the default group (blocks until
    every member joined or ``timeout_s`` passed)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from member 0 of ``group``, waiting at most ``timeout_s``."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([tensor], options)
    work.wait(timedelta(seconds=timeout_s))


def handshake(group: Any, device: torch.device, timeout_s: float) -> None:
    """A one-element broadcast both sides make first: the group's connections (NCCL's
    communicator) are set up here, before the sender holds a staging buffer."""
    import torch

    broadcast(group, torch.ones(1, dtype=torch.int64, device=device), timeout_s)


@dataclass
class _BufferSet:
    buffers: dict[str, Any]
    version: WeightVersion | None = None
    readers: int = 0


@dataclass
class _Group:
    nonce: str
    group: Any
    sends: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class BroadcastPublisher:
    """The trainer's side: stages weights and serves each replica's requests in threads."""

    mechanism = "broadcast"

    def __init__(self, transport: Transport, *, device: torch.device, wire_dtype: torch.dtype,
                 address: str, timeout_s: float) -> None:
        import torch.distributed as dist

        contain_nccl_failures(device)
        self.transport = transport
        self.device = device
        self.wire_dtype = wire_dtype
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.address = f"{address}:{self.store.port}"
        self.layout: FlatLayout | None = None
        self.sets: list[_BufferSet] = []
        self.current: _BufferSet | None = None
        self.condition = threading.Condition()
        self.groups: dict[str, _Group] = {}
        self.closed = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-sync")
        self.dispatcher = threading.Thread(target=self._dispatch, name="weight-requests",
                                           daemon=True)
        self.dispatcher.start()

    # --- staging ---------------------------------------------------------------------------

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]],
              version: WeightVersion) -> StageStats:
        """Copy ``tensors`` into a free buffer set and make it the one served."""
        import torch

        started = time.perf_counter()
        with torch.no_grad():
            if self.layout is None:
                wire = [(name, as_wire(t, self.wire_dtype).to(self.device, copy=True))
                        for name, t in tensors]
                self.layout = FlatLayout.of(wire)
                target = self._free_set()
                self.layout.fill(target.buffers, wire, self.wire_dtype)
                del wire
            else:
                target = self._free_set()
                self.layout.fill(target.buffers, tensors, self.wire_dtype)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        with self.condition:
            target.version = version
            self.current = target
        self.transport.set_weights({
            "mechanism": self.mechanism, "version": version.as_text(), "address": self.address,
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "manifest": self.layout.to_json(), "bytes": str(self.layout.nbytes),
        })
        return StageStats((time.perf_counter() - started) * 1000, self.layout.nbytes)

    def _free_set(self) -> _BufferSet:
        """A buffer set nobody reads and that is not the served one (waits for one)."""
        assert self.layout is not None
        deadline = time.monotonic() + self.timeout_s
        with self.condition:
            while True:
                for candidate in self.sets:
                    if candidate.readers == 0 and candidate is not self.current:
                        return candidate
                if len(self.sets) < MAX_BUFFER_SETS:
                    created = _BufferSet(self.layout.allocate(self.device))
                    self.sets.append(created)
                    return created
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("every weight staging buffer is still being sent after "
                                       f"{self.timeout_s:g}s; a rollout replica hangs")
                self.condition.wait(left)

    # --- serving ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while not self.closed.is_set():
            try:
                request = self.transport.pop_sync_request(1.0)
            except Exception as exc:  # Redis gone: the trainer reports it on its next call
                if not self.closed.is_set():
                    _log(f"weight requests stopped: {exc}")
                return
            if request is not None and not self.closed.is_set():
                self.executor.submit(self._serve, json.loads(request))

    def _serve(self, request: dict[str, Any]) -> None:
        name, nonce = str(request["replica"]), str(request["nonce"])
        served: _BufferSet | None = None
        try:
            import torch

            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            entry = self._group(name, nonce)
            with entry.lock:
                handshake(entry.group, self.device, self.timeout_s)  # no buffer held yet
                with self.condition:
                    served = self.current
                    if served is None:
                        raise RuntimeError("no weights staged yet")
                    served.readers += 1
                assert self.layout is not None and served.version is not None
                header = torch.tensor([served.version.incarnation, served.version.step,
                                       self.layout.digest], dtype=torch.int64,
                                      device=self.device)
                broadcast(entry.group, header, self.timeout_s)
                for dtype in sorted(served.buffers):
                    broadcast(entry.group, served.buffers[dtype], self.timeout_s)
                entry.sends += 1
        except Exception as exc:
            _log(f"weight transfer to rollout replica {name} failed ({exc}); it can ask again")
            if (failed := self.groups.get(name)) is not None and failed.nonce == nonce:
                del self.groups[name]  # not a newer group the replica asked for meanwhile
        finally:
            if served is not None:
                with self.condition:
                    served.readers -= 1
                    self.condition.notify_all()

    def _group(self, name: str, nonce: str) -> _Group:
        import torch.distributed as dist

        entry = self.groups.get(name)
        if entry is not None and entry.nonce == nonce:
            return entry
        # a store client of its own: one client serialises its calls, so a replica that died
        # during set-up would hold every other replica's set-up until its timeout
        client = dist.TCPStore("127.0.0.1", self.store.port, is_master=False,
                               timeout=timedelta(seconds=self.timeout_s))
        store = dist.PrefixStore(f"{name}/{nonce}", client)
        group = new_group(store, 0, 2, self.device, self.timeout_s)
        entry = _Group(nonce, group)
        self.groups[name] = entry
        return entry

    def close(self) -> None:
        """Stop serving; transfers in flight end with their timeout."""
        self.closed.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.groups.clear()


class BroadcastReceiver:
    """A worker's side: joins its group on the trainer's store and receives the buffers."""

    def __init__(self, transport: Transport, *, name: str, device: torch.device,
                 timeout_s: float) -> None:
        contain_nccl_failures(device)
        self.transport = transport
        self.name = name
        self.device = device
        self.timeout_s = timeout_s
        self.address: str | None = None
        self.group: Any = None
        self.nonce = ""
        self.layout: FlatLayout | None = None
        self.buffers: dict[str, Any] = {}

    def fetch(self, info: dict[str, str]) -> tuple[WeightVersion, list[tuple[str, torch.Tensor]]]:
        """Request the staged weights and receive them (the newest staged version)."""
        import torch
        import torch.distributed as dist

        if version_of(info) is None or info.get("mechanism") != "broadcast":
            raise RuntimeError(f"no broadcast weights announced (got {info})")
        if info["backend"] == "nccl" and self.device.type != "cuda":
            raise RuntimeError("the trainer sends weights over NCCL but this worker runs on "
                               f"{self.device}; give it a CUDA device or use weight_sync = 'file'")
        layout = FlatLayout.from_json(info["manifest"])
        if self.layout is None or self.layout.digest != layout.digest:
            self.layout = layout
            self.buffers = layout.allocate(self.device)
        if self.group is None or self.address != info["address"]:
            self.address = info["address"]
            self.nonce = secrets.token_hex(6)
            self.group = None
        self.transport.push_sync_request(json.dumps({"replica": self.name, "nonce": self.nonce}))
        try:
            if self.group is None:
                host, port = self.address.rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False,
                                      timeout=timedelta(seconds=self.timeout_s))
                self.group = new_group(dist.PrefixStore(f"{self.name}/{self.nonce}", store),
                                       1, 2, self.device, self.timeout_s)
            handshake(self.group, self.device, self.timeout_s)
            header = torch.zeros(3, dtype=torch.int64, device=self.device)
            broadcast(self.group, header, self.timeout_s)
            incarnation, step, digest = (int(v) for v in header.tolist())
            if digest != layout.digest:
                raise RuntimeError("the trainer's weight layout differs from the announced one")
            for dtype in sorted(self.buffers):
                broadcast(self.group, self.buffers[dtype], self.timeout_s)
        except Exception:
            self.group = None  # join a fresh group next time
            raise
        return WeightVersion(incarnation, step), layout.views(self.buffers)

    def close(self) -> None:
        """Drop the group."""
        self.group = None


def _log(message: str) -> None:
    print(f"[weight sync] {message}", file=sys.stderr, flush=True)
