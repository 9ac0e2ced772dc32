"""Process layouts a user gets wrong are refused by ``reasonctl run --nproc-per-node N``
before any worker starts: once, with exit 2, naming the key and a value that fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from reasonctl.backends.layout import fsdp_layout_problems, megatron_layout_problems
from tests.test_fsdp import write_run_files


def run_cli(monkeypatch: pytest.MonkeyPatch, config: Path, *args: str) -> tuple[int, str]:
    """``reasonctl run --config config args...`` in this process; starting workers fails."""
    from reasonctl.cli import common, launch
    from reasonctl.cli.app import build_app

    def no_workers(*_: Any, **__: Any) -> int:
        raise AssertionError("a worker was started for a layout that cannot run")

    monkeypatch.setattr(launch, "launch_workers", no_workers)
    app = build_app(common.init_host(strict=False))
    result = CliRunner().invoke(app, ["run", "--config", str(config), *args])
    return result.exit_code, result.output  # stdout and stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["--backend", "fsdp", "--nproc-per-node", "4", "--set", "backend.fsdp.dp_replicate=3"],
     ["backend.fsdp.dp_replicate: 3 does not divide the 4 data-parallel ranks",
      "use one of 1, 2, 4"]),
    (["--backend", "fsdp", "--nproc-per-node", "4", "--set", "backend.fsdp.dp_shard=3"],
     ["backend.fsdp.dp_shard: dp_replicate (1) x dp_shard (3) = 3 must equal the 4",
      "set dp_shard = -1 (here 4)"]),
    (["--backend", "fsdp", "--nproc-per-node", "4", "--set", "backend.fsdp.tp=3"],
     ["backend.fsdp.tp: 3 does not divide the 4 processes; use one of 1, 2, 4"]),
    # the tiny model has 2 KV heads: tp = 4 cannot split them
    (["--backend", "fsdp", "--nproc-per-node", "4", "--set", "backend.fsdp.tp=4"],
     ["backend.fsdp.tp: 4 does not divide the model's num_key_value_heads (2)", "e.g. 2"]),
    # global batch 4, micro-batch 1: 8 data-parallel ranks cannot share it
    (["--backend", "fsdp", "--nproc-per-node", "8"],
     ["train.global_batch_size: 4 is not a multiple of 8 data-parallel ranks"]),
    (["--backend", "megatron", "--nproc-per-node", "4", "--set", "backend.megatron.tp=2",
      "--set", "backend.megatron.pp=2"],
     ["backend.name: 'megatron' needs CUDA GPUs", "use --backend fsdp"]),
    (["--backend", "megatron", "--nproc-per-node", "4", "--set", "backend.megatron.tp=3"],
     ["backend.megatron: tp (3) x pp (1) = 3 does not divide the 4 processes",
      "backend.megatron.tp: 3 does not divide the model's num_attention_heads (4)"]),
])
def test_bad_layouts_exit_2_before_any_worker_starts(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        args: list[str], expected: list[str]) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = run_cli(monkeypatch, config, *args, "--set", "backend.device='cpu'")
    assert code == 2, output
    for text in expected:
        assert text in output, output
        assert output.count(text) == 1, output  # once, not once per process
    assert "Traceback" not in output and "dp_shard = -1 to use" not in output, output


def test_the_built_in_tiny_model_is_checked_too(tmp_path: Path, tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.name_or_path = "tiny-random"`` (already created): its heads are known."""
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    resolve_tiny_alias("tiny-random")
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = run_cli(monkeypatch, config, "--backend", "fsdp", "--nproc-per-node", "4",
                           "--set", "backend.fsdp.tp=4", "--set", "backend.device='cpu'",
                           "--set", "model.name_or_path='tiny-random'")
    assert code == 2 and "num_key_value_heads (2)" in output, output


def test_layouts_that_fit_pass_and_give_the_data_parallel_ranks() -> None:
    from reasonctl.plugins.backends.fsdp import FSDPBackendConfig
    from reasonctl.plugins.backends.megatron import MegatronBackendConfig

    assert fsdp_layout_problems(4, dp_replicate=2, dp_shard=-1, cp=1, tp=1) == []
    assert fsdp_layout_problems(8, dp_replicate=2, dp_shard=2, cp=1, tp=2) == []
    assert FSDPBackendConfig(tp=2, cp=2).data_parallel_size(processes=8) == 2
    assert MegatronBackendConfig(tp=2, pp=2).data_parallel_size(processes=8) == 2
    # tp x cp leave 2 data-parallel ranks, which dp_replicate = 4 cannot split
    assert fsdp_layout_problems(8, dp_replicate=4, dp_shard=-1, cp=2, tp=2) == [
        "backend.fsdp.dp_replicate: 4 does not divide the 2 data-parallel ranks (8 processes "
        "/ (cp 2 x tp 2)); use one of 1, 2, or launch a multiple of 16 processes"]
    model = {"num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
             "num_hidden_layers": 28}

    def layout(**sizes: int) -> list[str]:  # without the CUDA problem of a CPU-only machine
        return [p for p in megatron_layout_problems(device="cuda", model=model, **sizes)
                if not p.startswith("backend.name:")]

    assert layout(processes=4, tp=2, pp=2, vpp=1) == []
    assert layout(processes=8, tp=1, pp=8, vpp=1) == [
        "backend.megatron.pp: the model's 28 layers (num_hidden_layers) do not split into "
        "pp x vpp = 8 equal stages; use a pp x vpp among 1, 2, 4, 7, 14, 28"]


def validate(config: Path, *args: str) -> tuple[int, str]:
    from reasonctl.cli import common
    from reasonctl.cli.app import build_app

    app = build_app(common.init_host(strict=False))
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(config), *args])
    return result.exit_code, result.output


def test_command_line_settings_of_an_unused_backend_exit_2(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--set backend.fsdp.*`` (or its variable) on a run of another backend would be
    ignored: it is refused naming the key and the flag that selects the backend."""
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = validate(config, "--set", "backend.fsdp.dp_replicate=2")
    assert code == 2, output
    assert ("backend.fsdp.dp_replicate: set by --set backend.fsdp.dp_replicate=2, but this "
            "run uses the 'single' backend") in output, output
    assert "add --backend fsdp" in output, output
    monkeypatch.setenv("REASONCTL_BACKEND__FSDP__TP", "2")
    code, output = validate(config, "--backend", "megatron")
    assert code == 2 and "backend.fsdp.tp: set by REASONCTL_BACKEND__FSDP__TP" in output, output
    code, output = validate(config, "--backend", "fsdp")
    assert code == 0, output
    # a file may hold several backends' sections and be run with any of them
    monkeypatch.delenv("REASONCTL_BACKEND__FSDP__TP")
    with config.open("a") as file:
        file.write("\n[backend.fsdp]\ndp_replicate = 2\n\n[backend.megatron]\ntp = 2\n")
    code, output = validate(config)
    assert code == 0, output
