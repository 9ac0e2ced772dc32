"""Tests that run a function in several gloo processes: spawn them on a free port, join
them, and give each a process group that it leaves together with its peers."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.storage_servers import free_port


def run_gloo_workers(target: Callable[..., None], world: int, *args: Any,
                     timeout: float = 300) -> None:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes; each must
    exit 0."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    port = free_port()
    workers = [context.Process(target=target, args=(rank, world, port, *args))
               for rank in range(world)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=timeout)
    assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This process's default group (one thread for torch); when the body completes the
    ranks meet at a barrier before tearing it down, so that no rank closes its gloo
    connections while a peer still talks on them."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
