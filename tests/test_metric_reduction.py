"""Metrics over data-parallel ranks (2 gloo processes): means are averaged, while keys
ending in ``/max`` and ``/min`` (a rollout's longest response, the stalest batch a trainer
took) keep the largest and smallest value of any rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gloo_workers import gloo_group, run_gloo_workers


def _worker(rank: int, world: int, port: int, result_dir: str) -> None:
    import torch

    from reasonctl.backends.distributed import mean_over_processes

    with gloo_group(rank, world, port):
        local = {"loss": 1.0 + 2 * rank, "response_length/max": [40.0, 7.0][rank],
                 "async/staleness/max": [0.0, 1.0][rank], "reward/min": [0.5, -0.25][rank]}
        reduced = mean_over_processes(local, torch.device("cpu"))
        Path(result_dir, f"{rank}.json").write_text(json.dumps(reduced))


@pytest.mark.distributed
def test_maxima_and_minima_are_not_averaged(tmp_path: Path) -> None:
    run_gloo_workers(_worker, 2, str(tmp_path), timeout=120)
    want = {"loss": 2.0, "response_length/max": 40.0, "async/staleness/max": 1.0,
            "reward/min": -0.25}
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == want
