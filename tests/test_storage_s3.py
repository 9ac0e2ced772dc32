"""The ``s3://`` storage plugin against moto's standalone S3 server over real HTTP.

boto3 reaches the server through a TCP proxy the tests can cut mid-transfer, which is what a
client sees when an S3 endpoint goes away (connections reset, then refused).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.config import load_config
from reasonctl.core.plugins import PluginHost
from reasonctl.core.storage import StorageError, fetch_model, model_cache_dir, open_storage
from reasonctl.plugins.storage.s3 import build_s3_storage
from reasonctl.storage.s3.config import S3StorageConfig
from tests.storage_servers import Bucket, S3Server, use_server

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as s3:
        yield s3


@pytest.fixture
def s3(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    """A fresh bucket with AWS_* pointing at the server; the proxy is restored afterwards."""
    yield use_server(server, monkeypatch)
    if server.proxy.cut.is_set():
        server.proxy.start()


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load()


def storage_for(host: PluginHost, *overrides: str) -> Any:
    config = load_config(overrides=list(overrides), registry=host.registry)
    return open_storage(host.registry, "s3://any", config)


def write(path: Path, content: bytes) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return content


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_round_trip_file_and_directory(s3: Bucket, host: PluginHost, tmp_path: Path) -> None:
    bucket = s3.name
    storage = storage_for(host)  # endpoint from AWS_ENDPOINT_URL
    assert storage.client.meta.endpoint_url == s3.server.endpoint_url
    files = {
        "config.json": write(tmp_path / "src/config.json", b'{"a": 1}'),
        "sub/weights.bin": write(tmp_path / "src/sub/weights.bin", os.urandom(300_000)),
        "sub/deep/empty.txt": write(tmp_path / "src/sub/deep/empty.txt", b""),
    }
    base = f"s3://{bucket}/runs/r1"
    storage.put_dir(tmp_path / "src", base)
    storage.put_file(tmp_path / "src/config.json", f"{base}-single/config.json")

    assert storage.list(base) == [f"{base}/{k}" for k in sorted(files)]
    assert storage.list(f"s3://{bucket}/runs/r1/sub/deep") == [f"{base}/sub/deep/empty.txt"]
    assert storage.exists(f"{base}/sub") and storage.exists(f"{base}/config.json")
    assert not storage.exists(f"s3://{bucket}/runs/r")  # a prefix of a name is not a folder
    assert storage.get_dir(base, tmp_path / "back") == tmp_path / "back"
    assert tree(tmp_path / "back") == files
    out = storage.get_file(f"{base}-single/config.json", tmp_path / "single.json")
    assert out.read_bytes() == files["config.json"]
    head = s3.client().head_object(Bucket=bucket, Key="runs/r1/sub/weights.bin")
    assert head["Metadata"]["sha256"] == hashlib.sha256(files["sub/weights.bin"]).hexdigest()

    storage.delete(f"{base}/sub")
    assert storage.list(base) == [f"{base}/config.json"]
    assert tree(tmp_path / "src") == files  # the local copy is untouched


def test_multipart_upload_above_part_size(s3: Bucket, host: PluginHost, tmp_path: Path) -> None:
    bucket = s3.name
    storage = storage_for(host, "storage.s3.part_size_mb=5", "storage.s3.multipart_threshold_mb=5")
    content = write(tmp_path / "big.bin", os.urandom(12 * MIB))
    uri = f"s3://{bucket}/model/big.bin"

    sent = s3.proxy.bytes_forwarded
    storage.put_file(tmp_path / "big.bin", uri)
    assert s3.proxy.bytes_forwarded - sent >= 12 * MIB
    head = s3.client().head_object(Bucket=bucket, Key="model/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB parts
    assert head["ContentLength"] == 12 * MIB
    assert storage.get_file(uri, tmp_path / "copy.bin").read_bytes() == content

    # An unchanged file is not sent again.
    sent = s3.proxy.bytes_forwarded
    storage.put_file(tmp_path / "big.bin", uri)
    assert s3.proxy.bytes_forwarded - sent < MIB


def test_listing_follows_pagination(s3: Bucket, host: PluginHost, tmp_path: Path) -> None:
    bucket = s3.name
    for i in range(30):
        write(tmp_path / "many" / f"f{i:02d}.txt", str(i).encode())
    storage = storage_for(host, "storage.s3.page_size=7")
    calls: list[str] = []
    storage.client.meta.events.register(
        "before-call.s3.ListObjectsV2", lambda **kwargs: calls.append("list")
    )
    storage.put_dir(tmp_path / "many", f"s3://{bucket}/many")
    calls.clear()
    listed = storage.list(f"s3://{bucket}/many")
    assert listed == [f"s3://{bucket}/many/f{i:02d}.txt" for i in range(30)]
    assert len(calls) == 5  # ceil(30 / 7) pages
    storage.delete(f"s3://{bucket}/many")
    assert storage.list(f"s3://{bucket}/many") == []


def test_download_detects_corrupted_object(s3: Bucket, host: PluginHost, tmp_path: Path) -> None:
    bucket = s3.name
    storage = storage_for(host, "storage.s3.max_attempts=1")
    write(tmp_path / "w.bin", b"good weights")
    storage.put_file(tmp_path / "w.bin", f"s3://{bucket}/w.bin")
    sha = hashlib.sha256(b"good weights").hexdigest()
    s3.client().put_object(Bucket=bucket, Key="w.bin", Body=b"bad weights!",
                                  Metadata={"sha256": sha})
    with pytest.raises(StorageError, match="fails its sha256"):
        storage.get_file(f"s3://{bucket}/w.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


def test_server_stopped_mid_upload_is_retried(s3: Bucket, tmp_path: Path) -> None:
    bucket = s3.name
    files = {
        "big.bin": write(tmp_path / "src/big.bin", os.urandom(12 * MIB)),
        "small/a.json": write(tmp_path / "src/small/a.json", b"{}"),
    }
    storage = build_s3_storage(S3StorageConfig(
        part_size_mb=5, multipart_threshold_mb=5, max_attempts=6, backoff_s=0.3,
    ))
    s3.proxy.cut_after(6 * MIB)  # the endpoint disappears during the second part

    cut_during_upload = threading.Event()

    def restart() -> None:
        if s3.proxy.cut.wait(10):
            cut_during_upload.set()
        time.sleep(1.0)
        s3.proxy.start()

    restarter = threading.Thread(target=restart)
    restarter.start()
    started = time.monotonic()
    storage.put_dir(tmp_path / "src", f"s3://{bucket}/run")
    restarter.join()
    assert cut_during_upload.is_set()
    assert time.monotonic() - started >= 1.0  # it really waited for the server
    storage.get_dir(f"s3://{bucket}/run", tmp_path / "back")
    assert tree(tmp_path / "back") == files


def test_unreachable_or_missing_bucket_errors_are_actionable(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "f.txt", b"x")
    storage = build_s3_storage(S3StorageConfig(max_attempts=3, backoff_s=5.0,
                                               create_bucket=False))
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.put_file(tmp_path / "f.txt", "s3://no-such-bucket-here/f.txt")
    assert "bucket 'no-such-bucket-here' does not exist" in str(info.value)
    assert time.monotonic() - started < 5.0  # not retried: it cannot succeed
    creating = build_s3_storage(S3StorageConfig(max_attempts=3, backoff_s=5.0))
    creating.put_file(tmp_path / "f.txt", "s3://bucket-made-on-upload/f.txt")
    assert creating.list("s3://bucket-made-on-upload") == ["s3://bucket-made-on-upload/f.txt"]

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    storage = build_s3_storage(S3StorageConfig(max_attempts=3, backoff_s=5.0))
    with pytest.raises(StorageError, match="no AWS credentials found; set AWS_ACCESS_KEY_ID"):
        storage.list(f"s3://{s3.name}/x")


def test_model_uri_is_downloaded_once(
    s3: Bucket, host: PluginHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.name
    monkeypatch.setenv("REASONCTL_CACHE", str(tmp_path / "cache"))
    files = {"config.json": write(tmp_path / "m/config.json", b'{"model_type": "qwen2"}'),
             "model.safetensors": write(tmp_path / "m/model.safetensors", os.urandom(4096))}
    storage = storage_for(host)
    storage.put_dir(tmp_path / "m", f"s3://{bucket}/models/tiny")
    config = load_config(registry=host.registry)

    local = fetch_model(host.registry, config, f"s3://{bucket}/models/tiny")
    assert local == model_cache_dir(f"s3://{bucket}/models/tiny")
    assert local.is_relative_to(tmp_path / "cache" / "models")
    assert tree(local) == files
    s3.proxy.stop()  # the second call must not need the server
    assert fetch_model(host.registry, config, f"s3://{bucket}/models/tiny/") == local
    assert not [p for p in local.parent.iterdir() if ".partial-" in p.name]


def test_registration_and_config_need_neither_boto3_nor_huggingface_hub() -> None:
    """Registering ``s3`` and ``hf`` and validating their config imports no client; building
    the ``s3`` storage loads its client from ``reasonctl.storage``."""
    script = """
import json, sys
from reasonctl.plugins.storage import hf_hub, s3
models = {}
def register(name, factory, *, config_model=None, description=""):
    models[name] = config_model.__module__
    config_model()
s3.register_storage(register)
hf_hub.register_storage(register)
clients = ("boto3", "botocore", "huggingface_hub", "reasonctl.storage.s3.client",
           "reasonctl.storage.hub.client")
before = [m for m in clients if m in sys.modules]
built = type(s3.build_s3_storage(None)).__module__
print(json.dumps({"models": models, "before": before, "built": built,
                  "hub_client": "huggingface_hub" in sys.modules}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["models"] == {"s3": "reasonctl.storage.s3.config",
                                "hf": "reasonctl.storage.hub.config"}
    assert report["before"] == []
    assert report["built"] == "reasonctl.storage.s3.client"
    assert report["hub_client"] is False
