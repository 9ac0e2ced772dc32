"""Checkpoints written in the background (``checkpoint.async_save``): committed only once
written, a snapshot of the step they were taken at, failures reported, resume exact."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from reasonctl.core.checkpoint import CheckpointManager, CheckpointWriteError


def write_into(future: Future[Any] | None):
    """A backend save that writes a file now and finishes as ``future`` says."""
    def write_state(directory: Path) -> Future[Any] | None:
        directory.mkdir(parents=True)
        (directory / "weights.bin").write_bytes(b"w")
        return future
    return write_state


def test_background_checkpoint_is_committed_only_when_written(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, is_main=True)
    committed: list[Path] = []
    manager.save(1, write_into(None), {"algorithm": {}}, on_commit=committed.append)
    assert committed == [tmp_path / "step_1"] and manager.last_committed == committed[0]

    writing: Future[Any] = Future()
    assert manager.save(2, write_into(writing), {"algorithm": {"x": 2}},
                        on_commit=committed.append) is None
    manager.poll()  # still being written: nothing changes
    assert [c.step for c in manager.complete()] == [1]
    assert (tmp_path / ".tmp-step_2" / "state" / "weights.bin").is_file()
    assert manager.latest().step == 1  # a resume now would use the complete one

    writing.set_result(None)
    manager.poll()
    assert [c.step for c in manager.complete()] == [1, 2]
    assert committed[-1] == tmp_path / "step_2" and manager.pending.committed
    assert json.loads((tmp_path / "step_2" / "manifest.json").read_text())["algorithm"] == {
        "x": 2}

    # a write still in flight is finished before the next checkpoint starts; pruning
    # keeps the newest two
    third: Future[Any] = Future()
    manager.save(3, write_into(third), {}, on_commit=committed.append)
    third.set_result(None)
    manager.save(4, write_into(None), {}, on_commit=committed.append)
    assert [c.step for c in manager.complete()] == [3, 4]
    assert [p.name for p in committed] == ["step_1", "step_2", "step_3", "step_4"]


def test_failed_background_write_is_reported_and_loses_nothing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, is_main=True)
    manager.save(1, write_into(None), {})
    failing: Future[Any] = Future()
    manager.save(2, write_into(failing), {})
    failing.set_exception(OSError(28, "No space left on device"))
    manager.poll()  # not raised here: every rank reports it at the next collective point
    with pytest.raises(CheckpointWriteError,
                       match=r"step 2 .*the disk is full .*No space left on device.*Earlier "
                             r"checkpoints are intact \(the newest complete checkpoint is "
                             r".*step_1\)"):
        manager.wait()
    assert [c.step for c in manager.complete()] == [1]
    assert manager.latest().step == 1
    assert not (tmp_path / ".tmp-step_2").exists()  # the partial write's space is freed
    manager.wait()  # nothing pending any more


def test_async_save_is_a_snapshot_of_the_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Training may change the weights while the write runs: the checkpoint still holds
    the weights of the step it was taken at."""
    from test_backend_single import make_backend, nll_loss, token_batch

    backend = make_backend(tiny_model_dir, tmp_path / "run")
    batch = token_batch([12, 12])
    total = int(batch["loss_mask"][:, 1:].sum())
    backend.train_step([batch], nll_loss(total))
    saved = {k: v.clone() for k, v in backend.hf_model.state_dict().items()}
    future = backend.save_checkpoint(tmp_path / "ckpt", asynchronous=True)
    assert isinstance(future, Future)
    for _ in range(3):  # training goes on while (or before) the thread writes
        backend.train_step([batch], nll_loss(total))
    future.result(timeout=120)
    changed = backend.hf_model.state_dict()
    assert any(not torch.equal(saved[k], changed[k]) for k in saved)

    restored = make_backend(tiny_model_dir, tmp_path / "other")
    restored.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in restored.hf_model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_resume_from_background_checkpoints_matches_the_uninterrupted_run(
        tmp_path: Path) -> None:
    from test_resume import STEPS, Losses, assert_same_weights, config, samples

    from reasonctl import hookimpl
    from reasonctl.sdk.api import run

    def async_config(out: Path, **run_section: Any) -> dict[str, Any]:
        values = config(out, **run_section)
        values["checkpoint"] = {"every_steps": 2, "keep": 2, "async_save": True}
        return values

    class Saved:
        def __init__(self) -> None:
            self.paths: list[Path] = []

        @hookimpl
        def on_checkpoint_saved(self, ctx: Any, step: int, path: Path) -> None:
            assert (path / "manifest.json").is_file() and path.name == f"step_{step}"
            self.paths.append(path)

    reference_losses, saved = Losses(), Saved()
    result = run(async_config(tmp_path / "whole"), datasets=samples(),
                 plugins=[reference_losses, saved])
    assert result.status == "completed"
    assert [p.name for p in saved.paths] == ["step_2", "step_4", "step_6", "step_8"]
    assert result.checkpoint_dir == tmp_path / "whole" / "checkpoints" / "step_8"

    first = Losses(stop_at=5)  # signal at step 5: its checkpoint is written in the background
    result = run(async_config(tmp_path / "split"), datasets=samples(), plugins=[first])
    assert result.status == "interrupted"
    assert result.checkpoint_dir == tmp_path / "split" / "checkpoints" / "step_5"
    second = Losses()
    result = run(async_config(tmp_path / "split", resume=True), datasets=samples(),
                 plugins=[second])
    assert result.status == "completed" and min(second.by_step) == 6
    for step in range(6, STEPS + 1):
        assert second.by_step[step] == reference_losses.by_step[step], step
    assert_same_weights(tmp_path / "split" / "export" / "final",
                        tmp_path / "whole" / "export" / "final")


def test_every_checkpoint_exported_into_its_directory(tmp_path: Path) -> None:
    from test_resume import STEPS, assert_same_weights, config, samples

    from reasonctl.sdk.api import run

    values = config(tmp_path)
    values["checkpoint"] = {"every_steps": 4, "keep": 3, "async_save": True,
                            "export_every_checkpoint": True}
    result = run(values, datasets=samples())
    assert result.status == "completed"
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_4", f"step_{STEPS}"]
    for step in (4, STEPS):
        assert (checkpoints / f"step_{step}" / "export" / "config.json").is_file()
    assert_same_weights(checkpoints / f"step_{STEPS}" / "export", tmp_path / "export" / "final")
