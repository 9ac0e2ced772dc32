"""Pre-flight checks: what a valid config needs from the world, before any model loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel

import reasonctl
from reasonctl.core.config import (
    InputDir,
    InputPath,
    check_preflight,
    load_config,
    preflight_problems,
)
from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost
from reasonctl.runtime.composition import preflight


class ShardConfig(BaseModel):  # a third-party dataset marking its inputs
    shards: Annotated[list[str] | None, InputPath("file", required=True)] = None
    cache: InputDir = "."


class ShardPlugin:
    @reasonctl.hookimpl
    def register_datasets(self, register):
        register("shards", lambda cfg, **_: cfg, config_model=ShardConfig)


@pytest.fixture(scope="module")
def registry():
    host = PluginHost.load()
    host.add_plugin(ShardPlugin(), name="shard-plugin")
    return host.registry


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "2+2?", "response": "4"}\n')
    return path


def config(registry, tmp_path: Path, *overrides: str):
    base = [f"run.output_dir='{tmp_path / 'out'}'", "backend.device=cpu"]
    return load_config([], [*base, *overrides], registry=registry, environ={})


def test_a_sound_config_has_no_problems(registry, tmp_path, data_file):
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 f"eval.data='{data_file}'", f"checkpoint.upload=['s3://bucket/run', "
                 f"'hf://owner/repo', '{tmp_path / 'mirror'}']")
    assert preflight_problems(cfg, registry) == []
    check_preflight(cfg, registry)


def test_data_paths_must_exist_and_be_files(registry, tmp_path, data_file):
    problems = preflight_problems(config(registry, tmp_path), registry)
    assert problems == ["data.jsonl.path: not set; point it at an existing file"]
    cfg = config(registry, tmp_path, f"data.jsonl.path=['{data_file}', '{tmp_path}', 'gone.jsonl']",
                 f"eval.data='{tmp_path / 'eval.jsonl'}'", f"data.jsonl.media_root='{data_file}'")
    problems = preflight_problems(cfg, registry)
    assert sorted(problems) == [
        f"data.jsonl.media_root: '{data_file}' is not a directory",
        f"data.jsonl.path.1: '{tmp_path}' is a directory; expected a file",
        f"data.jsonl.path.2: 'gone.jsonl' does not exist (cwd: {Path.cwd()})",
        f"eval.data: '{tmp_path / 'eval.jsonl'}' does not exist (cwd: {Path.cwd()})",
    ]
    cfg = config(registry, tmp_path, "data.format=video_folder",
                 f"data.video_folder.root='{data_file}'")
    assert preflight_problems(cfg, registry) == [
        f"data.video_folder.root: '{data_file}' is not a directory"]


def test_only_the_selected_components_are_checked(registry, tmp_path, data_file):
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 "data.llava.path='missing.json'")  # llava is not the selected format
    assert preflight_problems(cfg, registry) == []


def test_third_party_markers_are_found(registry, tmp_path, data_file):
    cfg = config(registry, tmp_path, "data.format=shards")
    assert preflight_problems(cfg, registry) == ["data.shards.shards: not set; point it at an "
                                                 "existing file"]
    cfg = config(registry, tmp_path, "data.format=shards", f"data.shards.shards=['{data_file}']",
                 f"data.shards.cache='{tmp_path / 'no-cache'}'")
    assert preflight_problems(cfg, registry) == [
        f"data.shards.cache: '{tmp_path / 'no-cache'}' does not exist (cwd: {Path.cwd()})"]


def test_output_dir_must_be_a_writable_directory(registry, tmp_path, data_file):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 f"run.output_dir='{taken}'")
    assert preflight_problems(cfg, registry) == [
        f"run.output_dir: '{taken}' is a file; choose a directory"]
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 f"run.output_dir='{taken / 'sub' / 'run'}'")
    assert preflight_problems(cfg, registry) == [
        f"run.output_dir: cannot create '{taken / 'sub' / 'run'}': {taken} is a file"]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                     f"run.output_dir='{locked}'")
        assert preflight_problems(cfg, registry) == [
            f"run.output_dir: '{locked}' is not writable: no file can be created there "
            "(Permission denied); check its permissions or choose another directory"]
    # permission bits do not tell (root writes anywhere, but nobody creates files in /proc)
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 "run.output_dir='/proc/reasonctl-run'")
    (problem,) = preflight_problems(cfg, registry)
    assert problem.startswith("run.output_dir: cannot create '/proc/reasonctl-run': no file "
                              "can be created in /proc (")
    assert not list(tmp_path.glob(".reasonctl-write-check-*"))  # the probe file is removed
    assert preflight_problems(config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                                     f"run.output_dir='{tmp_path}'"), registry) == []
    assert not list(tmp_path.glob(".reasonctl-write-check-*"))


def test_a_local_model_directory_must_exist_and_hold_a_model(registry, tmp_path, data_file,
                                                              monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    (tmp_path / "models").mkdir()

    def problems(name: str, tokenizer: str | None = None) -> list[str]:
        extra = [f"model.tokenizer='{tokenizer}'"] if tokenizer else []
        return preflight_problems(config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                                         f"model.name_or_path='{name}'", *extra), registry)

    assert problems(str(tmp_path / "gone")) == [
        f"model.name_or_path: '{tmp_path / 'gone'}' does not exist (cwd: {Path.cwd()}); point "
        "it at a model directory (e.g. an export's export/final), or a Hub id such as "
        "'Qwen/Qwen2.5-0.5B-Instruct'"]
    assert problems(str(empty)) == [
        f"model.name_or_path: '{empty}' is an empty directory; point it at a model directory"]
    assert problems(str(tokenizer_only)) == [
        f"model.name_or_path: '{tokenizer_only}' holds no model (config.json, model_index.json "
        "missing); point it at a Hugging Face model directory or a diffusers pipeline"]
    assert problems(str(data_file))[0].endswith("is a file; point it at the model directory")
    assert problems("outputs/run/export/final")[0].startswith(
        "model.name_or_path: 'outputs/run/export/final' does not exist")
    # Hub ids, built-in models and storage URIs are not local directories
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "tiny-random", "tiny-random-vl",
                 "s3://bucket/model"):
        assert problems(name) == [], name
    # ... unless the first part of owner/repo is a local directory
    monkeypatch.chdir(tmp_path)
    assert problems("models/qwen")[0].startswith(
        "model.name_or_path: 'models/qwen' does not exist")
    assert problems("tiny-random", tokenizer=str(empty)) == [
        f"model.tokenizer: '{empty}' is an empty directory; point it at a model directory"]
    assert problems("tiny-random", tokenizer=str(tokenizer_only)) == []


def test_upload_uris_must_be_well_formed(registry, tmp_path, data_file):
    uris = ["s3://", "s3:///prefix", "s3://user:secret-pw@bucket/x", "hf://only-owner",
            "sftp://host/x", "s3:/bucket/x"]
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 f"checkpoint.upload={uris!r}".replace('"', "'"))
    problems = preflight_problems(cfg, registry)
    assert problems[0] == "checkpoint.upload.0: 's3://' has no bucket; expected s3://BUCKET[/prefix]"
    assert problems[1].startswith("checkpoint.upload.1: 's3:///prefix' has no bucket")
    assert problems[2].startswith("checkpoint.upload.2: 's3://***@bucket/x' holds credentials")
    assert "secret-pw" not in "\n".join(problems)
    assert problems[3].startswith("checkpoint.upload.3: 'hf://only-owner' needs a repository")
    assert problems[4].startswith("checkpoint.upload.4: unknown storage scheme 'sftp'")
    assert "installed: file, hf, s3" in problems[4]
    assert problems[5].startswith("checkpoint.upload.5: 's3:/bucket/x' is not a URI")
    assert len(problems) == 6


def all_problems(cfg, registry, world_size=1):
    """The run's pre-flight problems, the algorithm's own checks included."""
    try:
        preflight(cfg, registry, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def test_batch_layout_resume_and_device(registry, tmp_path, data_file):
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'", "algorithm.name=sft",
                 "train.global_batch_size=8", "train.micro_batch_size=3",
                 f"run.resume='{tmp_path / 'checkpoints' / 'step_9'}'")
    problems = all_problems(cfg, registry)
    assert len(problems) == 2
    assert problems[0].startswith(f"run.resume: checkpoint '{tmp_path / 'checkpoints' / 'step_9'}'"
                                  " does not exist")
    assert problems[1] == ("train.global_batch_size: 8 is not a multiple of "
                           "train.micro_batch_size (3); use e.g. 6, or a micro_batch_size that "
                           "divides 8")
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 "train.global_batch_size=8", "train.micro_batch_size=2")
    assert all_problems(cfg, registry, world_size=3)[0].startswith(
        "train.global_batch_size: 8 is not a multiple of 3 data-parallel ranks")
    step = tmp_path / "step_1"
    step.mkdir()
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'", f"run.resume='{step}'")
    assert preflight_problems(cfg, registry)[0].startswith(
        f"run.resume: '{step}' is not a complete checkpoint (no manifest.json)")
    (step / "manifest.json").write_text("{}")
    assert preflight_problems(cfg, registry) == []
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'", "run.resume='true'")
    assert "write run.resume = true without quotes" in preflight_problems(cfg, registry)[0]


def test_a_missing_cuda_device_is_reported(registry, tmp_path, data_file):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = config(registry, tmp_path, f"data.jsonl.path='{data_file}'", "backend.device='cuda:1'")
    with pytest.raises(ConfigError) as info:
        check_preflight(cfg, registry)
    assert info.value.problems == ["backend.device: 'cuda:1' but CUDA is not available on this "
                                   "machine; use 'cpu' or 'auto'"]


class VaultConfig(BaseModel):  # a third-party storage scheme's config model
    def uri_problems(self, uri: str) -> list[str]:
        vault = uri.removeprefix("vault://").split("/", 1)[0]
        return [] if vault else ["names no vault; expected vault://NAME[/prefix]"]


class Vault:
    """Access is refused to ``locked`` vaults; ``offline`` ones do not answer."""

    def __init__(self, config: VaultConfig) -> None:
        pass

    def check_access(self, uri: str) -> None:
        if "locked" in uri:
            raise reasonctl.StorageError(f"{uri}: access denied", permanent=True)
        if "offline" in uri:
            raise reasonctl.StorageError(f"{uri}: no answer from the vault")

    def put_file(self, local, uri): ...
    def put_dir(self, local, uri): ...
    def get_file(self, uri, local): ...
    def get_dir(self, uri, local): ...
    def list(self, uri): ...
    def exists(self, uri): ...
    def delete(self, uri): ...


class VaultPlugin:
    @reasonctl.hookimpl
    def register_storage(self, register):
        register("vault", Vault, config_model=VaultConfig)


def test_a_plugin_storage_checks_its_uris_and_access_before_anything_loads(
        tmp_path, data_file, capsys):
    host = PluginHost.load()
    host.add_plugin(VaultPlugin(), name="vault-plugin")
    uris = ["vault://", "vault://locked/run", "vault://offline/run", "vault://open/run"]
    cfg = config(host.registry, tmp_path, f"data.jsonl.path='{data_file}'",
                 f"checkpoint.upload={uris!r}".replace('"', "'"))
    assert preflight_problems(cfg, host.registry) == [
        "checkpoint.upload.0: 'vault://' names no vault; expected vault://NAME[/prefix]"]
    with pytest.raises(ConfigError) as info:  # config validate asks the storage too
        preflight(cfg, host.registry, check_access=True)
    assert info.value.problems == [
        "checkpoint.upload.0: 'vault://' names no vault; expected vault://NAME[/prefix]",
        "checkpoint.upload.1: vault://locked/run: access denied"]
    warning = capsys.readouterr().err
    assert "warning: checkpoint.upload.2 vault://offline/run: vault://offline/run: no answer" \
           in warning
