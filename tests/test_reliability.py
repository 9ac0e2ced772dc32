"""Faults a long run meets, on the toy components (fast): config drift on resume, lineage
and pruning, non-finite steps, signals after training, the output lock, crafted checkpoint
files, checkpoint write errors on every rank, and secrets in errors and tracebacks.

The slower part of the campaign (SIGKILL points, launcher signals with two fsdp workers,
a full disk on one rank, crafted DCP metadata) is in ``test_fault_campaign.py``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import reasonctl
from reasonctl.core.checkpoint import CheckpointManager, CheckpointWriteError
from reasonctl.core.checkpoint_files import (
    CheckpointIntegrityError,
    UnsafeCheckpointError,
    load_rng_state,
)
from reasonctl.core.errors import NonFiniteError, RunAbandonedError
from reasonctl.core.output_lock import OutputDirInUse, output_lock
from reasonctl.core.resume import ResumeConfigError
from tests.toy_components import ToyBackend, ToyPlugin

BASE = ["algorithm.name=toy", "backend.name=toybackend", "logging.loggers=[]",
        "train.lr=0.1", "train.max_steps=12"]


def run_toy(out: Path, *extra: str, plugin: Any = None):
    plugin = plugin or ToyPlugin()
    config = reasonctl.load_config([], [*BASE, f"run.output_dir='{out}'", *extra],
                                   plugins=[plugin])
    return reasonctl.run(config, plugins=[plugin]), plugin


def steps(plugin: ToyPlugin) -> list[int]:
    return [e[1] for e in plugin.events if e[0] == "step"]


def checkpoint_steps(out: Path) -> list[int]:
    return [c.step for c in CheckpointManager(out / "checkpoints", keep=1,
                                              is_main=True).complete()]


# --- config drift -----------------------------------------------------------------------------


def test_resume_refuses_changed_settings_and_applies_them_on_request(tmp_path: Path) -> None:
    run_toy(tmp_path, "train.max_steps=6", "checkpoint.every_steps=3")
    saved_config = (tmp_path / "config.toml").read_text()
    with pytest.raises(ResumeConfigError) as refused:
        run_toy(tmp_path, "run.resume=true", "train.lr=0.2", "algorithm.toy.target=5.0")
    message = str(refused.value)
    assert "train.lr: 0.1 -> 0.2" in message and "algorithm.toy.target: 3.0 -> 5.0" in message
    assert "--resume-with-changes" in message
    assert (tmp_path / "config.toml").read_text() == saved_config  # nothing was touched
    assert checkpoint_steps(tmp_path) == [3, 6]

    # a longer run is not a change of what is trained: reported, not refused
    result, plugin = run_toy(tmp_path, "run.resume=true", "train.max_steps=8")
    assert steps(plugin) == [7, 8] and result.status == "completed"

    result, plugin = run_toy(tmp_path, "run.resume=true", "train.max_steps=10", "train.lr=0.2",
                             "run.resume_with_changes=true")
    assert steps(plugin) == [7, 8, 9, 10]  # no checkpoint after step 6 in the last run


def test_cli_maps_a_refused_resume_to_exit_code_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.cli.common import handle_errors

    def refuse() -> None:
        raise ResumeConfigError("run.resume: the config differs", ["train.lr: 1 -> 2"])

    app = build_app(reasonctl.core.plugins.PluginHost.load())
    app.command("refuse")(handle_errors(refuse))
    result = CliRunner().invoke(app, ["refuse"])
    assert result.exit_code == 2 and "the config differs" in result.output


# --- lineage ----------------------------------------------------------------------------------


def test_resuming_an_older_checkpoint_retires_the_abandoned_branch(tmp_path: Path) -> None:
    run_toy(tmp_path, "train.max_steps=10", "checkpoint.every_steps=5")
    assert checkpoint_steps(tmp_path) == [5, 10]
    older = tmp_path / "checkpoints" / "step_5"
    # keep = 1: pruning by step number used to delete the checkpoint just written (step 6)
    result, plugin = run_toy(tmp_path, f"run.resume='{older}'", "train.max_steps=8",
                             "checkpoint.every_steps=3", "checkpoint.keep=1")
    assert steps(plugin) == [6, 7, 8] and result.status == "completed"
    retired = list((tmp_path / "checkpoints").glob("retired-*/step_10/manifest.json"))
    assert len(retired) == 1  # moved aside intact, not deleted and not resumed
    assert checkpoint_steps(tmp_path) == [6]

    result, plugin = run_toy(tmp_path, "run.resume=true", "train.max_steps=9",
                             "checkpoint.every_steps=3", "checkpoint.keep=1")
    assert steps(plugin) == [7, 8, 9]  # from step_6 of the current lineage, not step_10
    assert checkpoint_steps(tmp_path) == [9]


def test_pruning_follows_the_lineage_and_keeps_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, is_main=True)

    def write(directory: Path) -> None:
        directory.mkdir()

    for step in (2, 4, 6):
        manager.save(step, write, {})
    found = manager.complete()
    assert [c.step for c in found] == [4, 6]
    assert found[1].manifest["lineage"]["parent"] == found[0].id
    # a new lineage starting from step 4: step 6 is not its ancestor
    fresh = CheckpointManager(tmp_path, keep=1, is_main=True)
    start = found[0]
    target, names = fresh.retire(start)
    assert names == ["step_6"] and (target / "step_6" / "manifest.json").is_file()
    fresh.begin(start)
    fresh.save(5, write, {})
    assert [c.step for c in fresh.complete()] == [5]  # keep=1: step 4 (its parent) pruned


def test_a_fresh_start_moves_earlier_checkpoints_aside(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    run_toy(tmp_path, "train.max_steps=4", "checkpoint.every_steps=2")
    run_toy(tmp_path, "train.max_steps=3", "checkpoint.every_steps=3")
    assert "moved 2 earlier checkpoint(s) (step_2, step_4)" in capsys.readouterr().err
    assert checkpoint_steps(tmp_path) == [3]
    assert len(list((tmp_path / "checkpoints").glob("retired-*/step_4"))) == 1


# --- non-finite steps -------------------------------------------------------------------------


def test_nonfinite_step_stops_the_run_without_export(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"step 5: non-finite loss nan and grad_norm nan"):
        run_toy(tmp_path, "algorithm.toy.nan_at_step=5", "checkpoint.every_steps=2")
    assert checkpoint_steps(tmp_path) == [2, 4]
    assert not (tmp_path / "export").exists()


def test_nonfinite_step_is_skipped_and_counted(tmp_path: Path) -> None:
    result, plugin = run_toy(tmp_path, "algorithm.toy.nan_at_step=5",
                             "train.on_nonfinite='skip'")
    assert result.status == "completed" and result.nonfinite_steps == 1
    assert (tmp_path / "export" / "final" / "weight.txt").is_file()


def test_export_refuses_nonfinite_weights(tmp_path: Path) -> None:
    import torch

    from reasonctl.backends.export import check_finite

    with pytest.raises(NonFiniteError, match=r"1 weight tensor\(s\) hold NaN.*lm_head.weight"):
        check_finite({"embed.weight": torch.ones(2), "lm_head.weight": torch.tensor([1.0,
                                                                                   float("inf")])})


# --- signals after training -------------------------------------------------------------------


class SignalledExport(ToyBackend):
    """Gets two SIGTERMs while exporting, as from an impatient scheduler."""

    def export(self, directory: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # acknowledged: the export goes on
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again (a forwarded copy)
        time.sleep(0.7)
        os.kill(os.getpid(), signal.SIGTERM)  # one more: abandons it
        time.sleep(1.0)
        super().export(directory)


class SignalledExportPlugin(ToyPlugin):
    @reasonctl.hookimpl
    def register_backends(self, register: Any) -> None:
        register("toybackend", SignalledExport)


def test_second_signal_during_the_final_export_abandons_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    plugin = SignalledExportPlugin()
    with pytest.raises(RunAbandonedError, match=r"SIGTERM received again during the final "
                                                r"export: abandoned the final export \(the "
                                                r"newest checkpoint .*step_12 is kept\)"):
        run_toy(tmp_path, "checkpoint.every_steps=6", plugin=plugin)
    assert "SIGTERM received during the final export; finishing it" in capsys.readouterr().err
    assert plugin.events[-1] == ("end", "failed")
    assert not (tmp_path / "export" / "final").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


# --- output directory lock --------------------------------------------------------------------

HOLDER = """
import sys, time
from pathlib import Path
from reasonctl.core.output_lock import output_lock
with output_lock(Path(sys.argv[1]), log=print):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_second_writer_is_refused_and_a_crashed_holder_is_taken_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirInUse, match=rf"in use by another run \(host .*, pid "
                                                 rf"{holder.pid}, since"):
            run_toy(tmp_path)
        assert not (tmp_path / "config.toml").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the record stays behind
        holder.wait()
    result, _ = run_toy(tmp_path)
    assert result.status == "completed"
    assert f"pid {holder.pid}) ended without releasing it; taking over" in \
        capsys.readouterr().err
    with output_lock(tmp_path, log=print):  # released by the run that finished
        pass


