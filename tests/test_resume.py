"""A resumed run ends exactly where the uninterrupted run ends (CPU, same seed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reasonctl import hookimpl
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.sdk.api import run

STEPS = 8


def chat(question: str, answer: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=question)]),
                   Message("assistant", [ContentPart("text", text=answer)])])


def samples() -> list[Sample]:
    return [chat(f"spell {w}", f"<answer>{' '.join(w)}</answer>")
            for w in ("cat", "dog", "sun", "tree", "bird", "fish", "moon")]


def config(output_dir: Path, **run_section: Any) -> dict[str, Any]:
    return {
        "run": {"output_dir": str(output_dir), "seed": 7, **run_section},
        # 7 samples, batches of 3: batches straddle epochs, so the data position matters
        "train": {"lr": 5e-3, "max_steps": STEPS, "global_batch_size": 3,
                  "micro_batch_size": 1, "schedule": "cosine",
                  "warmup_steps": 2, "weight_decay": 0.1},
        "backend": {"name": "single", "device": "cpu"},
        "logging": {"loggers": []},
        "checkpoint": {"every_steps": 3, "keep": 2},
    }


class Losses:
    def __init__(self, stop_at: int | None = None) -> None:
        self.by_step: dict[int, float] = {}
        self.stop_at = stop_at

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.by_step[step] = metrics["loss"]
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # what a cluster scheduler sends


def weights(export_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no weights in {export_dir}"
    return tensors


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = weights(a), weights(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Losses]:
    out = tmp_path_factory.mktemp("uninterrupted")
    losses = Losses()
    result = run(config(out), datasets=samples(), plugins=[losses])
    assert result.status == "completed"
    return out, losses


def test_signal_then_resume_matches_uninterrupted_run(
    tmp_path: Path, uninterrupted: tuple[Path, Losses]
) -> None:
    reference_dir, reference = uninterrupted
    first = Losses(stop_at=5)
    result = run(config(tmp_path), datasets=samples(), plugins=[first])
    assert result.status == "interrupted" and result.steps == 5
    assert (tmp_path / "checkpoints" / "step_5" / "manifest.json").is_file()
    assert not (tmp_path / "export").exists()

    second = Losses()
    result = run(config(tmp_path, resume=True), datasets=samples(), plugins=[second])
    assert result.status == "completed" and result.steps == STEPS
    assert sorted(second.by_step) == list(range(6, STEPS + 1))
    for step in range(6, STEPS + 1):
        assert second.by_step[step] == reference.by_step[step], step
    assert_same_weights(tmp_path / "export" / "final", reference_dir / "export" / "final")


def test_torn_checkpoint_is_skipped(tmp_path: Path, uninterrupted: tuple[Path, Losses]) -> None:
    reference_dir, reference = uninterrupted
    run(config(tmp_path), datasets=samples(), plugins=[Losses(stop_at=4)])
    # the periodic checkpoint at step 3 is complete; fake a newer one that died mid-write
    torn = tmp_path / "checkpoints" / "step_6" / "state"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "step_4").rename(tmp_path / "checkpoints" / ".tmp-step_4")
    resumed = Losses()
    result = run(config(tmp_path, resume=True), datasets=samples(), plugins=[resumed])
    assert result.status == "completed"
    assert min(resumed.by_step) == 4  # resumed from step_3
    assert resumed.by_step[STEPS] == reference.by_step[STEPS]
    assert_same_weights(tmp_path / "export" / "final", reference_dir / "export" / "final")


WORKER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_resume import config, samples
from reasonctl import hookimpl
from reasonctl.sdk.api import run

class Slow:
    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        time.sleep(0.5)

run(config(Path({out!r})), datasets=samples(), plugins=[Slow()])
"""


@pytest.mark.slow
def test_killed_process_resumes_to_the_same_result(
    tmp_path: Path, uninterrupted: tuple[Path, Losses]
) -> None:
    reference_dir, reference = uninterrupted
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(tests=str(Path(__file__).parent),
                                                    out=str(tmp_path / "run"))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_3" / "manifest.json"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert checkpoint.exists(), proc.stderr.read().decode() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)  # no chance to save anything more
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "export").exists()

    resumed = Losses()
    result = run(config(tmp_path / "run", resume=True), datasets=samples(), plugins=[resumed])
    assert result.status == "completed"
    assert resumed.by_step[STEPS] == reference.by_step[STEPS]
    assert_same_weights(tmp_path / "run" / "export" / "final",
                        reference_dir / "export" / "final")
