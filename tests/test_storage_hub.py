"""The ``hf://`` storage plugin, exercised against a local Hub API server.

This is a protocol test, not a Hub test: :class:`tests.storage_servers.HubServer` implements
the HTTP endpoints ``huggingface_hub`` calls to create repositories and branches, preupload
and commit files (as regular, inline base64 content), list trees and download files. It
checks that our plugin drives ``huggingface_hub`` correctly (repository creation with the
private flag, commit contents, token handling, retries, downloads). LFS/Xet transfers of
large files and the real Hub's permission rules are not covered.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.checkpoint import CheckpointManager
from reasonctl.core.config import load_config
from reasonctl.core.plugins import PluginHost
from reasonctl.core.storage import StorageError, open_storage
from reasonctl.core.uploads import UPLOAD_MARKER, Uploader
from tests.storage_servers import HubServer

TOKEN = "hf_LocalProtocolTestToken42"


@pytest.fixture(scope="module")
def server() -> Iterator[HubServer]:
    with HubServer(token=TOKEN) as hub:
        yield hub


@pytest.fixture
def hub(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """The server as HF_ENDPOINT, HF_TOKEN set, and Hub offline mode off for these tests."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    server.fail_commits = 0
    return server


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load()


def storage_for(host: PluginHost, *overrides: str) -> Any:
    config = load_config(overrides=["storage.hf.backoff_s=0.05", *overrides],
                         registry=host.registry)
    return open_storage(host.registry, "hf://o/r", config)


def make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"model_type": "qwen2"}',
        "model.safetensors": os.urandom(70_000),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return files


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_upload_folder_creates_private_repo_and_commits_files(
    hub: HubServer, host: PluginHost, tmp_path: Path
) -> None:
    files = make_tree(tmp_path / "export")
    storage = storage_for(host)
    storage.put_dir(tmp_path / "export", "hf://acme/tiny-model/export/final")

    repo = hub.repos[("models", "acme/tiny-model")]
    assert repo.private is True
    assert hub.files("acme/tiny-model") == {f"export/final/{k}": v for k, v in files.items()}
    assert repo.commits[-1]["summary"] == "Upload export/final with reasonctl"
    assert ("POST", "/api/repos/create") in hub.requests
    assert ("POST", "/api/models/acme/tiny-model/preupload/main") in hub.requests

    # Files, revision branches and dataset repositories.
    storage.put_file(tmp_path / "export/config.json", "hf://acme/tiny-model@exp-1/config.json")
    assert hub.files("acme/tiny-model", "exp-1") == {
        **{f"export/final/{k}": v for k, v in files.items()}, "config.json": files["config.json"]
    }
    storage.put_dir(tmp_path / "export/tokenizer", "hf://datasets/acme/data")
    assert hub.files("acme/data", repo_type="dataset") == {
        "tokenizer.json": files["tokenizer/tokenizer.json"]
    }


def test_public_option_and_commit_message(hub: HubServer, host: PluginHost, tmp_path: Path) -> None:
    make_tree(tmp_path / "export")
    storage = storage_for(host, "storage.hf.private=false",
                          "storage.hf.commit_message='step {path}'")
    storage.put_dir(tmp_path / "export", "hf://acme/public-model")
    repo = hub.repos[("models", "acme/public-model")]
    assert repo.private is False
    assert repo.commits[-1]["summary"] == "step acme/public-model"


def test_download_list_exists_delete(hub: HubServer, host: PluginHost, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src")
    storage = storage_for(host)
    base = "hf://acme/roundtrip"
    storage.put_dir(tmp_path / "src", f"{base}/model")

    assert storage.list(base) == [f"{base}/model/{k}" for k in sorted(files)]
    assert storage.list(f"{base}/model/tokenizer") == [f"{base}/model/tokenizer/tokenizer.json"]
    assert storage.list("hf://acme/does-not-exist") == []
    assert storage.exists(f"{base}/model/tokenizer") and storage.exists(base)
    assert not storage.exists(f"{base}/nothing") and not storage.exists("hf://acme/nope")

    back = storage.get_dir(f"{base}/model", tmp_path / "back")
    assert tree(back) == files  # no huggingface_hub bookkeeping left behind
    whole = storage.get_dir(base, tmp_path / "whole")
    assert tree(whole) == {f"model/{k}": v for k, v in files.items()}
    one = storage.get_file(f"{base}/model/model.safetensors", tmp_path / "one.bin")
    assert one.read_bytes() == files["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "one.bin", "src", "whole"]

    storage.delete(f"{base}/model/tokenizer")
    assert sorted(hub.files("acme/roundtrip")) == ["model/config.json", "model/model.safetensors"]
    with pytest.raises(StorageError, match="refusing to delete a whole repository"):
        storage.delete(base)


def test_transient_server_errors_are_retried(
    hub: HubServer, host: PluginHost, tmp_path: Path
) -> None:
    files = make_tree(tmp_path / "src")
    storage = storage_for(host)
    hub.fail_commits = 2  # two 503 answers, then the commit goes through
    storage.put_dir(tmp_path / "src", "hf://acme/flaky")
    assert hub.files("acme/flaky") == files
    assert hub.fail_commits == 0


def test_token_is_sent_and_never_printed(
    hub: HubServer, host: PluginHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tree(tmp_path / "src")
    monkeypatch.setenv("HF_TOKEN", "hf_WrongTokenValue123")
    storage = storage_for(host)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG), pytest.raises(StorageError) as info:
        storage.put_dir(tmp_path / "src", "hf://acme/secret-model")
    assert "the Hub rejected the token; set a valid HF_TOKEN" in str(info.value)
    assert time.monotonic() - started < 2  # a rejected token is not retried
    shown = str(info.value) + caplog.text + "".join(capsys.readouterr())
    assert "hf_WrongTokenValue123" not in shown and TOKEN not in shown
    assert ("models", "acme/secret-model") not in hub.repos


def test_checkpoint_upload_and_resume_through_the_hub(
    hub: HubServer, host: PluginHost, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_7"
    (checkpoint / "state").mkdir(parents=True)
    (checkpoint / "state" / "model.distcp").write_bytes(os.urandom(10_000))
    (checkpoint / "state" / ".metadata").write_bytes(os.urandom(200))  # torch DCP's index
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 7, "algorithm": {}}))
    target = "hf://acme/run-ckpts@training"
    config = load_config(overrides=[f"checkpoint.upload=['{target}']", "run.resume=true",
                                    "storage.hf.backoff_s=0.05"], registry=host.registry)
    uploader = Uploader(host.registry, config, tmp_path / "run", log=lambda message: None)
    uploader.submit(checkpoint, "checkpoints/step_7")
    assert uploader.finish() == []
    assert f"checkpoints/step_7/{UPLOAD_MARKER}" in hub.files("acme/run-ckpts", "training")

    fresh = tmp_path / "fresh"
    manager = CheckpointManager(fresh / "checkpoints", keep=2, is_main=True)
    pulled = Uploader(host.registry, config, fresh).pull_latest_checkpoint_if_missing(manager)
    assert pulled == fresh / "checkpoints" / "step_7"
    assert tree(pulled) == tree(checkpoint)
    latest = manager.latest()
    assert latest is not None and latest.step == 7
