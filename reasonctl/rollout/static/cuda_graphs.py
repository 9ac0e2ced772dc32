"""CUDA graphs of the decode step, one per batch-size bucket, captured once and replayed.

The step being captured must read its inputs from, and write its outputs to, tensors
whose storage stays put (static buffers, the slot cache, the model's parameters), and must
not synchronise with the host. Updating weights in place (``param.copy_``) keeps graphs
valid; reallocating the buffers does not, so the owner builds a new :class:`DecodeGraphs`
whenever it reallocates them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_RUNS = 2


class DecodeGraphs:
    """Captures ``step(batch, *variant)`` per batch size and variant on first use and
    replays it afterwards.

    ``step`` runs the decode forward pass for the first ``batch`` slots (``variant``: the
    step's other hashable arguments, e.g. whether the output head runs); running it twice
    with the same buffer contents must give the same result, since warm-up runs it for
    real before capture. All graphs share one memory pool.
    """

    def __init__(self, step: Callable[..., None]) -> None:
        self.step = step
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, batch: int, *variant: object) -> None:
        """Replay the graph of ``batch`` slots and ``variant``, capturing it first if
        needed."""
        key = (batch, *variant)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        graph.replay()

    def _capture(self, key: tuple) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.step(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # autocast's weight-cast cache must be off while capturing: a cached cast made
        # outside the graph would be freed while the graph still reads it
        with _autocast_without_cache(), torch.cuda.graph(graph, pool=self.pool):
            self.step(*key)
        return graph


def _autocast_without_cache() -> torch.autocast:
    return torch.autocast(
        "cuda", dtype=torch.get_autocast_dtype("cuda"),
        enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False,
    )
