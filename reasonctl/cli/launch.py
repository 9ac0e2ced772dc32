"""Multi-process and multi-node runs on torch's elastic agent.

``reasonctl run --nproc-per-node N [--nnodes MIN:MAX] [--rdzv-endpoint HOST:PORT]
[--rdzv-id ID] [--max-restarts K] [--node-rank R]`` starts one launcher per node. Each
launcher hands its ``N`` workers (``python -m reasonctl run ...`` with the same arguments)
to torch's elastic agent (:func:`torch.distributed.launcher.api.elastic_launch`), which
meets the other nodes' launchers in a c10d rendezvous at ``--rdzv-endpoint``, sets the
variables ``torch.distributed`` reads, watches the workers and, with ``--max-restarts K``,
restarts the whole group up to ``K`` times when one of them dies; the restarted workers
resume from the run's newest complete checkpoint (:mod:`reasonctl.cli.launched`).

What reasonctl adds to the agent:

- **One writer per output directory.** The launcher of node rank 0 holds the output
  directory's lock (:mod:`reasonctl.core.output_lock`) shared with its workers, so the
  directory stays locked across restarts and until the last worker has exited.
- **Stop signals checkpoint.** SIGTERM, SIGINT and SIGUSR1 sent to a launcher are passed on
  to its workers, which finish the step, write a checkpoint and exit 0, so the launcher
  exits 0. Workers run in sessions of their own, so a terminal's Ctrl-C reaches them once,
  through the launcher. After a stop signal the group is not restarted.
- **Failures are named.** A worker that dies is reported with its local rank, process id
  and what ended it (its exit status, or the signal and the usual reason for it), with
  the restart that follows; without restarts left the launcher exits with the first
  failure's status (128 + N for a worker killed by signal N).
- **Workers die with their launcher** (``PR_SET_PDEATHSIG``; see
  :func:`reasonctl.cli.launched.follow_launcher`): a killed launcher's workers checkpoint
  and stop.
- **Usage errors before anything starts**: bad ``--nnodes``, ``--rdzv-endpoint``,
  ``--rdzv-id`` or ``--node-rank`` values exit 2 at once
  (:mod:`reasonctl.cli.launch_plan`); a rendezvous that does not complete within
  ``--rdzv-timeout`` exits 2 saying what to check on the other nodes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from reasonctl.cli.launch_plan import LaunchPlan
from reasonctl.core.exit_status import describe_exit, exit_status
from reasonctl.core.output_lock import HELD_BY_NODE_0, HOLDER_ENV, output_lock
from reasonctl.core.signals import STOP_SIGNALS

LAUNCHER_PID_ENV = "REASONCTL_LAUNCHER_PID"
"""The launcher's process id, in its workers' environment."""
NODE_RANK_ENV = "REASONCTL_NODE_RANK"
"""The ``--node-rank`` of the launcher, in its workers' environment."""
STARTED_ENV = "REASONCTL_GROUP_STARTED"
"""Set in a launcher once its first worker group ran: every group started after it (a
restart, or a node joining or leaving the rendezvous, which torch's agent does not count as
a restart) resumes from the newest checkpoint."""
STOP_ENV = "REASONCTL_STOP_REQUESTED"
"""Set (to the signal's name) in a launcher that was asked to stop: workers started after
that, by a restart, stop at once instead of training."""
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
"""Signals left to torch's agent (it stops the workers at once); the stop signals of
:data:`~reasonctl.core.signals.STOP_SIGNALS` are reasonctl's (checkpoint, then exit 0)."""
_LAUNCHED = False
"""Whether this process ran :func:`launch_workers` (its exit may skip torch's teardown)."""


