"""FSDP2 on CPU (gloo): 2 processes follow the single-process loss curve and reshard on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reasonctl.core.config import load_config
from reasonctl.core.plugins import PluginHost
from reasonctl.loggers.metrics_file import read_metrics
from reasonctl.runtime.runner import run

STEPS = 6


def write_run_files(root: Path, model_dir: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": f"reverse {w}"},
                      {"role": "assistant", "content": f"<answer>{w[::-1]}</answer>"}]}
        for w in ("abc", "hello", "torch", "shard", "gloo", "mesh", "rank", "step")
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "run.toml"
    config.write_text(f"""
[run]
seed = 3

[model]
name_or_path = "{model_dir}"

[data]
format = "jsonl"

[data.jsonl]
path = "{data}"

[train]
lr = 5e-3
max_steps = {STEPS}
global_batch_size = 4
micro_batch_size = 1
schedule = "linear"
weight_decay = 0.01

[backend]
device = "cpu"

[checkpoint]
every_steps = 3

[logging]
loggers = ["jsonl"]
plot = false
""")
    return config


def run_in_process(config_file: Path, *overrides: str) -> Any:
    host = PluginHost.load()
    config = load_config(config_file, overrides, registry=host.registry)
    return run(config, host=host)


def launch(config_file: Path, output_dir: Path, *extra: str, processes: int = 2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "reasonctl", "run", "--backend", "fsdp",
               "--nproc-per-node", str(processes), "--config", str(config_file),
               "--output-dir", str(output_dir), *extra]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl")}


def export_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in (output_dir / "export" / "final").glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The single-process run every FSDP run is compared with."""
    root = tmp_path_factory.mktemp("fsdp-ref")
    config = write_run_files(root, tiny_model_dir)
    result = run_in_process(config, f"run.output_dir={root / 'single'}", "backend.name=single")
    assert result.status == "completed"
    return root


def assert_close_runs(got: Path, want: Path, steps: range, *, rel: float = 1e-4) -> None:
    got_losses, want_losses = losses(got), losses(want)
    for step in steps:
        assert got_losses[step] == pytest.approx(want_losses[step], rel=rel), step
    got_weights, want_weights = export_weights(got), export_weights(want)
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in got_weights.items():
        torch.testing.assert_close(tensor, want_weights[name], atol=1e-5, rtol=1e-4)


def assert_resumes_in_one_process(reference: Path, out: Path, name: str) -> None:
    """Resume ``out``'s step-3 checkpoint in one process; steps 4.. equal ``out``'s."""
    resumed = reference / name
    result = run_in_process(
        reference / "run.toml", f"run.output_dir={resumed}", "backend.name=single",
        f"run.resume={json.dumps(str(out / 'checkpoints' / 'step_3'))}",
    )
    assert result.status == "completed" and result.steps == STEPS
    assert sorted(losses(resumed)) == list(range(4, STEPS + 1))
    assert_close_runs(resumed, out, range(4, STEPS + 1))


def test_fsdp_in_one_process_matches_single(reference: Path) -> None:
    out = reference / "fsdp1"
    result = run_in_process(reference / "run.toml", f"run.output_dir={out}", "backend.name=fsdp")
    assert result.status == "completed"
    assert not torch.distributed.is_initialized()  # the backend cleaned up its group
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))


def test_one_gradient_reduction_per_step_keeps_the_float32_steps(reference: Path) -> None:
    """Four micro-batches per step, gradients reduced once after the last
    (``gradient_sync = "last_micro_batch"``): the single backend's steps and weights."""
    out = reference / "fsdp1-sync-last"
    result = run_in_process(reference / "run.toml", f"run.output_dir={out}", "backend.name=fsdp",
                            "backend.fsdp.gradient_sync='last_micro_batch'")
    assert result.status == "completed"
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))


