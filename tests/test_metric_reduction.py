"""Metrics over data-parallel ranks (2 gloo processes): means are averaged, while keys
ending in ``/max`` and ``/min`` (a rollout's longest response, the stalest batch a trainer
took) keep the largest and smallest value of any rank."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, port: int, result_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from reasonctl.backends.distributed import mean_over_processes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        local = {"loss": 1.0 + 2 * rank, "response_length/max": [40.0, 7.0][rank],
                 "async/staleness/max": [0.0, 1.0][rank], "reward/min": [0.5, -0.25][rank]}
        reduced = mean_over_processes(local, torch.device("cpu"))
        Path(result_dir, f"{rank}.json").write_text(json.dumps(reduced))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_maxima_and_minima_are_not_averaged(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    port = _free_port()
    context = mp.get_context("spawn")
    workers = [context.Process(target=_worker, args=(rank, port, str(tmp_path)))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    want = {"loss": 2.0, "response_length/max": 40.0, "async/staleness/max": 1.0,
            "reward/min": -0.25}
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == want
