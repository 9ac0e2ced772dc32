"""The fault campaign: SIGKILL at points of checkpoint writes, async saves, the final export
and uploads; signals to the launcher of two fsdp workers (gloo); the launcher killed; a second
writer; a full disk on one rank; a crafted DCP metadata pickle; a model that does not fit its
checkpoint. Every case ends with the documented exit code and message, loses no data and runs
no code from a checkpoint.

Marked ``faults``: CI runs these in a step of their own (``.ci/run``), outside the default run.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.checkpoint import CheckpointManager
from reasonctl.core.checkpoint_files import UnsafeCheckpointError, file_list
from reasonctl.core.output_lock import OutputDirInUse, output_lock
from reasonctl.core.pending_uploads import find_pending, push_pending
from reasonctl.core.plugins import PluginHost
from reasonctl.core.uploads import UPLOAD_MARKER, push
from reasonctl.sdk.api import run

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

from test_fsdp import write_run_files  # noqa: E402
from test_resume import assert_same_weights, config, samples  # noqa: E402

pytestmark = pytest.mark.faults

KILL_WORKER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_resume import config, samples
from reasonctl.sdk.api import run

point, out = sys.argv[1], Path(sys.argv[2])
second = out / "checkpoints" / ".tmp-step_6"


def kill_in(owner, name, when):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if when():
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def nth_call(n):
    calls = [0]

    def when():
        calls[0] += 1
        return calls[0] == n

    return when


values = config(out)
if point in ("state-write", "async-state-write"):
    from torch.distributed.checkpoint import filesystem
    values["checkpoint"]["async_save"] = point == "async-state-write"
    kill_in(filesystem, "_write_item", second.exists)
elif point in ("commit", "prune"):
    from reasonctl.core.checkpoint import CheckpointManager
    kill_in(CheckpointManager, "_commit" if point == "commit" else "prune", nth_call(2))
elif point == "export":
    from reasonctl.backends import export
    kill_in(export, "copy_tokenizer_files", lambda: True)
elif point == "upload":
    from reasonctl.storage import local
    values["checkpoint"].update(upload=[sys.argv[3]], upload_when="every")
    kill_in(local.LocalStorage, "_copy_tree", nth_call(2))
run(values, datasets=samples())
"""

