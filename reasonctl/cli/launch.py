"""Multi-process runs through torch's elastic launcher (``torch.distributed.run``)."""

from __future__ import annotations

import sys


def launch_elastic(run_args: list[str], nproc_per_node: int, nnodes: int, node_rank: int,
                   rdzv_endpoint: str | None) -> int:
    """Start ``python -m reasonctl <run_args>`` on every local rank; return the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    launcher = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes)]
    if nnodes == 1 and rdzv_endpoint is None:
        launcher.append("--standalone")
    else:
        if rdzv_endpoint is None:
            print("error: multi-node runs need --rdzv-endpoint HOST:PORT", file=sys.stderr)
            return 2
        launcher += ["--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "reasonctl"]
    args = get_args_parser().parse_args([*launcher, "-m", "reasonctl", *run_args])
    try:
        elastic_run(args)
    except ChildFailedError as exc:
        print(f"error: a worker failed: {exc.get_first_failure()[1].message}", file=sys.stderr)
        return 1
    return 0
