"""Checks of the diffusion path on a CUDA GPU: Cosmos-Predict2.5's adapter with its padding
mask (which needs torchvision, not installable beside the CPU torch of CI), bfloat16
rollouts whose first update re-scores them consistently, LoRA on FSDP, and two GPUs.

Run on a GPU machine (torchvision installed) from the repository root:

    python -m pytest --noconftest -q tests/cuda_checks_diffusion.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import reasonctl
from tests.diffusion_support import metrics, run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD3, Wan and Cosmos pipelines; Cosmos with the real padding-mask input."""
    from reasonctl.diffusion.tiny import make_tiny_pipeline_dir

    pytest.importorskip("torchvision")
    root = tmp_path_factory.mktemp("cuda_pipelines")
    return {
        "sd3": make_tiny_pipeline_dir(root / "sd3", "sd3"),
        "wan": make_tiny_pipeline_dir(root / "wan", "wan"),
        "cosmos": make_tiny_pipeline_dir(root / "cosmos", "cosmos", concat_padding_mask=True),
    }


def _cuda(config: dict[str, Any]) -> dict[str, Any]:
    config["backend"]["device"] = "cuda"
    config["model"]["dtype"] = "bfloat16"
    return config


def test_cosmos_padding_mask_conditioning_frames_and_bf16(pipelines: dict[str, Path]) -> None:
    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.policy import load_transformer
    from reasonctl.diffusion.sampler import SamplingPlan, draw, generators, sample
    from reasonctl.diffusion.sde import flow_schedule

    device = torch.device("cuda")
    adapter = adapter_for(pipelines["cosmos"])
    assert adapter.padding_mask
    model = load_transformer(pipelines["cosmos"], dtype=torch.float32, device=device)
    text = adapter.load_text_encoder(device, torch.float32, 8).encode(["a road", "a robot"])
    shape = adapter.latent_shape(9, 32, 32)
    gens = generators([1, 2], device)
    noise = draw(gens, shape, device)
    clean = torch.randn(2, *shape, device=device)
    frames = adapter.frame_condition(clean, 1, noise)
    sigma = torch.tensor([0.7, 0.3], device=device)
    full = adapter.velocity(model, noise, sigma, text, frames=frames)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        half = adapter.velocity(model, noise, sigma, text, frames=frames,
                                dtype=torch.bfloat16).float()
    assert torch.allclose(full[:, :, :1], (noise - clean)[:, :, :1], atol=1e-5)
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    plan = SamplingPlan(flow_schedule(4, adapter.shift()), 0.7, record=(0, 1, 2, 3))
    out = sample(model, adapter, plan, text=text, noise=noise, gens=gens, frames=frames)
    assert torch.allclose(out.latents[:, :, :1], clean[:, :, :1], atol=1e-5)
    assert torch.isfinite(out.log_probs).all()


@pytest.mark.parametrize("family", ["sd3", "wan", "cosmos"])
def test_bf16_runs_rescore_their_rollouts(family: str, pipelines: dict[str, Path],
                                          tmp_path: Path) -> None:
    frames = 1 if family == "sd3" else 9
    options: dict[str, Any] = {"kl_beta": 0.1}
    if family == "cosmos":
        options["conditional_frames"] = 1
    config = _cuda(run_config(tmp_path, pipelines[family], frames=frames, steps=2, **options))
    config["data"]["mock_media"]["media"] = True
    reasonctl.run(config)
    rows = metrics(tmp_path)
    print(family, [r["ratio_dev_first"] for r in rows])
    assert all(r["ratio_dev_first"] < 2e-2 for r in rows)
    assert rows[0]["kl"] < 1e-4 and all(r["peak_mem_gb"] > 0 for r in rows)


def test_auto_checkpointing_measures_the_blocks_and_keeps_them_when_memory_allows(
        pipelines: dict[str, Path], tmp_path: Path) -> None:
    from reasonctl.diffusion.checkpointing import measure, transformer_blocks
    from reasonctl.diffusion.policy import load_transformer

    device = torch.device("cuda")
    model = load_transformer(pipelines["wan"], dtype=torch.float32, device=device)
    blocks = transformer_blocks(model)

    def run(n: int) -> torch.Tensor:
        latents = torch.randn(n, 4, 3, 32, 32, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(hidden_states=latents, timestep=torch.full((n,), 500.0, device=device),
                         encoder_hidden_states=torch.randn(n, 8, 32, device=device),
                         return_dict=False)[0]

    profile = measure(model, blocks, run, device)
    print(profile)
    assert profile.blocks == len(blocks) > 0 and profile.per_block > 0
    assert 0 < profile.block_input < profile.per_block
    assert profile.need(0, 4) > profile.need(len(blocks), 4)  # checkpointing saves memory
    config = _cuda(run_config(tmp_path, pipelines["wan"], frames=9, steps=2))
    config["model"]["gradient_checkpointing"] = "auto"
    reasonctl.run(config)
    rows = metrics(tmp_path)
    assert all(r["update/checkpointed_blocks"] == 0 for r in rows)  # a tiny model fits
    assert all(r["ratio_dev_first"] < 2e-2 for r in rows)


def test_lora_on_one_process_fsdp_matches_single(pipelines: dict[str, Path],
                                                 tmp_path: Path) -> None:
    rows = {}
    for backend in ("single", "fsdp"):
        config = _cuda(run_config(tmp_path / backend, pipelines["wan"], frames=5, steps=2,
                                  lora={"rank": 4, "alpha": 4}))
        config["backend"]["name"] = backend
        config["model"]["gradient_checkpointing"] = True
        reasonctl.run(config)
        rows[backend] = metrics(tmp_path / backend)
    assert [r["reward/mean"] for r in rows["fsdp"]] == pytest.approx(
        [r["reward/mean"] for r in rows["single"]], rel=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_fsdp_cosmos_video_to_world(pipelines: dict[str, Path], tmp_path: Path) -> None:
    import tomli_w

    config = _cuda(run_config(tmp_path / "run", pipelines["cosmos"], frames=9, steps=2,
                              conditional_frames=1))
    config["backend"]["name"] = "fsdp"
    config["data"]["mock_media"]["media"] = True
    config["checkpoint"] = {"every_steps": 2, "export_final": True}
    path = tmp_path / "cosmos.toml"
    path.write_text(tomli_w.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--nproc-per-node", "2",
                           "--config", str(path)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "run" / "export" / "final" / "model_index.json").is_file()
