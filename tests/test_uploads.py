"""Background uploads of checkpoints and exports, failure reports and resume pulls.

The S3 target is moto's standalone server reached over HTTP through a proxy that the tests
take down and bring back; the second target is a local directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reasonctl.core.checkpoint import CheckpointManager
from reasonctl.core.config import RunConfig, load_config
from reasonctl.core.errors import UsageError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.uploads import UPLOAD_MARKER, Uploader, push
from tests.storage_servers import Bucket, S3Server, use_server


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as s3:
        yield s3


@pytest.fixture
def s3(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    yield use_server(server, monkeypatch)
    if server.proxy.cut.is_set():
        server.proxy.start()


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load()


def make_checkpoint(output_dir: Path, step: int) -> Path:
    """A directory laid out like ``CheckpointManager.save`` writes it."""
    path = output_dir / "checkpoints" / f"step_{step}"
    (path / "state").mkdir(parents=True)
    (path / "state" / "model.distcp").write_bytes(os.urandom(50_000 + step))
    (path / "state" / ".metadata").write_bytes(os.urandom(300))
    (path / "rng_rank0.pt").write_bytes(os.urandom(100))
    (path / "manifest.json").write_text(json.dumps(
        {"step": step, "saved_at": time.time(), "config_hash": "abc", "algorithm": {"pos": step},
         "world_size": 1}
    ))
    return path


def make_export(output_dir: Path) -> Path:
    path = output_dir / "export" / "final"
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(os.urandom(20_000))
    return path


def digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


def run_config(host: PluginHost, targets: list[str], *extra: str) -> RunConfig:
    listed = ", ".join(repr(t) for t in targets)
    return load_config(
        overrides=[f"checkpoint.upload=[{listed}]", "storage.s3.max_attempts=2",
                   "storage.s3.backoff_s=0.1", *extra],
        registry=host.registry,
    )


def test_uploads_run_in_the_background_and_survive_an_outage(
    s3: Bucket, host: PluginHost, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    checkpoint = make_checkpoint(out, 2)
    export = make_export(out)
    before = {"ckpt": digests(checkpoint), "export": digests(export)}
    mirror = tmp_path / "mirror"
    config = run_config(host, [f"s3://{s3.name}/runs/a", str(mirror)])
    uploader = Uploader(host.registry, config, out, attempts=5, backoff_s=0.5,
                        log=lambda message: None)

    s3.proxy.stop()  # S3 is down while training goes on
    started = time.monotonic()
    uploader.submit(checkpoint, "checkpoints/step_2")
    uploader.submit(export, "export/final")
    assert time.monotonic() - started < 0.5  # submitting never waits for the network
    threading.Timer(1.0, s3.proxy.start).start()

    assert uploader.finish() == []
    storage = host.registry.get("storage", "s3").build(config.component_config("storage", "s3"))
    assert storage.get_dir(f"s3://{s3.name}/runs/a", tmp_path / "back")
    remote = digests(tmp_path / "back")
    assert {k[len("checkpoints/step_2/"):]: v for k, v in remote.items()
            if k.startswith("checkpoints/step_2/") and not k.endswith(UPLOAD_MARKER)} \
        == before["ckpt"]
    assert {k[len("export/final/"):]: v for k, v in remote.items()
            if k.startswith("export/final/")} == before["export"]
    assert f"checkpoints/step_2/{UPLOAD_MARKER}" in remote  # checkpoint marked complete
    assert not any(k.startswith("export/final/.upload") for k in remote)
    assert digests(mirror / "checkpoints" / "step_2").keys() == before["ckpt"].keys() | \
        {UPLOAD_MARKER}
    # The local copies are intact and the hard-link snapshots are gone.
    assert digests(checkpoint) == before["ckpt"] and digests(export) == before["export"]
    assert not (out / "pending-uploads").exists()


def test_checkpoint_pruned_while_its_upload_waits_is_still_uploaded(
    s3: Bucket, host: PluginHost, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    checkpoint = make_checkpoint(out, 1)
    expected = digests(checkpoint)
    config = run_config(host, [f"s3://{s3.name}/runs/b"])
    uploader = Uploader(host.registry, config, out, attempts=5, backoff_s=0.5,
                        log=lambda message: None)
    s3.proxy.stop()
    uploader.submit(checkpoint, "checkpoints/step_1")
    shutil.rmtree(checkpoint)  # as keep-N pruning does once newer checkpoints exist
    threading.Timer(0.5, s3.proxy.start).start()

    assert uploader.finish() == []
    storage = host.registry.get("storage", "s3").build(config.component_config("storage", "s3"))
    storage.get_dir(f"s3://{s3.name}/runs/b/checkpoints/step_1", tmp_path / "back")
    remote = digests(tmp_path / "back")
    assert remote.pop(UPLOAD_MARKER) and remote == expected
    assert not (out / "pending-uploads").exists()


def test_failed_uploads_are_kept_per_run_and_pushed_later(
    s3: Bucket, host: PluginHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    old = make_checkpoint(out, 1)
    new = make_checkpoint(out, 2)
    old_digests, new_digests = digests(old), digests(new)
    mirror = tmp_path / "mirror"
    target = f"s3://{s3.name}/runs/c"
    config = run_config(host, [target, str(mirror)])
    uploader = Uploader(host.registry, config, out, attempts=2, backoff_s=0.1)
    s3.proxy.stop()  # and it does not come back during this run

    uploader.submit(old, "checkpoints/step_1")
    uploader.submit(new, "checkpoints/step_2")
    shutil.rmtree(old)  # pruned locally while its upload is pending
    failures = uploader.finish()

    assert len(failures) == 2
    assert failures[0].startswith(f"{target}/checkpoints/step_1: ")
    assert failures[1].startswith(f"{target}/checkpoints/step_2: ")
    assert "cannot reach the S3 endpoint" in failures[1] and "after 2 attempt(s)" in failures[1]
    # Each failed upload keeps a snapshot in a directory of its own run, named in the report.
    kept = [Path(f.rsplit("local copy: ", 1)[1].rstrip(")")) for f in failures]
    assert all(p.is_relative_to(uploader.pending_root) for p in kept)
    assert digests(kept[0]) == old_digests and digests(kept[1]) == new_digests
    assert digests(new) == new_digests
    # The other target got everything.
    assert digests(mirror / "checkpoints" / "step_1").keys() == old_digests.keys() | \
        {UPLOAD_MARKER}
    err = capsys.readouterr().err
    assert "Upload report: 2 upload(s) did not complete" in err
    assert f"{target}/checkpoints/step_2" in err and f"reasonctl upload {out}" in err
    assert "testing-secret-value" not in err and "testing-secret-value" not in "".join(failures)
    assert uploader.finish() == failures  # idempotent

    # A later run of the same output directory uploads on its own and leaves them alone.
    s3.proxy.start()
    later = Uploader(host.registry, config, out, attempts=2, backoff_s=0.1,
                     log=lambda message: None)
    assert later.pending_root != uploader.pending_root
    later.submit(new, "checkpoints/step_2")
    assert later.finish() == []
    assert digests(kept[0]) == old_digests

    # `reasonctl upload OUTPUT_DIR` pushes what was kept, to the target that missed it only.
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app

    pushed = CliRunner().invoke(build_app(host), ["upload", str(out)])
    assert pushed.exit_code == 0, pushed.output
    assert "every pending upload is done" in pushed.output
    assert not (out / "pending-uploads").exists()
    storage = host.registry.get("storage", "s3").build(config.component_config("storage", "s3"))
    storage.get_dir(f"{target}/checkpoints/step_1", tmp_path / "back")
    remote = digests(tmp_path / "back")
    assert remote.pop(UPLOAD_MARKER) and remote == old_digests


def test_resume_pulls_newest_complete_checkpoint_into_empty_output_dir(
    s3: Bucket, host: PluginHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"s3://{s3.name}/runs/d"
    config = run_config(host, [target], "run.resume=true")
    storage = host.registry.get("storage", "s3").build(config.component_config("storage", "s3"))
    first = tmp_path / "first"
    for step in (1, 3):
        push(storage, make_checkpoint(first, step), f"{target}/checkpoints/step_{step}")
    torn = make_checkpoint(first, 5)
    storage.put_dir(torn, f"{target}/checkpoints/step_5")  # no completion marker
    expected = digests(first / "checkpoints" / "step_3")

    resumed = tmp_path / "resumed"
    manager = CheckpointManager(resumed / "checkpoints", keep=2, is_main=True)
    uploader = Uploader(host.registry, config, resumed)
    pulled = uploader.pull_latest_checkpoint_if_missing(manager)

    assert pulled == resumed / "checkpoints" / "step_3"
    latest = manager.latest()
    assert latest is not None and latest.step == 3 and latest.manifest["algorithm"] == {"pos": 3}
    assert digests(pulled) == expected
    assert manager.torn == []
    assert "ignoring incomplete uploads" in capsys.readouterr().err
    # A local checkpoint now exists: nothing more is pulled.
    assert uploader.pull_latest_checkpoint_if_missing(manager) is None
    assert uploader.finish() == []


def test_resume_without_uploaded_checkpoints_starts_from_scratch(
    s3: Bucket, host: PluginHost, tmp_path: Path
) -> None:
    messages: list[str] = []
    config = run_config(host, [f"s3://{s3.name}/runs/none"], "run.resume=true")
    uploader = Uploader(host.registry, config, tmp_path, log=messages.append)
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2, is_main=True)
    assert uploader.pull_latest_checkpoint_if_missing(manager) is None
    assert "starting from scratch" in messages[-1]
    assert not (tmp_path / "checkpoints").exists()
    no_resume = run_config(host, [f"s3://{s3.name}/runs/none"])
    assert Uploader(host.registry, no_resume, tmp_path).pull_latest_checkpoint_if_missing(
        manager) is None


# --- permanent errors, start-of-run checks, deadlines, parallel uploads, signals ------------


@pytest.fixture
def wrong_credentials(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """The server checks signatures: the test key is unknown to it, as a revoked key is."""
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    return s3


def test_wrong_credentials_are_named_and_not_retried(
    wrong_credentials: Bucket, host: PluginHost, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    checkpoint = make_checkpoint(out, 1)
    target = f"s3://{wrong_credentials.name}/runs/e"
    config = run_config(host, [target])
    messages: list[str] = []
    uploader = Uploader(host.registry, config, out, attempts=5, backoff_s=5.0,
                        log=messages.append)
    with pytest.raises(UsageError, match="the server rejected the credentials") as refused:
        uploader.check_access()
    assert "access denied" not in str(refused.value)
    started = time.monotonic()
    uploader.submit(checkpoint, "checkpoints/step_1")
    uploader.submit(make_export(out), "export/final")
    failures = uploader.finish()
    assert time.monotonic() - started < 4  # no 5-attempt backoff for a permanent error
    assert len(failures) == 2 and all("rejected the credentials" in f for f in failures)
    assert all("after 1 attempt(s)" in f or "after 0 attempt(s)" in f for f in failures)


def test_missing_credentials_stop_the_run_before_training(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import reasonctl
    from tests.toy_components import ToyPlugin

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    plugin = ToyPlugin()
    config = reasonctl.load_config([], [
        "algorithm.name=toy", "backend.name=toybackend", "logging.loggers=[]",
        f"run.output_dir='{tmp_path / 'run'}'", f"checkpoint.upload=['s3://{s3.name}/x']",
    ], plugins=[plugin])
    with pytest.raises(UsageError, match=r"no AWS credentials found.*nothing was trained"):
        reasonctl.run(config, plugins=[plugin])
    assert not [e for e in plugin.events if e[0] in ("start", "step")]


def test_unreachable_target_is_given_up_at_the_deadline(
    s3: Bucket, host: PluginHost, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = run_config(host, [f"s3://{s3.name}/runs/f"], "checkpoint.upload_wait_s=2.0")
    uploader = Uploader(host.registry, config, out, attempts=50, backoff_s=1.0,
                        log=lambda message: None)
    s3.proxy.stop()
    uploader.submit(make_checkpoint(out, 3), "checkpoints/step_3")
    started = time.monotonic()
    failures = uploader.finish()
    assert time.monotonic() - started < 6
    assert len(failures) == 1 and "within checkpoint.upload_wait_s (2 s)" in failures[0]
    kept = Path(failures[0].rsplit("local copy: ", 1)[1].rstrip(")"))
    record = json.loads((kept.parent / "upload.json").read_text())
    assert list(record["pending"]) == [f"s3://{s3.name}/runs/f/checkpoints/step_3"]


class SlowStorage:
    """A ``slow://`` target that takes a while per upload and records overlaps."""

    active = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, config: object = None) -> None:
        pass

    def put_dir(self, local: Path, uri: str) -> None:
        with SlowStorage.lock:
            SlowStorage.active += 1
            SlowStorage.most = max(SlowStorage.most, SlowStorage.active)
        time.sleep(1.0)
        with SlowStorage.lock:
            SlowStorage.active -= 1

    put_file = put_dir

    def get_file(self, uri: str, local: Path) -> Path:
        raise NotImplementedError

    get_dir = get_file

    def list(self, uri: str) -> list[str]:
        return []

    def exists(self, uri: str) -> bool:
        return False

    def delete(self, uri: str) -> None:
        pass


