"""CUDA graphs of the decode step, one per batch-size bucket, captured once and replayed.

The step being captured must read its inputs from, and write its outputs to, tensors
whose storage stays put (static buffers, the slot cache, the model's parameters), and must
not synchronise with the host. Updating weights in place (``param.copy_``) keeps graphs
valid; reallocating the buffers does not, so the owner builds a new :class:`DecodeGraphs`
whenever it reallocates them.

:meth:`DecodeGraphs.run_or_capture` holds graphs of work that moves state on (a window of
several decode steps with their sampling and bookkeeping), which cannot be run twice for
warm-up: such work runs eagerly the first time its key is seen, which warms it up, and is
captured the second time.
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
        self._seen: set[tuple] = set()  # keys of run_or_capture that ran eagerly once

    def run(self, batch: int, *variant: object) -> None:
        """Replay the graph of ``batch`` slots and ``variant``, capturing it first if
        needed."""
        key = (batch, *variant)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        graph.replay()

    def run_or_capture(self, key: tuple, work: Callable[[], None]) -> bool:
        """Run ``work``: eagerly the first time ``key`` is seen, then as a graph captured
        on the second call (not run for warm-up: the eager run was its warm-up) and
        replayed on every later one. ``key`` must name everything ``work`` bakes into a
        graph (sizes, scalars, which buffers). Returns True when a graph ran."""
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                work()
                return False
            graph = torch.cuda.CUDAGraph()
            with _autocast_without_cache(), torch.cuda.graph(graph, pool=self.pool):
                work()
            self.graphs[key] = graph
        graph.replay()
        return True

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