@pytest.mark.slow
def test_fsdp_compiles_blocks_with_train_compile(reference: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import reasonctl.backends.fsdp as fsdp_module

    compiled: list[int] = []

    def counting_compile_blocks(model: torch.nn.Module) -> int:
        compiled.append(real_compile_blocks(model))
        return compiled[-1]

    real_compile_blocks = fsdp_module.compile_blocks
    monkeypatch.setattr(fsdp_module, "compile_blocks", counting_compile_blocks)
    out = reference / "fsdp1-compiled"
    result = run_in_process(reference / "run.toml", f"run.output_dir={out}",
                            "backend.name=fsdp", "train.compile=true")
    assert result.status == "completed"
    assert len(compiled) == 1 and compiled[0] > 0  # train.compile is not silently ignored
    assert_close_runs(out, reference / "single", range(1, STEPS + 1), rel=1e-3)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_match_single_and_resume_in_one(reference: Path) -> None:
    out = reference / "fsdp2"
    launch(reference / "run.toml", out)
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))
    state = out / "checkpoints" / "step_3" / "state"
    assert len(list(state.glob("*.distcp"))) == 2  # one file per rank

    assert_resumes_in_one_process(reference, out, "resumed-in-one")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_with_background_checkpoints_resume_alike(reference: Path) -> None:
    """``checkpoint.async_save`` with 2 processes: both ranks' shards are written by
    background threads over their own gloo group, committed, and resume exactly."""
    out = reference / "fsdp2-async"
    launch(reference / "run.toml", out, "--set", "checkpoint.async_save=true")
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))
    for step in (3, 6):
        checkpoint = out / "checkpoints" / f"step_{step}"
        assert (checkpoint / "manifest.json").is_file()
        assert len(list((checkpoint / "state").glob("*.distcp"))) == 2
    assert not list((out / "checkpoints").glob(".tmp-*"))

    assert_resumes_in_one_process(reference, out, "async-resumed-in-one")


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_pair_matches_single_and_resumes_in_one(reference: Path) -> None:
    """``backend.fsdp.tp = 2``: two processes each hold half of every block's heads and
    MLP channels (DTensor), follow the single-process curve, and their checkpoint
    resumes in one process."""
    from torch.distributed.checkpoint import FileSystemReader

    out = reference / "tp2"
    launch(reference / "run.toml", out, "--set", "backend.fsdp.tp=2")
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))
    # the output projection is split by input features (row-wise), the query by output
    # features: what tensor parallelism stores, unlike FSDP's row shards
    metadata = FileSystemReader(str(out / "checkpoints" / "step_3" / "state")).read_metadata()
    layer = "model.hf_model.model.layers.0."
    o_proj = metadata.state_dict_metadata[layer + "self_attn.o_proj.weight"]
    q_proj = metadata.state_dict_metadata[layer + "self_attn.q_proj.weight"]
    assert sorted(tuple(c.offsets) for c in o_proj.chunks) == [(0, 0), (0, 32)]
    assert sorted(tuple(c.offsets) for c in q_proj.chunks) == [(0, 0), (32, 0)]
    assert_resumes_in_one_process(reference, out, "tp2-resumed-in-one")


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_pairs_sharded_by_fsdp_match_single(reference: Path) -> None:
    """Four processes: two data-parallel FSDP ranks of tensor-parallel pairs (2D mesh)."""
    out = reference / "tp2-dp2"
    launch(reference / "run.toml", out, "--set", "backend.fsdp.tp=2", processes=4)
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))


def test_tensor_parallel_sizes_are_checked() -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2Config

    from reasonctl.backends.tensor_parallel import check_tensor_parallel
    from reasonctl.core.errors import ConfigError

    config = Qwen2Config(num_attention_heads=6, num_key_value_heads=3, intermediate_size=102,
                         hidden_size=96)
    check_tensor_parallel(config, 1)
    with pytest.raises(ConfigError) as error:
        check_tensor_parallel(config, 4)
    message = str(error.value)
    for name in ("num_attention_heads (6)", "num_key_value_heads (3)", "intermediate_size (102)"):
        assert name in message
    with pytest.raises(ConfigError, match="text decoders only"):
        check_tensor_parallel(Qwen2_5_VLConfig(), 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_replicas_match_single(reference: Path) -> None:
    out = reference / "hsdp"
    launch(reference / "run.toml", out, "--set", "backend.fsdp.dp_replicate=2")
    assert_close_runs(out, reference / "single", range(1, STEPS + 1))


def test_vision_language_model_shards_and_packs_its_samples(tmp_path: Path) -> None:
    from data_factories import write_png

    from reasonctl import hookimpl
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir
    from reasonctl.sdk.api import run as sdk_run

    model_dir = make_tiny_qwen2_5_vl_dir(tmp_path / "tiny-vl", seed=0)
    samples = [
        Sample([Message("user", [ContentPart("image", path=str(write_png(
                    tmp_path / f"{i}.png", (56, 56), seed=i))),
                                 ContentPart("text", text="Which picture?")]),
                Message("assistant", [ContentPart("text", text=f"<answer>{i}</answer>")])])
        for i in range(4)
    ]

    class Losses:
        def __init__(self) -> None:
            self.values: list[float] = []

        @hookimpl
        def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
            self.values.append(metrics["loss"])

    curves = {}
    for label, backend, packing in (("single", "single", False), ("fsdp", "fsdp", False),
                                    ("packed", "single", True)):
        losses = Losses()
        result = sdk_run({
            "run": {"output_dir": str(tmp_path / label)},
            "model": {"name_or_path": str(model_dir), "max_length": 512},
            "data": {"packing": packing},
            "train": {"lr": 1e-2, "max_steps": 3, "global_batch_size": 4,
                      "micro_batch_size": 2},
            "backend": {"name": backend, "device": "cpu"},
            "logging": {"loggers": []},
            "checkpoint": {"export_final": False},
        }, datasets=samples, plugins=[losses])
        assert result.status == "completed"
        curves[label] = losses.values
    assert curves["fsdp"] == pytest.approx(curves["single"], rel=1e-4)
    # packed image samples train as the padded ones do
    assert curves["packed"] == pytest.approx(curves["single"], rel=1e-4)