# --- crafted checkpoint files -----------------------------------------------------------------


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_crafted_random_state_file_is_refused_without_running_it(tmp_path: Path) -> None:
    import torch

    from reasonctl.core.checkpoint_files import file_list

    run_toy(tmp_path / "run", "train.max_steps=4", "checkpoint.every_steps=4")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_4"
    marker = tmp_path / "code-ran"
    torch.save({"python": RunsCode(marker)}, checkpoint / "rng_rank0.pt")

    # the file no longer matches the manifest: a resume skips the checkpoint as damaged
    result, plugin = run_toy(tmp_path / "run", "run.resume=true", "train.max_steps=4")
    assert steps(plugin) == [1, 2, 3, 4] and not marker.exists()
    run_toy(tmp_path / "run2", "train.max_steps=4", "checkpoint.every_steps=4")
    checkpoint = tmp_path / "run2" / "checkpoints" / "step_4"
    torch.save({"python": RunsCode(marker)}, checkpoint / "rng_rank0.pt")
    with pytest.raises(CheckpointIntegrityError, match=r"damaged checkpoint .*rng_rank0.pt"):
        run_toy(tmp_path / "run2", f"run.resume='{checkpoint}'")

    # whoever can write the file can rewrite the manifest too: the load itself refuses it
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in file_list(checkpoint).items()
                         if k != "manifest.json"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        run_toy(tmp_path / "run2", f"run.resume='{checkpoint}'")
    with pytest.raises(UnsafeCheckpointError):
        load_rng_state(checkpoint / "rng_rank0.pt")
    assert not marker.exists()


