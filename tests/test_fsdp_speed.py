"""The fsdp backend's speed settings: compute-dtype shards, reduce dtype, prefetch; fused
optimizer and gradient clipping over sharded (DTensor) parameters without per-parameter work."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from tests.test_fsdp import losses, run_in_process, write_run_files

LEVERS = ("backend.fsdp.param_dtype='compute'", "backend.fsdp.reduce_dtype='compute'",
          "backend.fsdp.prefetch=2", "backend.fsdp.reshard_after_forward=true",
          "backend.fsdp.gradient_sync='last_micro_batch'")


def test_compute_dtype_shards_follow_the_single_backend(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    """bfloat16 shards, gradients and optimizer state in one process take the same steps as
    the single backend with ``param_dtype = "compute"``."""
    config = write_run_files(tmp_path, tiny_model_dir)
    common = ("model.dtype='bfloat16'", "checkpoint.every_steps=0")
    single = run_in_process(config, f"run.output_dir={tmp_path / 'single'}", *common,
                            "backend.name=single", "backend.single.param_dtype='compute'")
    fsdp = run_in_process(config, f"run.output_dir={tmp_path / 'fsdp'}", *common,
                          "backend.name=fsdp", *LEVERS)
    assert single.status == fsdp.status == "completed"
    want, got = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert want.keys() == got.keys() and len(want) > 3
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=2e-2), step
    assert want[max(want)] < want[1]  # it learns


def test_compute_dtype_keeps_bfloat16_shards_and_optimizer_state(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    from reasonctl.backends.fsdp import FSDPBackend
    from reasonctl.core.config import RunConfig
    from reasonctl.core.lifecycle import LifecycleHooks
    from reasonctl.core.plugins import PluginHost
    from reasonctl.core.protocols import RunContext

    config = RunConfig(model={"name_or_path": str(tiny_model_dir), "dtype": "bfloat16"},
                       backend={"device": "cpu", "name": "fsdp"},
                       run={"output_dir": str(tmp_path)})
    host = PluginHost.load()
    ctx = RunContext(config=config, registry=host.registry, hooks=LifecycleHooks(host.pm),
                     output_dir=tmp_path)
    ctx.total_steps = 4
    backend = FSDPBackend(param_dtype="compute", reduce_dtype="compute", prefetch=2,
                          chunk_tokens=64, export_shard_size="5GB")
    ctx.backend = backend
    try:
        backend.setup(ctx)
        assert {p.dtype for p in backend.policy.parameters()} == {torch.bfloat16}
        blocks = list(backend.hf_model.model.layers)
        assert len(blocks) >= 2
        states = [b._get_fsdp_state() for b in blocks]
        assert states[0]._states_to_forward_prefetch == states[1:3]
        assert states[-1]._states_to_backward_prefetch == states[-2:-4:-1]
        groups = [s._fsdp_param_group for s in states]
        assert all(g.post_forward_mesh_info is not None for g in groups[:-1])
        assert groups[-1].post_forward_mesh_info is None  # the last block stays gathered
    finally:
        backend.close()


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("param_dtype", "'bf16'", "backend.fsdp.param_dtype"),
    ("reduce_dtype", "'half'", "backend.fsdp.reduce_dtype"),
    ("prefetch", "-1", "backend.fsdp.prefetch"),
    ("prefech", "1", "backend.fsdp.prefech"),
    ("gradient_sync", "'never'", "backend.fsdp.gradient_sync"),
    ("reshard_after_forward", "'sometimes'", "backend.fsdp.reshard_after_forward"),
    ("reshard_after_forward", "2", "backend.fsdp.reshard_after_forward"),
])
def test_bad_speed_settings_exit_2_naming_the_key(tmp_path: Path, tiny_model_dir: Path,
                                                  key: str, value: str, expected: str) -> None:
    from reasonctl.cli import common
    from reasonctl.cli.app import build_app

    app = build_app(common.init_host(strict=False))
    config = write_run_files(tmp_path, tiny_model_dir)
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(config), "--set",
                                      "backend.name='fsdp'", "--set",
                                      f"backend.fsdp.{key}={value}"])
    output = result.output + (getattr(result, "stderr", "") or "")
    assert result.exit_code == 2, output
    assert expected in output and "Traceback" not in output, output


@pytest.mark.parametrize(("value", "resharded"), [
    ("default", [True, False]), ("always", [True, True]), ("never", [False, False]),
    (True, [True, False]), (False, [False, False]),
])
def test_reshard_after_forward_sets_each_block(tiny_model_dir: Path, tmp_path: Path,
                                               value: Any, resharded: list[bool]) -> None:
    """Which blocks free their gathered weights after forward (the root never does); the
    boolean spelling reads as default / never. ``resharded``: first and last block."""
    from reasonctl.core.config import RunConfig
    from reasonctl.core.lifecycle import LifecycleHooks
    from reasonctl.core.plugins import PluginHost
    from reasonctl.core.protocols import RunContext
    from reasonctl.plugins.backends.fsdp import FSDPBackendConfig, build_fsdp_backend

    config = RunConfig(model={"name_or_path": str(tiny_model_dir)},
                       backend={"device": "cpu", "name": "fsdp"},
                       run={"output_dir": str(tmp_path)})
    host = PluginHost.load()
    ctx = RunContext(config=config, registry=host.registry, hooks=LifecycleHooks(host.pm),
                     output_dir=tmp_path)
    ctx.total_steps = 1
    backend = build_fsdp_backend(FSDPBackendConfig(reshard_after_forward=value))
    ctx.backend = backend
    try:
        backend.setup(ctx)
        blocks = list(backend.hf_model.model.layers)
        assert len(blocks) >= 2
        groups = [b._get_fsdp_state()._fsdp_param_group for b in blocks]
        assert [g.post_forward_mesh_info is not None for g in groups] == [
            resharded[0], *[resharded[0]] * (len(blocks) - 2), resharded[1]]
        root = backend.policy._get_fsdp_state()._fsdp_param_group
        assert root.post_forward_mesh_info is None
    finally:
        backend.close()


@pytest.fixture
def one_process_group() -> Any:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 16)).square().mean().backward()
    return model


def op_counts(fn: Any) -> dict[str, int]:
    """Calls of each operator made by ``fn`` (not those a tensor subclass makes inside)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested = parent.name.startswith(("aten::", "Python"))
            parent = parent.cpu_parent
        if not nested:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def test_adamw_on_shards_is_one_fused_kernel(one_process_group: None) -> None:
    """The optimizer CUDA runs get (``fused``) takes one kernel call for every sharded
    parameter, not a per-parameter loop (the CPU kernel has the same DTensor dispatch)."""
    from reasonctl.backends.optim import build_optimizer

    model = sharded_model()
    train = SimpleNamespace(lr=1e-3, betas=(0.9, 0.99), adam_eps=1e-8, weight_decay=0.0)
    optimizer = build_optimizer(model.named_parameters(), train,  # type: ignore[arg-type]
                                device=torch.device("cuda"))
    assert all(group["fused"] for group in optimizer.param_groups)
    optimizer.step()  # creates the state
    counts = op_counts(optimizer.step)
    groups = len(optimizer.param_groups)  # weights (decayed) and biases
    assert groups == 2 and counts.get("aten::_fused_adamw_") == groups, counts
    assert "aten::addcdiv_" not in counts and "aten::lerp_" not in counts, counts


