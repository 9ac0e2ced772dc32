"""Context parallelism of the diffusion transformers on CPU (gloo, 2 processes): the split
Wan, SD3 and Cosmos transformers return the whole model's velocity and weight gradients
(even and uneven token counts, Cosmos with conditioning frames), and a FlowGRPO run with
``backend.fsdp.cp = 2`` follows the one-process run."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.diffusion_support import (  # noqa: F401
    launch_run,
    metrics,
    run_config,
    tiny_pipelines,
)
from tests.gloo_workers import gloo_group, run_gloo_workers

# (family, latent shape [C, T, h, w] or [C, h, w], conditioning latent frames, gradient
# checkpointing: blocks recomputed in the backward pass)
CASES = {
    "wan_uneven": ("wan", (4, 3, 6, 2), 0, True),    # 3 x 3 x 1 = 9 tokens: 5 + 4
    "sd3": ("sd3", (4, 8, 6), 0, False),             # 4 x 3 = 12 image tokens + text tokens
    "cosmos_frames": ("cosmos", (4, 3, 4, 4), 1, True),  # per-token timestep modulation
}


def _outputs(model_dir: str, shape: tuple[int, ...], frames: int, checkpointing: bool,
             group: Any = None) -> dict[str, Any]:
    """Velocity of a batch of 2 and the gradients of a loss on it (summed over ``group``)."""
    import torch.distributed as dist

    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.adapters.base import TextCondition
    from reasonctl.diffusion.context_parallel import enable_diffusion_context_parallel
    from reasonctl.diffusion.policy import load_transformer

    adapter = adapter_for(model_dir)
    model = load_transformer(Path(model_dir), dtype=torch.float32, device="cpu")
    if checkpointing:
        model.enable_gradient_checkpointing()
    if group is not None:
        enable_diffusion_context_parallel(model, group)
    generator = torch.Generator().manual_seed(7)
    latents = torch.randn(2, *shape, generator=generator)
    width, pooled = adapter.text_dims()
    text = TextCondition(torch.randn(2, 5, width, generator=generator),
                         torch.randn(2, pooled, generator=generator) if pooled else None)
    condition = None
    if frames:
        noise = torch.randn(2, *shape, generator=generator)
        condition = adapter.frame_condition(torch.randn(2, *shape, generator=generator),
                                            frames, noise)
    sigma = torch.tensor([0.3, 0.8])
    velocity = adapter.velocity(model, latents, sigma, text, frames=condition)
    target = torch.randn(velocity.shape, generator=generator)
    ((velocity - target) ** 2).mean().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return {"velocity": velocity.detach(), "grads": grads}


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], result_path: str) -> None:
    import torch.distributed as dist

    with gloo_group(rank, world, port):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results: dict[str, Any] = {name: _outputs(dirs[family], *case, dist.group.WORLD)
                                       for name, (family, *case) in CASES.items()}
        results["warnings"] = [str(w.message) for w in caught]
        if rank == 0:
            torch.save(results, result_path)


@pytest.mark.distributed
def test_split_transformers_match_the_whole_ones(tiny_pipelines: dict[str, Path],  # noqa: F811
                                                 tmp_path: Path) -> None:
    dirs = {family: str(path) for family, path in tiny_pipelines.items()}
    result_path = tmp_path / "result.pt"
    run_gloo_workers(_worker, 2, dirs, str(result_path))
    results = torch.load(result_path, weights_only=True)
    # the collectives are the current ones (a user sees no deprecation notice each step)
    assert not [w for w in results["warnings"] if "torch.distributed" in w], results["warnings"]
    for name, (family, *case) in CASES.items():
        want = _outputs(dirs[family], *case)
        got = results[name]
        torch.testing.assert_close(got["velocity"], want["velocity"], atol=1e-5, rtol=1e-4,
                                   msg=name)
        assert got["grads"].keys() == want["grads"].keys()
        moved = [p for p, g in want["grads"].items() if g.abs().sum() > 0]
        assert len(moved) > len(want["grads"]) // 2, name
        for param, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, atol=1e-6, rtol=1e-3,
                                       msg=f"{name}: {param}")


def test_unsupported_transformer_and_compile_are_refused_by_name() -> None:
    from reasonctl.core.errors import ConfigError
    from reasonctl.diffusion.context_parallel import check_diffusion_context_parallel

    flux = type("FluxTransformer2DModel", (torch.nn.Module,), {})()
    with pytest.raises(ConfigError, match="FluxTransformer2DModel has no context-parallel "
                                          "plan.*WanTransformer3DModel.*set cp = 1"):
        check_diffusion_context_parallel(flux)
    wan = type("WanTransformer3DModel", (torch.nn.Module,), {})()
    with pytest.raises(ConfigError, match="train.compile yet; set train.compile = false"):
        check_diffusion_context_parallel(wan, compile=True)
    check_diffusion_context_parallel(wan)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("algorithm", ["flow_grpo", "ddrl"])
def test_runs_with_cp_pair_follow_one_process(
        algorithm: str, tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    """``backend.fsdp.cp = 2``: both processes sample and train the same samples, each on
    half of the latent tokens; rewards, losses, KL to the adapters-off reference (FlowGRPO
    on the Wan video model with LoRA), the data loss (DDRL on SD3, full fine-tune) and
    gradient norms follow the one-process run."""


    import reasonctl
    from tests.diffusion_support import write_video_text

    data = write_video_text(tmp_path / "data", {f"c{i}": f"a bright scene {i}"
                                                for i in range(4)}, value=235)

    def config(out: Path) -> dict[str, Any]:
        if algorithm == "flow_grpo":
            return run_config(out, tiny_pipelines["wan"], steps=2, frames=5, kl_beta=0.1,
                              lora={"rank": 4, "alpha": 4})
        values = run_config(out, tiny_pipelines["sd3"], algorithm="ddrl", steps=2,
                            data_beta=1.0, exp_reward=True)
        values["data"] = {"format": "video_text", "video_text": {"root": str(data)}}
        return values

    reasonctl.run(config(tmp_path / "single"))
    pair = config(tmp_path / "cp2")
    pair["backend"] = {"name": "fsdp", "device": "cpu", "fsdp": {"cp": 2}}
    output = launch_run(pair, tmp_path / "cp2.toml", 2)
    assert "latent tokens split over cp=2" in output
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "cp2")
    assert len(two) == len(one) == 2
    keys = ["reward/mean", "loss", "grad_norm"]
    keys += ["kl"] if algorithm == "flow_grpo" else ["data_loss"]
    for key in keys:  # the values are small (the tiny models' rewards barely differ)
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-4,
                                                      abs=1e-12), key
    if algorithm == "flow_grpo":
        assert one[1]["kl"] > 0  # the second step's policy differs from the reference
    assert all(r["ratio_dev_first"] < 1e-5 for r in two)


@pytest.mark.slow
@pytest.mark.distributed
def test_dp_shard_pair_times_cp_pair_follows_one_process(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    """Four processes, ``dp_shard = 2`` x ``cp = 2`` (FlowGRPO, Wan video model, LoRA):
    each data-parallel pair of ranks samples half of the prompts, splitting their latent
    tokens; rewards, losses, KL and gradient norms follow the one-process run."""


    import reasonctl

    def config(out: Path) -> dict[str, Any]:
        return run_config(out, tiny_pipelines["wan"], steps=2, frames=5, kl_beta=0.1,
                          lora={"rank": 4, "alpha": 4})

    reasonctl.run(config(tmp_path / "single"))
    mesh = config(tmp_path / "dpcp")
    mesh["backend"] = {"name": "fsdp", "device": "cpu", "fsdp": {"dp_shard": 2, "cp": 2}}
    output = launch_run(mesh, tmp_path / "dpcp.toml", 4, timeout=1200)
    assert "latent tokens split over cp=2 ranks; data parallel over 2 group(s)" in output
    one, four = metrics(tmp_path / "single"), metrics(tmp_path / "dpcp")
    assert len(four) == len(one) == 2
    for key in ("reward/mean", "loss", "kl", "grad_norm"):
        assert [r[key] for r in four] == pytest.approx([r[key] for r in one], rel=1e-3,
                                                       abs=1e-6), key
    assert one[1]["kl"] > 0
    assert all(r["ratio_dev_first"] < 1e-5 for r in four)
