"""Storage URIs, the local storage plugin, storage config sections and ``reasonctl export``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from reasonctl.core.config import load_config
from reasonctl.core.errors import ConfigError, UnknownComponentError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.storage import fetch_model, join_uri, open_storage, parse_uri
from reasonctl.storage.local import LocalStorage


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load()


def make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"hidden_size": 8}',
        "model.safetensors": bytes(range(256)) * 64,
        "nested/deeper/tokenizer.json": b"{}",
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def digest_tree(root: Path) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in read_tree(root).items()}


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/a/b", ("s3", "bucket/a/b")),
        ("S3://bucket", ("s3", "bucket")),
        ("hf://owner/repo@dev/sub", ("hf", "owner/repo@dev/sub")),
        ("file:///abs/path", ("file", "/abs/path")),
        ("relative/dir", ("file", "relative/dir")),
        ("/abs/dir", ("file", "/abs/dir")),
        ("C:\\models\\x", ("file", "C:\\models\\x")),
    ],
)
def test_parse_uri(uri: str, expected: tuple[str, str]) -> None:
    assert parse_uri(uri) == expected


def test_join_uri() -> None:
    assert join_uri("s3://b/run/", "checkpoints/step_2") == "s3://b/run/checkpoints/step_2"
    assert join_uri("hf://o/r@dev", "/export/final/") == "hf://o/r@dev/export/final"
    assert join_uri("s3://b/run", "") == "s3://b/run"


def test_schemes_are_registered_by_plugins(host: PluginHost) -> None:
    assert {"file", "s3", "hf"} <= set(host.registry.names("storage"))
    owners = {spec.name: spec.owner.name for spec in host.registry.all()
              if spec.kind == "storage"}
    assert owners["file"] == "storage-file"
    assert owners["s3"] == "storage-s3"
    assert owners["hf"] == "storage-hf"
    assert isinstance(open_storage(host.registry, "some/plain/path"), LocalStorage)


def test_unknown_scheme_lists_available_schemes(host: PluginHost) -> None:
    with pytest.raises(UnknownComponentError) as info:
        open_storage(host.registry, "s3a://bucket/x")
    message = str(info.value)
    assert "Unknown storage 's3a'" in message
    assert "s3 (reasonctl)" in message and "hf (reasonctl)" in message
    assert "Did you mean 's3'?" in message


def test_local_round_trip_is_atomic_and_leaves_sources_alone(tmp_path: Path) -> None:
    source = tmp_path / "src"
    files = make_tree(source)
    before = digest_tree(source)
    storage = LocalStorage()
    target = f"file://{tmp_path}/remote/run"

    storage.put_dir(source, target)
    assert read_tree(tmp_path / "remote" / "run") == files
    assert storage.list(target) == [join_uri(target, rel) for rel in sorted(files)]
    assert storage.exists(join_uri(target, "nested/deeper"))
    assert not storage.exists(join_uri(target, "missing"))
    assert not [p for p in (tmp_path / "remote").rglob("*") if ".tmp-" in p.name]

    storage.put_file(source / "config.json", join_uri(target, "extra/config.json"))
    back = storage.get_dir(target, tmp_path / "back")
    assert read_tree(back)["extra/config.json"] == files["config.json"]
    single = storage.get_file(join_uri(target, "model.safetensors"), tmp_path / "one.bin")
    assert single.read_bytes() == files["model.safetensors"]

    # Uploading again over an existing tree replaces files and keeps others.
    (source / "config.json").write_bytes(b"{}")
    storage.put_dir(source, target)
    assert (tmp_path / "remote/run/config.json").read_bytes() == b"{}"
    assert (tmp_path / "remote/run/extra/config.json").exists()

    storage.delete(join_uri(target, "nested"))
    assert not (tmp_path / "remote/run/nested").exists()
    storage.delete(join_uri(target, "nested"))  # deleting what is gone is fine
    assert digest_tree(source) == {**before, "config.json": hashlib.sha256(b"{}").hexdigest()}


def test_local_errors_name_the_path(tmp_path: Path) -> None:
    storage = LocalStorage()
    with pytest.raises(Exception, match="no such directory"):
        storage.get_dir(str(tmp_path / "nope"), tmp_path / "out")
    with pytest.raises(Exception, match="into itself"):
        storage.put_dir(tmp_path, str(tmp_path / "inside"))


def test_fetch_model_returns_local_paths_unchanged(host: PluginHost, tmp_path: Path) -> None:
    assert fetch_model(host.registry, None, str(tmp_path)) == tmp_path
    assert fetch_model(host.registry, None, f"file://{tmp_path}") == tmp_path


def test_storage_sections_are_typed_and_strict(host: PluginHost) -> None:
    config = load_config(
        overrides=["storage.s3.part_size_mb=16", "storage.hf.private=false",
                   "storage.file.fsync=true"],
        registry=host.registry,
    )
    assert config.component_config("storage", "s3").part_size_mb == 16
    assert config.component_config("storage", "hf").private is False
    assert config.component_config("storage", "s3").max_attempts == 5  # default
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["storage.s3.part_size_mb=2", "storage.s3.partsize_mb=8"],
                    registry=host.registry)
    text = str(info.value)
    assert "storage.s3.part_size_mb" in text and "greater than or equal to 5" in text
    assert "storage.s3.partsize_mb: unknown key; did you mean 'part_size_mb'?" in text


def test_storage_options_never_expose_secrets(
    host: PluginHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY12345",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "HF_TOKEN": "hf_ExampleSecretTokenValue",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    config = load_config(
        overrides=[
            "checkpoint.upload=['s3://bucket/run', 'hf://owner/repo']",
            "storage.s3.endpoint_url='http://127.0.0.1:9000'",
            "storage.s3.region='us-east-1'",
            "storage.hf.commit_message='token is hf_ExampleSecretTokenValue'",
        ],
        registry=host.registry,
    )
    shown = config.to_toml() + json.dumps(config.to_dict())
    for value in secrets.values():
        assert value not in shown
    assert "s3://bucket/run" in shown and "http://127.0.0.1:9000" in shown
    # Credentials can never be smuggled into the config through the endpoint URL.
    with pytest.raises(ConfigError, match="must not contain credentials"):
        load_config(overrides=["storage.s3.endpoint_url='http://user:pw@minio:9000'"],
                    registry=host.registry)


def export_app() -> typer.Typer:
    from reasonctl.cli.export_cmd import export_command

    app = typer.Typer()
    app.command("export")(export_command)
    app.command("noop")(lambda: None)  # keep "export" a named sub-command
    return app


def test_export_command_pushes_an_export_and_marks_checkpoints(tmp_path: Path) -> None:
    export = tmp_path / "run" / "export" / "final"
    files = make_tree(export)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text('{"step": 3}')
    runner = CliRunner()

    result = runner.invoke(export_app(), ["export", str(export), "--to", str(tmp_path / "pub")])
    assert result.exit_code == 0, result.output
    assert "pushed" in result.output and "3 file(s)" in result.output
    assert read_tree(tmp_path / "pub") == files

    result = runner.invoke(export_app(), ["export", str(checkpoint), "--to",
                                          f"file://{tmp_path}/ckpt/step_3"])
    assert result.exit_code == 0, result.output
    assert sorted(read_tree(tmp_path / "ckpt" / "step_3")) == [".upload-complete.json",
                                                               "manifest.json"]

    result = runner.invoke(export_app(), ["export", str(tmp_path / "missing"), "--to", "x"])
    assert result.exit_code != 0
    assert "no such file or directory to export" in str(result.exception)