def test_gradient_clipping_of_shards_takes_one_norm_and_one_scale(
        one_process_group: None) -> None:
    from reasonctl.backends.base import TorchBackend

    model = sharded_model()
    expected = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]))
    backend = TorchBackend(chunk_tokens=8)
    backend.policy = model
    backend.ctx = SimpleNamespace(  # type: ignore[assignment]
        config=SimpleNamespace(train=SimpleNamespace(max_grad_norm=1e-3)))
    norms: list[torch.Tensor] = []
    counts = op_counts(lambda: norms.append(backend.clip_gradients()))
    torch.testing.assert_close(norms[0], expected)
    # one norm over all gradients, one reduction over ranks, one scaling of all gradients
    assert counts.get("aten::_foreach_norm") == 1, counts
    assert counts.get("aten::linalg_vector_norm") == 1, counts
    assert counts.get("Redistribute") == 1, counts
    assert counts.get("aten::_foreach_mul_") == 1, counts
    assert "aten::item" not in counts and "aten::_local_scalar_dense" not in counts, counts
    clipped = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_with_every_lever_follow_the_single_backend(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two gloo processes with bfloat16 shards, bfloat16 reduction, deeper prefetch and the
    last block kept gathered take the single backend's steps (``param_dtype = "compute"``)."""
    from tests.test_fsdp import launch

    config = write_run_files(tmp_path, tiny_model_dir)
    common = ("model.dtype='bfloat16'", "checkpoint.every_steps=0")
    single = run_in_process(config, f"run.output_dir={tmp_path / 'single'}", *common,
                            "backend.name=single", "backend.single.param_dtype='compute'")
    assert single.status == "completed"
    sets = [arg for item in (*common, *LEVERS) for arg in ("--set", item)]
    launch(config, tmp_path / "fsdp2", *sets)
    want, got = losses(tmp_path / "single"), losses(tmp_path / "fsdp2")
    assert want.keys() == got.keys()
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=2e-2), step


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_keeping_blocks_gathered_take_the_default_steps(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """``reshard_after_forward = "never"`` (ZeRO-2) and ``"always"`` on two gloo processes
    give the default setting's losses and gradient norms: only when weights are gathered
    changes, not what is computed."""
    from reasonctl.loggers.metrics_file import read_metrics
    from tests.test_fsdp import launch

    config = write_run_files(tmp_path, tiny_model_dir)
    curves = {}
    for value in ("default", "never", "always"):
        out = tmp_path / value
        launch(config, out, "--set", "checkpoint.every_steps=0", "--set",
               f"backend.fsdp.reshard_after_forward='{value}'")
        curves[value] = [(r["step"], r["loss"], r["grad_norm"])
                         for r in read_metrics(out / "metrics.jsonl")]
    want = curves["default"]
    assert len(want) > 3 and want[-1][1] < want[0][1]  # it learns
    for value in ("never", "always"):
        got = curves[value]
        assert [s for s, _, _ in got] == [s for s, _, _ in want], value
        for (step, loss, norm), (_, want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-6), (value, step)
            assert norm == pytest.approx(want_norm, rel=1e-6), (value, step)
