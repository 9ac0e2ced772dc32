"""Language-model context parallelism combined with tensor parallelism (LoRA with context
parallelism is checked in ``test_context_parallel.py``): SFT with ``cp = 2`` x ``tp = 2`` on
4 processes follows the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_context_parallel import _launch, _losses, _run_in_process, _sft_config


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_cp_and_tp_pairs_matches_one_process(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    """``cp = 2`` x ``tp = 2`` on 4 processes: each holds half the heads of half of every
    sequence; the losses are the single-device run's."""
    config = _sft_config(tmp_path, tiny_model_dir)
    single, grid = tmp_path / "single", tmp_path / "cp2tp2"
    _run_in_process(config, f"run.output_dir={single}", "backend.name=single",
                    "checkpoint.every_steps=0")
    _launch(config, grid, "--set", "backend.fsdp.cp=2", "--set", "backend.fsdp.tp=2",
            "--set", "checkpoint.every_steps=0", processes=4)
    want, got = _losses(single), _losses(grid)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.mark.parametrize("key", ["cp", "tp"])
def test_a_parallel_layout_with_the_single_backend_is_refused_by_name(
        tmp_path: Path, tiny_model_dir: Path, key: str) -> None:
    """``--set backend.fsdp.cp=2`` with the (default) single backend ran whole sequences
    on one process without a word; it stops before loading anything (exit 2)."""
    import subprocess
    import sys

    config = _sft_config(tmp_path, tiny_model_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "reasonctl", "run", "--config", str(config), "--backend",
         "single", "--set", f"backend.fsdp.{key}=2", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"backend.fsdp.{key}: set by --set" in proc.stderr
    assert "'single' backend" in proc.stderr
    assert "add --backend fsdp (with --nproc-per-node N)" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