KILL_POINTS = ["state-write", "async-state-write", "commit", "prune", "export", "upload"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run(config(out), datasets=samples()).status == "completed"
    return out


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_points_resume_to_the_uninterrupted_result(point: str, reference: Path,
                                                           tmp_path: Path) -> None:
    out, mirror = tmp_path / "run", tmp_path / "mirror"
    script = tmp_path / "worker.py"
    script.write_text(KILL_WORKER.format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, str(script), point, str(out), str(mirror)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (out / "export" / "final").exists()

    values = config(out, resume=True)
    if point == "upload":
        values["checkpoint"].update(upload=[str(mirror)], upload_when="every")
    result = run(values, datasets=samples())
    assert result.status == "completed" and result.upload_failures == []
    assert_same_weights(out / "export" / "final", reference / "export" / "final")
    found = CheckpointManager(out / "checkpoints", keep=2, is_main=True).complete()
    assert [c.step for c in found] == [3, 6]
    if point == "upload":  # what the killed run had not uploaded is kept and pushed later
        assert find_pending(out)
        host = PluginHost.load()
        assert push_pending(host.registry, None, out, push=push, log=lambda m: None) == []
        assert (mirror / "checkpoints" / "step_6" / UPLOAD_MARKER).is_file()
        assert not find_pending(out)


# --- two fsdp workers under the launcher ------------------------------------------------------


def launch(config_file: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "reasonctl", "run", "--backend", "fsdp",
               "--nproc-per-node", "2", "--config", str(config_file), "--output-dir", str(out),
               *extra]
    return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(out: Path, proc: subprocess.Popen[str], count: int) -> int:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if len(lines) >= count:
            return int(json.loads(lines[-1])["step"])
        time.sleep(0.2)
    out_, err = proc.communicate(timeout=60)
    raise AssertionError(f"no progress (exit {proc.returncode}): {err[-4000:]}")


def workers_of(launcher_pid: int) -> list[int]:
    """Processes started by the launcher ``launcher_pid`` (found by their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"REASONCTL_LAUNCHER_PID={launcher_pid}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.mark.distributed
def test_launcher_forwards_signals_and_refuses_a_second_writer(tmp_path: Path,
                                                               tiny_model_dir: Path) -> None:
    config_file = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    first = launch(config_file, out, "--set", "train.max_steps=400")
    wait_for_steps(out, first, 2)

    second = launch(config_file, out)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 2, err[-3000:]
    assert f"is in use by another run (host {os.uname().nodename}, pid {first.pid}" in err

    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-4000:]
    stopped = int(err.split("stopping at step ")[1].split()[0])
    assert "on SIGTERM" in err and "Traceback" not in err
    assert (out / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()

    resumed = launch(config_file, out, "--resume", "--set", "train.max_steps=400")
    first_step = wait_for_steps(out, resumed, stopped + 1)
    assert first_step >= stopped + 1
    resumed.send_signal(signal.SIGINT)  # Ctrl-C on the launcher, forwarded once
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-4000:]
    assert f"resuming from {out / 'checkpoints' / f'step_{stopped}'}" in err
    assert "on SIGINT" in err and "KeyboardInterrupt" not in err


@pytest.mark.distributed
def test_workers_checkpoint_and_stop_when_their_launcher_is_killed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    config_file = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    launcher = launch(config_file, out, "--set", "train.max_steps=400",
                      "--set", "checkpoint.every_steps=0")
    wait_for_steps(out, launcher, 2)
    workers = workers_of(launcher.pid)
    assert len(workers) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=60)
    try:  # the workers share the launcher's lock: no second writer while they finish
        with output_lock(out, log=print):
            assert not workers_of(launcher.pid), "the lock was free while workers ran"
    except OutputDirInUse as refused:
        assert f"pid {launcher.pid}" in str(refused)
    deadline = time.monotonic() + 240
    while workers_of(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not workers_of(launcher.pid), "workers outlived their launcher"
    saved = CheckpointManager(out / "checkpoints", keep=1, is_main=True).complete()
    assert len(saved) == 1  # written on the parent-death SIGTERM (no periodic checkpoints)


SITE_ENOSPC = """
import errno, os
from pathlib import Path
from torch.distributed.checkpoint import filesystem

_original = filesystem._write_item


def _full_disk(*args, **kwargs):
    second = Path(os.environ["FAULT_OUTPUT"]) / "checkpoints" / ".tmp-step_4"
    if os.environ.get("RANK") == "1" and second.exists():
        raise OSError(errno.ENOSPC, "No space left on device")
    return _original(*args, **kwargs)


filesystem._write_item = _full_disk
"""


@pytest.mark.distributed
def test_full_disk_on_one_rank_fails_every_rank_clearly(tmp_path: Path,
                                                         tiny_model_dir: Path) -> None:
    config_file = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_ENOSPC)  # imported by every process started
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_OUTPUT": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "reasonctl", "run", "--backend", "fsdp",
               "--nproc-per-node", "2", "--config", str(config_file), "--output-dir", str(out),
               "--set", "checkpoint.every_steps=2"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert proc.stderr.count("could not write the checkpoint of step 4") == 2  # both ranks
    assert "the disk is full (rank 1: OSError: [Errno 28] No space left on device" in \
        proc.stderr
    assert "CheckpointException" not in proc.stderr.replace("rank 1:", "")
    saved = CheckpointManager(out / "checkpoints", keep=2, is_main=True).complete()
    assert [c.step for c in saved] == [2] and not (out / "checkpoints" / ".tmp-step_4").exists()


# --- crafted or mismatched checkpoint state (single backend) ----------------------------------


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_crafted_dcp_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    values = config(tmp_path / "run")
    values["train"]["max_steps"] = 3
    run(values, datasets=samples())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_3"
    marker = tmp_path / "code-ran"
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert listed["state/.metadata"]["sha256"] and listed["rng_rank0.pt"]["sha256"]
    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in file_list(checkpoint).items()
                         if k != "manifest.json"}  # whoever wrote it rewrote the list too
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    resumed = config(tmp_path / "run", resume=str(checkpoint))
    resumed["train"]["max_steps"] = 3
    with pytest.raises(UnsafeCheckpointError, match=r"posix.system is not allowed"):
        run(resumed, datasets=samples())
    assert not marker.exists()


def test_model_that_does_not_fit_its_checkpoint_names_the_tensors(tmp_path: Path) -> None:
    from reasonctl.backends.dcp_load import CheckpointMismatchError
    from reasonctl.models.tiny import make_tiny_model_dir
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    values = config(tmp_path / "run")
    values["train"]["max_steps"] = 3
    run(values, datasets=samples())
    wider = make_tiny_model_dir(tmp_path / "wider", intermediate_size=96)
    tokenizer = resolve_tiny_alias("tiny-random")
    resumed = config(tmp_path / "run", resume=True, resume_with_changes=True)
    resumed["train"]["max_steps"] = 4
    resumed["model"] = {"name_or_path": str(wider), "tokenizer": tokenizer}
    with pytest.raises(CheckpointMismatchError) as mismatch:
        run(resumed, datasets=samples())
    message = str(mismatch.value)
    assert "mlp.up_proj.weight: checkpoint [" in message and ", model [96, " in message


def test_new_learning_rate_takes_effect_over_the_restored_schedule(tmp_path: Path) -> None:
    from reasonctl import hookimpl

    class LearningRates:
        def __init__(self) -> None:
            self.by_step: dict[int, float] = {}

        @hookimpl
        def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
            self.by_step[step] = metrics["lr"]

    values = config(tmp_path)
    values["train"].update(max_steps=3, schedule="constant", warmup_steps=0)
    run(values, datasets=samples())
    resumed = config(tmp_path, resume=True, resume_with_changes=True)
    resumed["train"].update(max_steps=5, schedule="constant", warmup_steps=0, lr=2e-2)
    rates = LearningRates()
    assert run(resumed, datasets=samples(), plugins=[rates]).status == "completed"
    assert rates.by_step == {4: pytest.approx(2e-2), 5: pytest.approx(2e-2)}


def test_diverging_learning_rate_stops_before_anything_is_exported(tmp_path: Path) -> None:
    from reasonctl.core.errors import NonFiniteError

    values = config(tmp_path / "stop")
    values["train"].update(lr=1e30, schedule="constant", warmup_steps=0, max_grad_norm=0.0)
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite loss nan"):
        run(values, datasets=samples())
    assert not (tmp_path / "stop" / "export").exists()

    values = config(tmp_path / "skip")
    values["train"].update(lr=1e30, schedule="constant", warmup_steps=0, max_grad_norm=0.0,
                           on_nonfinite="skip")
    result = run(values, datasets=samples())
    assert result.status == "completed" and result.nonfinite_steps == 7  # steps 2 to 8


def test_lora_adapter_checkpoints_follow_the_lineage_and_are_checked_on_resume(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Adapter-only checkpoints (``[model.lora]``) get the same lineage, file checks, config
    check and tensor names as full ones."""
    pytest.importorskip("peft", reason="LoRA needs the 'lora' extra (peft)")
    from test_lora import SAMPLES, sft_config

    from reasonctl.backends.dcp_load import CheckpointMismatchError
    from reasonctl.core.resume import ResumeConfigError

    out = tmp_path / "run"

    def lora_run(**changes: Any) -> Any:
        values = sft_config(out, tiny_model_dir, lora=changes.pop("lora", None))
        values["train"]["max_steps"] = 4
        values["checkpoint"].update(every_steps=2, keep=3)
        values["run"].update(changes)
        return run(values, datasets=SAMPLES)

    assert lora_run().status == "completed"
    first = CheckpointManager(out / "checkpoints", keep=3, is_main=True).complete()
    assert [c.step for c in first] == [2, 4]
    assert first[1].manifest["lineage"]["parent"] == first[0].id
    listed = first[0].manifest["files"]
    assert listed["state/.metadata"]["sha256"] and listed["rng_rank0.pt"]["sha256"]
    older = str(first[0].path)

    with pytest.raises(ResumeConfigError, match=r"model\.lora\.rank: 4 -> 8"):
        lora_run(resume=older, lora={"rank": 8})
    with pytest.raises(CheckpointMismatchError,
                       match=r"lora_A\.default\.weight: checkpoint \[4, \d+\], model \[8, "):
        lora_run(resume=older, resume_with_changes=True, lora={"rank": 8})
    assert not list((out / "checkpoints").glob("retired-*"))  # a failed resume moves nothing

    # the export layout is not a training setting; the abandoned step 4 is moved aside
    assert lora_run(resume=older, lora={"export": "adapter"}).status == "completed"
    assert len(list((out / "checkpoints").glob("retired-*/step_4/manifest.json"))) == 1
    now = CheckpointManager(out / "checkpoints", keep=3, is_main=True).complete()
    assert [c.step for c in now] == [2, 4]
    assert now[1].manifest["lineage"]["parent"] == first[0].id and now[1].id != first[1].id
    assert (out / "export" / "final" / "adapter_config.json").is_file()
