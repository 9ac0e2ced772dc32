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
        backend = ctx.backend
        with torch.no_grad(), backend.autocast():
            self.logits = backend.hf_model(input_ids=PROBE).logits.float()
        self.params = {n: p.detach().clone()
                       for n, p in backend.hf_model.named_parameters(remove_duplicate=False)}
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
