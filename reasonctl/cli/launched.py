"""In a worker started by a launcher (``reasonctl run --nproc-per-node``, or torchrun):
what happens before the run starts.

- :func:`follow_launcher`: the worker receives SIGTERM (checkpoint, then stop) when its
  launcher dies.
- :func:`stop_requested`: a worker that a restart started after the launcher was asked to
  stop does not train.
- :func:`resume_after_restart`: a worker of a group started again (a restart after a
  failure, which torch's agent counts in ``TORCHELASTIC_RESTART_COUNT``, or a node joining
  or leaving the rendezvous, which it does not count) resumes from the run's newest
  complete checkpoint and says which restart this is and from which step.
- :func:`node_config_differences`: the nodes of a multi-node run compare their configs
  through the rendezvous store before anything is built, and a difference is a usage error
  naming the keys.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from reasonctl.cli.launch import LAUNCHER_PID_ENV, NODE_RANK_ENV, STARTED_ENV, STOP_ENV
from reasonctl.core.config import RunConfig

AGREEMENT_TIMEOUT_S = 300.0
"""How long a node waits for the others' configs (they start together after the
rendezvous, so only a node that failed to start makes it wait that long)."""
MAX_SHOWN = 12
_AGREEMENT_STORE: Any = None
"""The store of the config check, kept for the process's life (on rank 0 its server is the
one the process group joins)."""
_PR_SET_PDEATHSIG = 1


def prepare_worker(config: RunConfig) -> None:
    """Before a launched worker's run: follow the launcher, stop at once (exit 0) when it
    was asked to stop before this worker started, check that every node runs the same
    config (exit 2 naming the keys), resume after a restart (and say so on rank 0)."""
    import typer

    from reasonctl.cli.common import console, fail

    follow_launcher()
    first = os.environ.get("RANK", "0") == "0"
    stopped = stop_requested()
    if stopped:
        if first:
            console.print(f"not starting: the launcher received {stopped} before this restart",
                          highlight=False)
        raise typer.Exit(0)
    differences = node_config_differences(config)
    if differences:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            fail(differences, code=2)
        raise typer.Exit(2)
    line = resume_after_restart(config)
    if line and first:
        console.print(line, highlight=False, soft_wrap=True)


def follow_launcher() -> None:
    """Receive SIGTERM when the launcher dies (checkpoint, then stop).

    Uses the kernel's parent-death signal on Linux; elsewhere, or when the launcher is not
    reasonctl's, a daemon thread polls for the parent once a second.
    """
    expected = os.environ.get(LAUNCHER_PID_ENV)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGTERM):
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="reasonctl-launcher-watch", daemon=True).start()


def stop_requested() -> str | None:
    """The stop signal its launcher received before this worker started, if any."""
    return os.environ.get(STOP_ENV) or None


def restart_count() -> int:
    """Which restart of the worker group this process belongs to (0: the first start)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def resume_after_restart(config: RunConfig) -> str | None:
    """In a group started again, resume ``config`` from the newest complete checkpoint of
    its output directory (when there is one); the line that says so (``None`` on the first
    start)."""
    from reasonctl.core.checkpoint import CheckpointManager

    restart = restart_count()
    if restart == 0 and not os.environ.get(STARTED_ENV):
        return None
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    root = Path(config.run.output_dir) / "checkpoints"
    complete = CheckpointManager(root, keep=1, is_main=False).complete()
    head = (f"restart {restart} of {limit} (--max-restarts) after a worker failed" if restart
            else "the worker group started again (a node joined or left the rendezvous)")
    if not complete:
        where = (f"from {config.run.resume}" if isinstance(config.run.resume, str)
                 else "from step 0")
        return f"{head}: no complete checkpoint was written yet; starting again {where}"
    config.run.resume = True
    newest = complete[-1]
    return f"{head}: resuming from step {newest.step} ({newest.path})"


def node_config_differences(config: RunConfig, *,
                            timeout_s: float = AGREEMENT_TIMEOUT_S) -> str | None:
    """On a multi-node run, compare this node's resolved config with node 0's through the
    rendezvous store; a message naming the nodes and keys that differ (``None`` when all
    agree or on one node)."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    from torch.distributed import TCPStore

    global _AGREEMENT_STORE
    # rank 0 hosts the store the process group uses next (the same server: multi-tenant),
    # unless torch's agent hosts it
    hosts = (os.environ.get("RANK") == "0"
             and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True))
    store = _AGREEMENT_STORE = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=hosts,
        multi_tenant=True, timeout=timedelta(seconds=timeout_s))
    # the launcher gives every round of the rendezvous a store of its own, so one prefix
    # serves (restart counts differ between nodes: a node that left and joined again)
    prefix = f"reasonctl/config/{nodes}/"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        mine = {"host": socket.gethostname(), "launcher": os.environ.get(NODE_RANK_ENV, "?"),
                "config": _flat(config.to_dict(redact=True))}
        store.set(prefix + os.environ.get("GROUP_RANK", "0"), json.dumps(mine))
    keys = [prefix + str(node) for node in range(nodes)]
    try:
        store.wait(keys)
    except Exception as exc:  # the store's timeout
        missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        return (f"node(s) {', '.join(missing)} of the rendezvous did not report their "
                f"config within {timeout_s:g}s ({exc}); check their launchers' logs")
    views = {node: json.loads(store.get(key)) for node, key in enumerate(keys)}
    return _differences(views)


def _differences(views: dict[int, dict[str, Any]]) -> str | None:
    reference = views[0]
    lines = []
    for node, view in views.items():
        if node == 0:
            continue
        theirs, ours = view["config"], reference["config"]
        keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        for key in keys[:MAX_SHOWN]:
            lines.append(f"  - {key}: {_shown(ours.get(key))} on {_who(0, reference)}, "
                         f"{_shown(theirs.get(key))} on {_who(node, view)}")
        if len(keys) > MAX_SHOWN:
            lines.append(f"  - ... and {len(keys) - MAX_SHOWN} more key(s) on {_who(node, view)}")
    if not lines:
        return None
    return ("the nodes of this run were started with different configs (every node must "
            "resolve the same --config files, --set values and REASONCTL_* variables):\n"
            + "\n".join(lines))


def _who(node: int, view: dict[str, Any]) -> str:
    return f"node {node} (host {view['host']}, --node-rank {view['launcher']})"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _set_parent_death_signal(sig: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
