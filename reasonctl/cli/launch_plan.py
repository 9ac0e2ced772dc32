"""The launcher's flags, checked before anything starts (exit 2 naming the flag to fix):
``--nproc-per-node``, ``--nnodes N|MIN:MAX``, ``--node-rank``, ``--rdzv-endpoint
HOST[:PORT]``, ``--rdzv-id``, ``--max-restarts`` and ``--rdzv-timeout``."""

from __future__ import annotations

import hashlib
import re
import socket
import uuid
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from reasonctl.core.errors import UsageError

DEFAULT_PORT = 29400
"""The rendezvous port when ``--rdzv-endpoint`` names only a host (torch's default)."""
_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")


@dataclass(frozen=True)
class LaunchPlan:
    """The launcher's settings, checked (:func:`plan_launch`)."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    endpoint: str
    """``HOST:PORT`` of the rendezvous."""
    run_id: str
    max_restarts: int
    node_rank: int
    rdzv_timeout_s: int

    @property
    def nodes_text(self) -> str:
        """``--nnodes`` as given back to the user (``2`` or ``1:4``)."""
        if self.min_nodes == self.max_nodes:
            return str(self.min_nodes)
        return f"{self.min_nodes}:{self.max_nodes}"

    def process_counts(self) -> list[int]:
        """Every number of processes the run may have (one per possible node count)."""
        return [n * self.nproc_per_node for n in range(self.min_nodes, self.max_nodes + 1)]


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as ``(min, max)``; :class:`UsageError` otherwise."""
    text = value.strip()
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise UsageError(f"--nnodes {value!r}: expected a node count N or a range MIN:MAX "
                         "of whole numbers, e.g. --nnodes 2 or --nnodes 1:4") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise UsageError(f"--nnodes {value!r}: expected 1 <= MIN <= MAX (e.g. --nnodes 2 or "
                         "--nnodes 1:4)")
    return bounds


def parse_endpoint(value: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[IPv6]:PORT`` for IPv6) as ``(host, port)``, the port
    :data:`DEFAULT_PORT` when absent; :class:`UsageError` when malformed or when the host
    cannot be resolved."""
    text = value.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else (None if not rest else "bad")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, None
    usage = (f"--rdzv-endpoint {value!r}: expected HOST:PORT of the rendezvous, e.g. "
             f"node001:{DEFAULT_PORT} or 10.0.0.1:{DEFAULT_PORT} (the same on every node)")
    if not host or not _HOST.match(host):
        raise UsageError(usage)
    port = DEFAULT_PORT
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise UsageError(f"{usage}; the port must be a number from 1 to 65535")
        port = int(port_text)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"--rdzv-endpoint {value!r}: cannot resolve the host {host!r} "
                         f"({exc.strerror or exc}); give node 0's name or address as the "
                         "other nodes reach it") from None
    return host, port


def plan_launch(*, nproc_per_node: int, nnodes: str, node_rank: int | None,
                rdzv_endpoint: str | None, rdzv_id: str | None, max_restarts: int,
                rdzv_timeout_s: int, output_dir: str) -> LaunchPlan:
    """Check the launcher's flags; :class:`UsageError` names the first one to fix."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if max_nodes > 1 and rdzv_endpoint is None:
        raise UsageError(f"--nnodes {nnodes}: a multi-node run needs --rdzv-endpoint "
                         f"HOST:PORT, an address of node 0 that every node reaches (e.g. "
                         f"--rdzv-endpoint node001:{DEFAULT_PORT}), the same on every node")
    if max_nodes > 1 and node_rank is None:
        raise UsageError(f"--nnodes {nnodes}: give each node's launcher --node-rank (0 on "
                         "the node that holds the output directory's lock, 1, 2, ... on the "
                         "others; under SLURM --node-rank $SLURM_NODEID)")
    rank = node_rank or 0
    if rank >= max_nodes:
        raise UsageError(f"--node-rank {rank}: the run has at most {max_nodes} node(s) "
                         f"(--nnodes {nnodes}), so node ranks go from 0 to {max_nodes - 1}")
    if rdzv_id is not None and not _RUN_ID.match(rdzv_id):
        raise UsageError(f"--rdzv-id {rdzv_id!r}: use letters, digits, '.', '_' or '-' (at "
                         "most 128), e.g. --rdzv-id $SLURM_JOB_ID")
    if rdzv_endpoint is not None:
        host, port = parse_endpoint(rdzv_endpoint)
        endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    if rdzv_id is None:  # every node of one run derives the same id from its output dir
        digest = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:12]
        rdzv_id = f"reasonctl-{digest}" if max_nodes > 1 else f"reasonctl-{uuid.uuid4().hex}"
    return LaunchPlan(nproc_per_node=nproc_per_node, min_nodes=min_nodes, max_nodes=max_nodes,
                      endpoint=endpoint, run_id=rdzv_id, max_restarts=max_restarts,
                      node_rank=rank, rdzv_timeout_s=rdzv_timeout_s)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