class SlowStoragePlugin:
    from reasonctl import hookimpl

    @hookimpl
    def register_storage(self, register: object) -> None:
        register("slow", SlowStorage)  # type: ignore[operator]


def test_one_steps_uploads_go_in_parallel_and_a_second_signal_ends_the_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    from reasonctl.core.signals import StopRequest, stop_signals

    host = PluginHost.load()
    host.add_plugin(SlowStoragePlugin(), name="slow")
    config = load_config(overrides=["checkpoint.upload=['slow://bucket/run']"],
                         registry=host.registry)
    out = tmp_path / "run"
    uploader = Uploader(host.registry, config, out, log=lambda m: print(m, file=sys.stderr))
    uploader.submit(make_checkpoint(out, 4), "checkpoints/step_4")
    uploader.submit(make_export(out), "export/final")
    assert uploader.finish() == []
    assert SlowStorage.most == 2  # the checkpoint and the export of one step at once

    stop = StopRequest()
    second = Uploader(host.registry, config, out)
    for step in (5, 6, 7, 8):
        second.submit(make_checkpoint(out, step), f"checkpoints/step_{step}")
    for delay in (0.3, 1.0):
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with stop_signals(stop):
        failures = second.finish(stop)
    err = capsys.readouterr().err
    assert "SIGTERM received during the upload wait; finishing it" in err
    assert failures and all("the wait was abandoned on SIGTERM" in f for f in failures)
    assert all(Path(f.rsplit("local copy: ", 1)[1].rstrip(")")).is_relative_to(
        second.pending_root) for f in failures)
