"""Tiny pipelines, media data and run configs shared by the diffusion tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three tiny pipeline families, built once per session."""
    from reasonctl.diffusion.tiny import make_tiny_pipeline_dir

    root = tmp_path_factory.mktemp("pipelines")
    return {family: make_tiny_pipeline_dir(root / family, family)
            for family in ("sd3", "wan", "cosmos")}


def write_clip(path: Path, value: int | tuple[int, int, int], frames: int = 5,
               size: int = 32) -> Path:
    """An mp4 of ``frames`` solid frames of colour ``value``."""
    from reasonctl.diffusion.media import write_video

    colour = (value,) * 3 if isinstance(value, int) else value
    clip = np.broadcast_to(np.asarray(colour, dtype=np.uint8), (frames, size, size, 3)).copy()
    return write_video(path, clip, fps=4)


def write_video_text(root: Path, captions: dict[str, str], *, value: int = 220,
                     frames: int = 5) -> Path:
    """``root/videos/<stem>.mp4`` + ``root/metas/<stem>.txt`` for each caption."""
    for stem, caption in captions.items():
        write_clip(root / "videos" / f"{stem}.mp4", value, frames)
        (root / "metas").mkdir(parents=True, exist_ok=True)
        (root / "metas" / f"{stem}.txt").write_text(caption + "\n")
    return root


def run_config(out: Path, model: Path, *, algorithm: str = "flow_grpo", steps: int = 2,
               frames: int = 1, size: int = 32, lora: dict[str, Any] | None = None,
               **options: Any) -> dict[str, Any]:
    """A small diffusion run on the CPU (mock prompts, brightness reward); ``lora`` is the
    ``[model.lora]`` section, ``options`` the algorithm's."""
    algo = {"prompts_per_step": 2, "frames": frames, "height": size, "width": size,
            "sample_steps": 4, "train_fraction": 0.5, "eval_steps": 4,
            "max_text_tokens": 8, **options}
    model_section: dict[str, Any] = {"name_or_path": str(model)}
    if lora is not None:
        model_section["lora"] = lora
    return {
        "run": {"output_dir": str(out), "seed": 0},
        "model": model_section,
        "data": {"format": "mock_media", "mock_media": {"samples": 8}},
        "algorithm": {"name": algorithm, algorithm: algo},
        "rollout": {"n": 2},
        "train": {"lr": 3e-3, "max_steps": steps, "micro_batch_size": 4},
        "backend": {"name": "single", "device": "cpu"},
        "rewards": {"components": [{"name": "brightness"}]},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch_run(values: dict[str, Any], config_file: Path, processes: int, *,
               timeout: float = 900) -> str:
    """``reasonctl run --nproc-per-node processes`` on ``values`` written to ``config_file``
    (one thread per process); it must exit 0. Returns what it printed."""
    import os
    import subprocess
    import sys

    import tomli_w

    config_file.write_text(tomli_w.dumps(values))
    command = [sys.executable, "-m", "reasonctl", "run", "--nproc-per-node", str(processes),
               "--config", str(config_file)]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr
