"""FlowGRPO and DDRL end to end on tiny pipelines (CPU): learning, the first update's ratio,
exports that diffusers loads, LoRA, reference KL, resume, FSDP, conditioning frames."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import reasonctl
from reasonctl import hookimpl
from reasonctl.core.errors import ConfigError
from tests.diffusion_support import (  # noqa: F401
    launch_run,
    metrics,
    run_config,
    tiny_pipelines,
    write_video_text,
)

REPO = Path(__file__).resolve().parents[1]


class Weights:
    """Captures the trained transformer's weights at the start and the end of a run."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}
        self.stop_at = stop_at

    @hookimpl
    def on_run_start(self, ctx: Any) -> None:
        self.start = _state(ctx)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGUSR1)

    @hookimpl
    def on_run_end(self, ctx: Any, status: str, error: BaseException | None) -> None:
        self.end = _state(ctx)


def _state(ctx: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ctx.backend.hf_model.state_dict().items()}


@pytest.mark.slow
def test_quickstart_reward_rises_and_the_export_loads_in_diffusers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import DiffusionPipeline

    monkeypatch.chdir(REPO)
    out = tmp_path / "quickstart"
    config = reasonctl.load_config(
        REPO / "examples/configs/quickstart_flow_grpo.toml",
        overrides=[f"run.output_dir={json.dumps(str(out))}", "train.max_steps=12",
                   "eval.every_steps=12", "checkpoint.every_steps=0",
                   'logging.loggers=["jsonl"]', "logging.plot=false"])
    weights = Weights()
    result = reasonctl.run(config, plugins=[weights])
    assert result.status == "completed"
    rows = metrics(out)
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.03, [round(r["reward/mean"], 4) for r in rows]
    assert all(r["ratio_dev_first"] < 1e-5 for r in rows)
    assert rows[-1]["eval/reward/mean"] > 0 and (out / "eval" / "step_12.png").is_file()
    for key in ("reward/std", "clip_frac", "approx_kl", "ratio", "advantage/abs_mean"):
        assert key in rows[-1]
    pipe = DiffusionPipeline.from_pretrained(out / "export" / "final")
    exported = pipe.transformer.state_dict()
    assert exported.keys() == weights.end.keys()
    for name, value in weights.end.items():
        assert torch.equal(exported[name], value), name
    assert any(not torch.equal(weights.start[k], weights.end[k]) for k in weights.end)