@contextmanager
def exit_quickly_after_launch() -> Iterator[None]:
    """Around the console command: once a launcher is done, exit without tearing torch
    down (half a second of a launch; the workers have exited and the lock and temporary
    files are released by then)."""
    try:
        yield
    except SystemExit as exc:
        if not _LAUNCHED:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch_workers(run_args: list[str], plan: LaunchPlan, *, output_dir: str) -> int:
    """Run ``python -m reasonctl <run_args>`` on every local rank through torch's elastic
    agent; return the launcher's exit code."""
    global _LAUNCHED
    _LAUNCHED = True
    holds_lock = plan.node_rank == 0
    lock = (output_lock(Path(output_dir), log=_stderr, shared=True) if holds_lock
            else nullcontext(HELD_BY_NODE_0))
    with lock as token, tempfile.TemporaryDirectory(prefix="reasonctl-launch-") as logs:
        environment = {HOLDER_ENV: token, LAUNCHER_PID_ENV: str(os.getpid()),
                       NODE_RANK_ENV: str(plan.node_rank),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                       # each attempt's workers get a store of their own (rank 0 hosts it):
                       # in the agent's shared store a restarted group finds the keys of
                       # the group before it and can wait for peers that are gone
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        report = FailureReport(plan)
        with (_environment(environment), StopForwarding() as stop, report.attached(),
              _noting_the_first_group()):
            try:
                code = _run_agent(run_args, plan, logs)
            except StoppedBeforeStart as stopped:
                _stderr(f"stopped on {stopped} before the workers started; nothing to save")
                return 0
        if stop.signal_name and code == 0 and report.status_after_stop:
            return report.status_after_stop  # the restart after it only stopped at once
        if stop.signal_name and code == 0:
            _stderr(f"workers stopped on {stop.signal_name} after their checkpoint")
        return code


def _run_agent(run_args: list[str], plan: LaunchPlan, logs: str) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv_configs: dict[str, Any] = {"join_timeout": plan.rdzv_timeout_s}
    if plan.rdzv_timeout_s < 60:  # reaching the rendezvous host is bounded by it too
        rdzv_configs["read_timeout"] = plan.rdzv_timeout_s
    config = LaunchConfig(
        min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, nproc_per_node=plan.nproc_per_node,
        run_id=plan.run_id, role="trainer", rdzv_backend="c10d", rdzv_endpoint=plan.endpoint,
        rdzv_configs=rdzv_configs, max_restarts=plan.max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=logs), signals_to_handle=AGENT_SIGNALS,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "reasonctl", *run_args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return exit_status(failure.exitcode)
    except RendezvousTimeoutError:
        _stderr(f"error: the rendezvous at {plan.endpoint} (--rdzv-id {plan.run_id}) did not "
                f"complete within {plan.rdzv_timeout_s}s (--rdzv-timeout): fewer than "
                f"{plan.min_nodes} node(s) joined. Start `reasonctl run` on every node with "
                f"the same --nnodes {plan.nodes_text}, --rdzv-endpoint {plan.endpoint} and "
                f"--rdzv-id {plan.run_id}, each with its own --node-rank")
        return 2
    except RendezvousConnectionError:
        _stderr(f"error: cannot reach the rendezvous at {plan.endpoint} (--rdzv-endpoint) "
                f"within {min(plan.rdzv_timeout_s, 60)}s: start the launcher of the node that "
                "address belongs to, or give an address of it that this node can reach")
        return 2
    except RendezvousError as exc:
        _stderr(f"error: the rendezvous at {plan.endpoint} failed: {exc}")
        return 1
    except SignalException as exc:  # SIGHUP or SIGQUIT: the agent stopped the workers
        _stderr(f"{exc.sigval.name}: the workers were stopped without a checkpoint")
        return 128 + int(exc.sigval)
    return 0


class FailureReport(logging.Handler):
    """Names each failed worker and the restart that follows, from the agent's record of
    the first failure of each attempt."""

    AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self, plan: LaunchPlan) -> None:
        super().__init__(level=logging.ERROR)
        self.plan = plan
        self.failures = 0
        self.status_after_stop = 0
        """The exit status of the first failure after a stop signal (0: none)."""

    def emit(self, record: logging.LogRecord) -> None:
        """Report a record ``failed (exitcode: C) local_rank: R (pid: P) ...``."""
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 3:
            return
        code, local_rank, pid = args[:3]
        self.failures += 1
        what = (f"worker local rank {local_rank} (pid {pid}) of node rank "
                f"{self.plan.node_rank} {describe_exit(int(code))}")
        if os.environ.get(STOP_ENV):
            self.status_after_stop = self.status_after_stop or exit_status(int(code))
            _stderr(f"{what}; the run was asked to stop, so it is not restarted")
        elif self.failures <= self.plan.max_restarts:
            _stderr(f"{what}; restarting the worker group (restart {self.failures} of "
                    f"{self.plan.max_restarts}, --max-restarts): the run continues from its "
                    "newest complete checkpoint")
        else:
            restarts = (f"all {self.plan.max_restarts} restart(s) used" if self.plan.max_restarts
                        else "no restarts (--max-restarts 0)")
            _stderr(f"{what}; {restarts}: stopping the other workers")

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Listen to the agent's log while the block runs."""
        agent_log = logging.getLogger(self.AGENT_LOGGER)
        agent_log.addHandler(self)
        try:
            yield
        finally:
            agent_log.removeHandler(self)


class StoppedBeforeStart(BaseException):
    """A stop signal arrived while no worker ran (the rendezvous, or between attempts):
    raised out of the agent, which then shuts down (a ``BaseException``, so the agent's own
    handlers let it through)."""


class StopForwarding:
    """Passes SIGTERM, SIGINT and SIGUSR1 on to the workers (checkpoint, then exit 0) and
    keeps a restart from starting new ones after that; with no worker running, ends the
    launch (:class:`StoppedBeforeStart`)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopForwarding:
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.environ.pop(STOP_ENV, None)

    def _forward(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        first = self.signal_name is None
        if first:
            self.signal_name = name
            os.environ[STOP_ENV] = name  # inherited by workers a restart would start
        pids = worker_pids()
        if not pids:
            raise StoppedBeforeStart(name)
        if first:
            _stderr(f"{name}: asking the workers to checkpoint and stop")
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


@contextmanager
def _noting_the_first_group() -> Iterator[None]:
    """Set :data:`STARTED_ENV` once workers run (polled: a group lives far longer)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if worker_pids():
                os.environ[STARTED_ENV] = "1"
                return

    thread = threading.Thread(target=watch, name="reasonctl-first-group", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.environ.pop(STARTED_ENV, None)


def worker_pids() -> list[int]:
    """The running children of this process (the agent's workers), from ``/proc``."""
    me = os.getpid()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 1 and fields[1] == str(me) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment (the workers inherit it) for the
    block."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
