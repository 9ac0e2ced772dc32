"""A checkpoint of HSDP 2 x 2 on four gloo processes (the layout said once in the log)
resumes on two processes and on one with the losses and gradient norms of the unbroken
four-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reasonctl.loggers.metrics_file import read_metrics
from tests.test_fsdp import STEPS, launch, run_in_process, write_run_files


def curve(output_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"])
            for r in read_metrics(output_dir / "metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_checkpoint_of_four_processes_resumes_on_two_and_one(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    unbroken = tmp_path / "hsdp4"
    output = launch(config, unbroken, "--set", "backend.fsdp.dp_replicate=2", processes=4)
    assert output.count("fsdp: HSDP, 2 replicas (dp_replicate) x 2 shards") == 1, output
    checkpoint = unbroken / "checkpoints" / "step_3"
    assert len(list((checkpoint / "state").glob("*.distcp"))) == 4
    resume = f"run.resume={json.dumps(str(checkpoint))}"
    on_two = tmp_path / "on-two"
    launch(config, on_two, "--set", resume, processes=2)
    on_one = tmp_path / "on-one"
    result = run_in_process(config, f"run.output_dir={on_one}", "backend.name=single", resume)
    assert result.status == "completed"
    want = curve(unbroken)
    assert sorted(want) == list(range(1, STEPS + 1))
    for got in (curve(on_two), curve(on_one)):
        assert sorted(got) == list(range(4, STEPS + 1))
        for step, (loss, norm) in got.items():
            assert loss == pytest.approx(want[step][0], rel=1e-5), step
            assert norm == pytest.approx(want[step][1], rel=1e-4), step