def test_video_model_first_ratio_is_one_and_kl_starts_at_zero(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    config = run_config(tmp_path, tiny_pipelines["wan"], frames=5, steps=2, kl_beta=0.5,
                        guidance_scale=2.0, negative_prompt="dark")
    config["model"]["gradient_checkpointing"] = "auto"
    reasonctl.run(config)
    rows = metrics(tmp_path)
    assert all(row["ratio_dev_first"] < 1e-5 for row in rows)
    assert all(row["update/checkpointed_blocks"] == 0 for row in rows)  # CPU: keep all
    assert rows[0]["kl"] < 1e-6  # the first pass scores with the reference's own weights
    assert rows[-1]["kl"] > 0.0


def test_lora_trains_adapters_only_and_its_export_loads_with_load_lora_weights(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from diffusers import DiffusionPipeline
    from torch.distributed.checkpoint import FileSystemReader

    model = tiny_pipelines["sd3"]
    config = run_config(tmp_path, model, steps=2, kl_beta=0.1,
                        lora={"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_v"],
                              "init": "gaussian", "export": "adapter"})
    config["train"]["lr"] = 5e-2
    config["checkpoint"] = {"every_steps": 2, "export_final": True}
    weights = Weights()
    reasonctl.run(config, plugins=[weights])
    changed = {k for k in weights.end if not torch.equal(weights.start[k], weights.end[k])}
    assert changed and all("lora_B" in k or "lora_A" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    stored = FileSystemReader(str(tmp_path / "checkpoints" / "step_2" / "state"))
    saved = {k.removeprefix("model.") for k in stored.read_metadata().state_dict_metadata
             if k.startswith("model.")}
    assert saved == {k for k in weights.end if ".lora_" in k}
    rows = metrics(tmp_path)
    assert rows[0]["kl"] < 1e-6 and rows[0]["ratio_dev_first"] < 1e-5
    export = tmp_path / "export" / "final"
    assert (export / "pytorch_lora_weights.safetensors").is_file()
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.load_lora_weights(export)
    torch.manual_seed(0)
    x = torch.randn(1, 4, 4, 4)
    text, pooled = torch.randn(1, 5, 64), torch.randn(1, 64)
    with torch.no_grad():
        theirs = pipe.transformer(x, text, pooled, torch.tensor([500.0]), return_dict=False)[0]
        ours = _with_state(model, weights.end, x, text, pooled)
    assert torch.allclose(theirs, ours, atol=1e-5)


def test_lora_merged_export_is_a_pipeline_that_computes_like_the_adapted_model(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from diffusers import DiffusionPipeline

    model = tiny_pipelines["sd3"]
    lora = {"rank": 4, "alpha": 8, "target_modules": "attention"}
    config = run_config(tmp_path, model, steps=1, lora=lora)
    config["train"]["lr"] = 5e-2
    config["checkpoint"] = {"export_final": True}
    weights = Weights()
    reasonctl.run(config, plugins=[weights])
    export = tmp_path / "export" / "final"
    assert not (export / "pytorch_lora_weights.safetensors").exists()
    pipe = DiffusionPipeline.from_pretrained(export)
    base = DiffusionPipeline.from_pretrained(model).transformer.state_dict()
    merged = pipe.transformer.state_dict()
    assert merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(".attn." in k and k.endswith(".weight") for k in changed)
    torch.manual_seed(0)
    x = torch.randn(1, 4, 4, 4)
    text, pooled = torch.randn(1, 5, 64), torch.randn(1, 64)
    with torch.no_grad():
        theirs = pipe.transformer(x, text, pooled, torch.tensor([500.0]), return_dict=False)[0]
        ours = _with_state(model, weights.end, x, text, pooled, lora=lora)
    assert torch.allclose(theirs, ours, atol=1e-5)


def test_lora_presets_name_the_blocks_attention_and_feed_forward_layers(
        tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from reasonctl.core.config import LoraSection
    from reasonctl.diffusion.policy import load_transformer, resolve_diffusion_lora_targets

    for family, attention, mlp in (
            ("sd3", {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                     "add_v_proj", "to_add_out"}, {"ff.net.0.proj", "ff.net.2",
                                                   "ff_context.net.0.proj",
                                                   "ff_context.net.2"}),
            ("wan", {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"},
             {"ffn.net.0.proj", "ffn.net.2"}),
            ("cosmos", {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"},
             {"ff.net.0.proj", "ff.net.2"})):
        module = load_transformer(tiny_pipelines[family], dtype=torch.float32, device="cpu")

        def targets(preset: str, module: Any = module) -> set[str]:
            names = resolve_diffusion_lora_targets(module, LoraSection(target_modules=preset))
            return {n.split(".", 2)[2] for n in names}  # without "<blocks>.<i>."

        assert {t.removeprefix("attn.") for t in targets("attention")} == attention, family
        assert targets("mlp") == mlp, family
        assert targets("all-linear") == targets("attention") | targets("mlp"), family
    with pytest.raises(Exception, match="'to_nothing' matches no linear module"):
        resolve_diffusion_lora_targets(module, LoraSection(target_modules=["to_nothing"]))


def _with_state(model_dir: Path, state: dict[str, torch.Tensor], *args: Any,
                lora: dict[str, Any] | None = None) -> torch.Tensor:
    from reasonctl.core.config import LoraSection
    from reasonctl.diffusion.policy import attach_lora, load_transformer

    module = load_transformer(model_dir, dtype=torch.float32, device="cpu")
    section = LoraSection(**(lora or {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_v"]}))
    attach_lora(module, section, seed=0, trainable_dtype=torch.float32)
    module.load_state_dict(state)
    x, text, pooled = args
    return module(x, text, pooled, torch.tensor([500.0]), return_dict=False)[0]


def test_ddrl_data_loss_falls_on_data_the_reward_agrees_with(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    data = write_video_text(tmp_path / "data", {f"c{i}": f"a bright scene {i}"
                                                for i in range(4)}, value=235)
    config = run_config(tmp_path / "run", tiny_pipelines["sd3"], algorithm="ddrl", steps=8,
                        data_beta=1.0, exp_reward=True)
    config["data"] = {"format": "video_text", "video_text": {"root": str(data)}}
    config["train"]["lr"] = 1e-2
    reasonctl.run(config)
    rows = metrics(tmp_path / "run")
    losses = [r["data_loss"] for r in rows]
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    assert all(r["ratio_dev_first"] < 1e-5 for r in rows)


def test_resume_after_a_signal_equals_the_uninterrupted_run(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    def config(out: Path, **run: Any) -> dict[str, Any]:
        values = run_config(out, tiny_pipelines["wan"], frames=5, steps=3,
                            train_step_choice="random", shared_noise=True, mini_batches=2)
        values["run"].update(run)
        values["checkpoint"] = {"every_steps": 1, "keep": 1, "export_final": False}
        values["train"]["schedule"] = "cosine"
        return values

    full = Weights()
    reasonctl.run(config(tmp_path / "full"), plugins=[full])
    stopped = Weights(stop_at=2)
    result = reasonctl.run(config(tmp_path / "part"), plugins=[stopped])
    assert result.status == "interrupted" and result.steps == 2
    resumed = Weights()
    result = reasonctl.run(config(tmp_path / "part", resume=True), plugins=[resumed])
    assert result.status == "completed" and result.steps == 3
    for name, value in full.end.items():
        assert torch.equal(resumed.end[name], value), name
    expected, got = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(r["update/optimizer_steps"] == 2.0 and r["ratio_dev_first"] < 1e-5 for r in got)
    for key in ("reward/mean", "loss", "grad_norm"):
        assert [r[key] for r in got] == [r[key] for r in expected], key


def test_one_process_fsdp_equals_the_single_backend(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    rows = {}
    for backend in ("single", "fsdp"):
        config = run_config(tmp_path / backend, tiny_pipelines["sd3"], steps=2, kl_beta=0.1)
        config["backend"]["name"] = backend
        reasonctl.run(config)
        rows[backend] = metrics(tmp_path / backend)
    for key in ("reward/mean", "loss", "kl"):
        assert [r[key] for r in rows["fsdp"]] == pytest.approx(
            [r[key] for r in rows["single"]], rel=1e-4, abs=1e-7), key


def test_cosmos_video_to_world_trains_with_conditioning_frames(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    import numpy as np

    seen: list[tuple[tuple[int, ...], Any]] = []

    def redness(completions: list[Any], samples: list[Any]) -> list[float]:
        """An SDK reward: a plain function of the decoded clips."""
        seen.extend((c.shape, c.dtype) for c in completions)
        return [float(np.asarray(c)[..., 0].mean()) / 255 for c in completions]

    config = run_config(tmp_path, tiny_pipelines["cosmos"], frames=9, steps=1,
                        conditional_frames=1)
    config["data"]["mock_media"]["media"] = True
    reasonctl.run(config, rewards=[redness])
    row = metrics(tmp_path)[0]
    assert row["ratio_dev_first"] < 1e-5 and row["reward/mean"] > 0
    assert "reward/redness/mean" in row and "reward/brightness/mean" in row
    assert seen == [((9, 32, 32, 3), np.dtype("uint8"))] * 4


def test_configuration_mistakes_are_named(tmp_path: Path,
                                          tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    config = run_config(tmp_path, tiny_pipelines["wan"], frames=4, size=24)
    with pytest.raises(ConfigError) as error:
        reasonctl.run(config)
    text = str(error.value)
    assert "algorithm.flow_grpo.frames: 4 is not 4k + 1" in text
    assert "algorithm.flow_grpo.height: 24 is not a positive multiple of 16" in text
    config = run_config(tmp_path, tiny_pipelines["sd3"])
    config["rewards"] = {"components": [{"name": "brightness"}, {"name": "exact_match"}]}
    with pytest.raises(ConfigError, match="exact_match score\\(s\\) text"):
        reasonctl.run(config)
    with pytest.raises(Exception, match="train_steps: \\[9\\] outside 0..3"):
        reasonctl.run(run_config(tmp_path, tiny_pipelines["sd3"], train_steps=[1, 9]))
    config = run_config(tmp_path, tiny_pipelines["sd3"],
                        lora={"include_vision": True, "modules_to_save": ["proj_out"]})
    with pytest.raises(ConfigError) as error:
        reasonctl.run(config)
    assert "model.lora.include_vision: a diffusion transformer has no vision" in str(error.value)
    assert "model.lora.modules_to_save: not supported" in str(error.value)
    config = run_config(tmp_path, tiny_pipelines["sd3"])
    config["algorithm"]["flow_grpo"]["lora"] = {"rank": 4}  # LoRA is [model.lora]
    with pytest.raises(ConfigError, match="algorithm.flow_grpo.lora"):
        reasonctl.run(config)


KILLED_RUN = """
import json, sys, time
import reasonctl
from reasonctl import hookimpl

class Slow:
    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        time.sleep(1.0)

reasonctl.run(json.loads(sys.argv[1]), plugins=[Slow()])
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    def config(out: Path, **run: Any) -> dict[str, Any]:
        values = run_config(out, tiny_pipelines["sd3"], steps=4,
                            lora={"rank": 4, "alpha": 4, "export": "adapter"}, kl_beta=0.1)
        values["run"].update(run)
        values["checkpoint"] = {"every_steps": 1, "keep": 2, "export_final": True}
        return values

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed process: the same float summation order
    try:
        full = Weights()
        reasonctl.run(config(tmp_path / "full"), plugins=[full])
        resumed = _killed_and_resumed(tmp_path / "killed", config)
    finally:
        torch.set_num_threads(threads)
    for name, value in full.end.items():
        assert torch.equal(resumed.end[name], value), name
    expected = (tmp_path / "full" / "export" / "final" / "pytorch_lora_weights.safetensors")
    got = tmp_path / "killed" / "export" / "final" / "pytorch_lora_weights.safetensors"
    assert _safetensors(got) == _safetensors(expected)


def _safetensors(path: Path) -> tuple[dict[str, str], dict[str, bytes]]:
    """A safetensors file's metadata and tensor bytes (the header's key order varies)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k).numpy().tobytes() for k in handle.keys()}
        return dict(handle.metadata() or {}), tensors


def _killed_and_resumed(out: Path, config: Any) -> Weights:
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, json.dumps(config(out))],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = out / "checkpoints" / "step_2" / "manifest.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert checkpoint.exists(), proc.stderr.read().decode() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "export").exists()
    resumed = Weights()
    result = reasonctl.run(config(out, resume=True), plugins=[resumed])
    assert result.status == "completed" and result.steps == 4
    return resumed


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_fsdp_samples_and_learns_like_one_process(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    """Per-sample noise streams make the two ranks' share of the samples the single
    process's: rewards agree, and so do the updates (up to float summation order)."""


    single = run_config(tmp_path / "single", tiny_pipelines["sd3"], steps=2, kl_beta=0.1,
                        lora={"rank": 4, "alpha": 4})
    reasonctl.run(single)
    distributed = run_config(tmp_path / "fsdp", tiny_pipelines["sd3"], steps=2, kl_beta=0.1,
                             lora={"rank": 4, "alpha": 4, "export": "adapter"})
    distributed["backend"]["name"] = "fsdp"
    distributed["checkpoint"] = {"every_steps": 2, "export_final": True}
    launch_run(distributed, tmp_path / "fsdp.toml", 2)
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "fsdp")
    for key in ("reward/mean", "loss", "kl", "grad_norm"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-3,
                                                      abs=1e-6), key
    assert all(r["ratio_dev_first"] < 1e-5 for r in two)
    assert (tmp_path / "fsdp" / "export" / "final" / "pytorch_lora_weights.safetensors").is_file()
