"""LoRA (``[model.lora]``) on the tiny models: SFT and GRPO train only the adapters, the
loss falls and the reward rises, resume is exact, both export forms reload with the
trained logits, the KL reference is the base model and engines get only merged layers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import reasonctl
from reasonctl import hookimpl
from reasonctl.core.types import ContentPart, Message, Sample

pytest.importorskip("peft", reason="LoRA needs the 'lora' extra (peft)")

PROBE = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70], [257, 1, 2, 3, 4, 5, 6, 7]])
LORA = {"rank": 4, "alpha": 8.0, "modules_to_save": ["embed_tokens"]}


def chat(question: str, answer: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=question)]),
                   Message("assistant", [ContentPart("text", text=answer)])])


SAMPLES = [chat(f"{i} times two?", f"<answer>{2 * i}</answer>") for i in range(8)]


class Recorder:
    """Keeps each step's metrics and, at the end, the trained model's logits and state."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append(dict(metrics))

    @hookimpl
    def on_run_end(self, ctx: Any, status: str, error: Any) -> None:
        from torch.distributed.tensor import DTensor

        backend = ctx.backend
        if ctx.config.backend.name == "single":
            with torch.no_grad(), backend.autocast():
                self.logits = backend.hf_model(input_ids=PROBE).logits.float()
        named = backend.hf_model.named_parameters(remove_duplicate=False)
        self.params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in named}
        self.trainable = {n for n, p in backend.hf_model.named_parameters(remove_duplicate=False)
                          if p.requires_grad}

    def series(self, key: str) -> list[float]:
        return [m[key] for m in self.metrics]


def sft_config(out: Path, model_dir: Path, *, lora: dict[str, Any] | None = None,
               **train: Any) -> dict[str, Any]:
    return {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "lora": {**LORA, **(lora or {})}},
        "train": {"lr": 2e-2, "max_steps": 6, "global_batch_size": 4, "micro_batch_size": 2,
                  **train},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"every_steps": 3},
        "logging": {"loggers": []},
    }


def source_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
            ) -> tuple[Path, Recorder]:
    """Six LoRA SFT steps (adapters + a trained embedding), checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("lora-sft")
    recorder = Recorder()
    result = reasonctl.run(sft_config(out, tiny_model_dir), datasets=SAMPLES,
                           plugins=[recorder])
    assert result.status == "completed" and result.export_dir is not None
    return out, recorder


def test_sft_trains_only_the_adapters_and_the_loss_falls(sft_run: tuple[Path, Recorder],
                                                         tiny_model_dir: Path) -> None:
    out, recorder = sft_run
    losses = recorder.series("loss")
    assert losses[-1] < 0.7 * losses[0]
    assert recorder.trainable and all(
        ".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n
        for n in recorder.trainable)
    assert any(".embed_tokens.modules_to_save." in n for n in recorder.trainable)
    source = source_weights(tiny_model_dir)
    frozen = 0
    for name, param in recorder.params.items():
        plain = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        if name in recorder.trainable or plain not in source:
            continue
        assert torch.equal(param, source[plain]), name  # the base never moves
        frozen += 1
    assert frozen == len(source)


def test_checkpoints_hold_only_the_trainable_state(sft_run: tuple[Path, Recorder]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    out, recorder = sft_run
    state = out / "checkpoints" / "step_6" / "state"
    keys = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    models = {k.removeprefix("model.hf_model.") for k in keys if k.startswith("model.")}
    assert models == recorder.trainable


def test_merged_export_reloads_with_the_trained_logits(sft_run: tuple[Path, Recorder]) -> None:
    from transformers import AutoModelForCausalLM

    out, recorder = sft_run
    export = out / "export" / "final"
    assert not (export / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=PROBE).logits, recorder.logits,
                                   atol=1e-4, rtol=1e-4)


def test_resume_is_exact_and_the_adapter_export_loads_with_peft(
        sft_run: tuple[Path, Recorder], tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, recorder = sft_run
    resumed = Recorder()
    config = sft_config(tmp_path, tiny_model_dir, lora={"export": "adapter"})
    config["run"]["resume"] = str(out / "checkpoints" / "step_3")
    result = reasonctl.run(config, datasets=SAMPLES, plugins=[resumed])
    assert result.status == "completed" and result.export_dir is not None
    assert resumed.series("loss") == pytest.approx(recorder.series("loss")[3:], rel=1e-5)
    for name in recorder.trainable:
        torch.testing.assert_close(resumed.params[name], recorder.params[name])

    adapter = result.export_dir
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == 4 and settings["base_model_name_or_path"] == str(
        tiny_model_dir.resolve())
    assert not list(adapter.glob("model*.safetensors"))  # no base weights in it
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                      adapter)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=PROBE).logits, recorder.logits,
                                   atol=1e-4, rtol=1e-4)


def lowercase_start(completion: str, sample: Sample) -> float:
    """1 when the completion starts with a lowercase letter (about 1 in 6 at first)."""
    return float(bool(completion) and completion[0].islower())


def grpo_config(out: Path, model_dir: Path, *, steps: int, backend: str = "single"
                ) -> dict[str, Any]:
    prompts = out.parent / f"{out.name}-prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": f"Say something, {i}."}) + "\n"
                               for i in range(8)))
    return {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "max_length": 64, "lora": dict(LORA)},
        "data": {"format": "jsonl", "jsonl": {"path": str(prompts)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 4, "kl_beta": 0.01}},
        "rollout": {"n": 8, "max_new_tokens": 1, "temperature": 1.0},
        "train": {"lr": 2e-2, "max_steps": steps, "micro_batch_size": 32},
        "backend": {"name": backend, "device": "cpu"},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": []},
    }


def test_grpo_learns_against_the_base_model_and_syncs_only_the_merged_layers(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    recorder = Recorder()
    result = reasonctl.run(grpo_config(tmp_path / "run", tiny_model_dir, steps=8),
                           rewards=[lowercase_start], plugins=[recorder])
    assert result.status == "completed"
    rewards = recorder.series("reward/mean")
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.3
    kl = recorder.series("kl")
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the reference is the base: B = 0 at first
    assert kl[-1] > 1e-3
    assert max(recorder.series("rollout/logprob_gap")) < 1e-3  # the engine got the merged layers
    # 2 layers x 7 adapted projections + the trained embedding and its tied head: no norms,
    # biases or other weights
    assert set(recorder.series("weight_sync/tensors")) == {16.0}
    assert len(source_weights(tiny_model_dir)) == 27
    assert all(".lora_" in n or ".modules_to_save." in n for n in recorder.trainable)


def test_one_process_fsdp_with_checkpointing_equals_single(tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    """GRPO with LoRA and a KL term: the FSDP-wrapped peft model (with gradient
    checkpointing) follows the single-device run step by step."""
    runs = {}
    for backend in ("single", "fsdp"):
        recorder = Recorder()
        config = grpo_config(tmp_path / backend, tiny_model_dir, steps=3, backend=backend)
        config["model"]["gradient_checkpointing"] = backend == "fsdp"
        reasonctl.run(config, rewards=[lowercase_start], plugins=[recorder])
        runs[backend] = recorder
    for key in ("loss", "kl", "reward/mean"):
        assert runs["fsdp"].series(key) == pytest.approx(runs["single"].series(key), rel=1e-4,
                                                         abs=1e-7)
    for name, param in runs["single"].params.items():
        torch.testing.assert_close(runs["fsdp"].params[name], param, rtol=1e-4, atol=1e-6)