# --- checkpoint write errors ------------------------------------------------------------------


def test_every_write_error_becomes_checkpoint_write_error(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))

    def dcp_failure(directory: Path) -> None:  # what torch's DCP raises: a BaseException
        directory.mkdir()
        raise CheckpointException("save failed", {1: (full, None)})

    manager = CheckpointManager(tmp_path, keep=2, is_main=True)
    manager.save(1, lambda d: d.mkdir(), {})
    with pytest.raises(CheckpointWriteError,
                       match=r"step 2 .*the disk is full \(rank 1: OSError: \[Errno 28\] No "
                             r"space left on device.*newest complete checkpoint is .*step_1"):
        manager.save(2, dcp_failure, {})
    assert not (tmp_path / ".tmp-step_2").exists()

    # another rank failed: this one reports it too instead of waiting in a collective
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok and len(votes) < 3  # the peer fails while writing its state

    peer = CheckpointManager(tmp_path, keep=2, is_main=False, agree=agree, rank=1)
    (tmp_path / ".tmp-step_3").mkdir()  # made by the main rank
    with pytest.raises(CheckpointWriteError, match="another process failed"):
        peer.save(3, lambda d: None, {})
    assert votes == [True, True, True]

    failing: Future[Any] = Future()
    manager.save(4, lambda d: failing, {})
    failing.set_exception(CheckpointException("async save failed", {0: (full, None)}))
    manager.poll()
    with pytest.raises(CheckpointWriteError, match="the disk is full"):
        manager.wait()
    assert [c.step for c in manager.complete()] == [1]


def test_full_disk_during_a_real_checkpoint_is_reported(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    """ENOSPC at DCP's file-write boundary, single backend: the designed error, not a
    traceback, and the earlier checkpoint stays loadable."""
    from torch.distributed.checkpoint import filesystem

    from tests.test_resume import config, samples

    original = filesystem._write_item
    second = tmp_path / "checkpoints" / ".tmp-step_6"

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        if second.exists():  # the first checkpoint is written, the second fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    values = config(tmp_path)
    values["checkpoint"] = {"every_steps": 3, "keep": 2}
    with pytest.raises(CheckpointWriteError, match=r"step 6 .*the disk is full"):
        reasonctl.run(values, datasets=samples())
    assert checkpoint_steps(tmp_path) == [3]
    assert not (tmp_path / "checkpoints" / ".tmp-step_6").exists()


# --- secrets ----------------------------------------------------------------------------------


def test_secrets_stay_out_of_validation_errors_and_tracebacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.core.config import redact_text

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    assert secret not in redact_text(f"push to 's3://AKIDEXAMPLE:{secret}@bucket/x' failed")
    from reasonctl.core.config import preflight_problems
    from reasonctl.core.plugins import PluginHost

    host = PluginHost.load()
    config = reasonctl.load_config(
        [], [f"checkpoint.upload=['s3://AKIDEXAMPLE:{secret}@b/x']"], plugins=[])
    problems = "\n".join(preflight_problems(config, host.registry))
    assert "holds credentials" in problems
    assert "wJalr" not in problems and "K7MDENG" not in problems

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")

    class Broken:
        @reasonctl.hookimpl
        def register_rewards(self, register: Any) -> None:
            raise RuntimeError("cannot log in with hf_abcdefghijklmnop")

    record = host.add_plugin(Broken(), name="broken")  # `reasonctl plugins --all` shows these
    assert record.status == "error" and "cannot log in with ***" in record.traceback
    assert "hf_abc" not in record.traceback + record.error

    script = textwrap.dedent(f"""
        import threading
        from reasonctl.cli.common import install_redacting_excepthooks
        install_redacting_excepthooks()
        def fail():
            raise RuntimeError("https://user:{secret}@example.com/x")
        thread = threading.Thread(target=fail)
        thread.start(); thread.join()
        fail()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("RuntimeError: https://***@example.com/x") == 2
    assert "wJalr" not in proc.stderr
