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
        config = grpo_config(tmp_path / backend, tiny_model_dir, steps=2, backend=backend)
        config["model"]["gradient_checkpointing"] = backend == "fsdp"
        reasonctl.run(config, rewards=[lowercase_start], plugins=[recorder])
        runs[backend] = recorder
    for key in ("loss", "kl", "reward/mean"):
        assert runs["fsdp"].series(key) == pytest.approx(runs["single"].series(key), rel=1e-4,
                                                         abs=1e-7)
    for name, param in runs["single"].params.items():
        torch.testing.assert_close(runs["fsdp"].params[name], param, rtol=1e-4, atol=1e-6)


def test_targets_from_presets_names_and_regexes_with_errors_that_list_modules() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from reasonctl.core.config import LoraSection
    from reasonctl.models.loading import ModelLoadError
    from reasonctl.models.lora import resolve_lora_targets, resolve_modules_to_save
    from reasonctl.testing import build_tiny_tokenizer, tiny_qwen2_config

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(build_tiny_tokenizer())))
    attention = resolve_lora_targets(model, LoraSection(target_modules="attention"))
    assert len(attention) == 8 and all(n.split(".")[-1][0] in "qkvo" for n in attention)
    assert len(resolve_lora_targets(model, LoraSection())) == 14  # all-linear, no lm_head
    mixed = LoraSection(target_modules=["self_attn.q_proj", r"layers\.1\.mlp\.(up|down)_proj$"])
    assert resolve_lora_targets(model, mixed) == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ModelLoadError, match=r"'qproj' matches no linear module.*q_proj"):
        resolve_lora_targets(model, LoraSection(target_modules=["qproj"]))
    with pytest.raises(ModelLoadError, match="'embedding' matches no module"):
        resolve_modules_to_save(model, ["embedding"])
    llama = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ModelLoadError, match="model type 'llama'.*List the modules"):
        resolve_lora_targets(llama, LoraSection())
    assert len(resolve_lora_targets(llama, LoraSection(target_modules=["q_proj"]))) == 1


def test_vision_tower_is_left_alone_unless_asked(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from reasonctl.core.config import LoraSection
    from reasonctl.models.loading import ModelLoadError
    from reasonctl.models.lora import resolve_lora_targets
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    model = AutoModelForImageTextToText.from_pretrained(
        make_tiny_qwen2_5_vl_dir(tmp_path / "vl", seed=0))
    language = resolve_lora_targets(model, LoraSection())
    assert language and all(n.startswith("model.language_model.layers.") for n in language)
    with pytest.raises(ModelLoadError, match="include_vision = true"):
        resolve_lora_targets(model, LoraSection(target_modules=["qkv"]))
    both = resolve_lora_targets(model, LoraSection(include_vision=True))
    tower = [n for n in both if n.startswith("model.visual.")]
    assert tower and set(both) - set(tower) == set(language)
    assert not any(".merger." in n for n in tower)  # the projector into the LM stays frozen


def test_vision_language_lora_sft_keeps_the_tower_and_exports_merged(tmp_path: Path) -> None:
    from data_factories import write_png
    from transformers import AutoModelForImageTextToText

    from reasonctl.data.collate import collate
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    model_dir = make_tiny_qwen2_5_vl_dir(tmp_path / "tiny-vl", seed=0)
    image = write_png(tmp_path / "img.png", (56, 56))
    samples = [Sample([Message("user", [ContentPart("image", path=str(image)),
                                        ContentPart("text", text=f"What is shown, {i}?")]),
                       Message("assistant", [ContentPart("text", text=f"<answer>{i}</answer>")])])
               for i in range(4)]

    class Final(Recorder):
        @hookimpl
        def on_run_end(self, ctx: Any, status: str, error: Any) -> None:
            super().on_run_end(ctx, status, error)
            self.batch = collate([ctx.processor.encode_sft(s) for s in samples],
                                 ctx.processor.pad_id)
            self.logprobs = ctx.backend.token_outputs(self.batch).logprobs

    final = Final()
    config = {
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"name_or_path": str(model_dir), "max_length": 512, "lora": {"rank": 4}},
        "train": {"lr": 2e-2, "max_steps": 4, "global_batch_size": 2},
        "backend": {"name": "single", "device": "cpu"},
        "logging": {"loggers": []},
    }
    result = reasonctl.run(config, datasets=samples, plugins=[final])
    assert result.status == "completed" and result.export_dir is not None
    losses = final.series("loss")
    assert losses[-1] < losses[0]
    assert final.trainable and all(".language_model." in n for n in final.trainable)

    exported = AutoModelForImageTextToText.from_pretrained(result.export_dir)
    source = AutoModelForImageTextToText.from_pretrained(model_dir)
    exported_params = dict(exported.named_parameters())
    for name, param in source.named_parameters():
        adapted = ".language_model." in name and name.endswith("proj.weight")
        assert torch.equal(param, exported_params[name]) != adapted, name
    inputs = {k: v for k, v in final.batch.items() if k != "loss_mask"}
    with torch.no_grad():
        logits = exported(**inputs, use_cache=False).logits[:, :-1].float()
    want = torch.log_softmax(logits, -1).gather(
        -1, final.batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    valid = final.batch["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(final.logprobs[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_config_names_every_bad_lora_key() -> None:
    with pytest.raises(reasonctl.ConfigError) as caught:
        reasonctl.load_config(values={"model": {"freeze": ["x"], "lora": {
            "rank": 0, "dropout": 1.0, "target_modules": ["a["], "modules_to_save": ["a b"],
            "export": "gguf", "alpah": 8}}})
    text = str(caught.value)
    for key in ("model.lora.rank", "model.lora.dropout", "model.lora.target_modules",
                "model.lora.modules_to_save", "model.lora.export",
                "model.lora.alpah: unknown key; did you mean 'alpha'?"):
        assert key in text, key
    with pytest.raises(reasonctl.ConfigError, match="cannot be combined with"):
        reasonctl.load_config(values={"model": {"trainable": ["x"], "lora": {}}})


@pytest.mark.slow
def test_train_compile_follows_the_eager_run(tmp_path: Path, tiny_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.compile`` traces the peft layers inside each block (dynamo + AOT autograd;
    the ``aot_eager`` backend keeps CPU code generation out of the test's time)."""
    import functools

    compiled_functions: list[Any] = []
    real_compile = torch.compile

    def aot_eager_compile(fn: Any, **options: Any) -> Any:
        compiled_functions.append(fn)
        return real_compile(fn, backend="aot_eager", **options)

    monkeypatch.setattr(torch, "compile", functools.partial(aot_eager_compile))
    runs = {}
    for compiled in (False, True):
        recorder = Recorder()
        config = sft_config(tmp_path / str(compiled), tiny_model_dir, max_steps=3,
                            compile=compiled)
        config["checkpoint"] = {"export_final": False}
        reasonctl.run(config, datasets=SAMPLES, plugins=[recorder])
        runs[compiled] = recorder.series("loss")
    assert compiled_functions  # train.compile was not ignored
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_fsdp_processes_equal_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    """LoRA SFT through ``reasonctl run --backend fsdp --nproc-per-node 2``: the losses
    and the merged export equal a single-device run's."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"{i} times two?"},
        {"role": "assistant", "content": f"<answer>{2 * i}</answer>"}]}) + "\n"
        for i in range(8)))
    config = tmp_path / "lora.toml"
    config.write_text(f"""
[run]
seed = 0
[model]
name_or_path = "{tiny_model_dir}"
[model.lora]
rank = 4
alpha = 8.0
modules_to_save = ["embed_tokens"]
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[train]
lr = 2e-2
max_steps = 4
global_batch_size = 4
micro_batch_size = 1
[backend]
device = "cpu"
[logging]
loggers = ["jsonl"]
plot = false
""")
    outputs = {}
    for name, extra in (("single", ["--backend", "single"]),
                        ("fsdp2", ["--backend", "fsdp", "--nproc-per-node", "2"])):
        outputs[name] = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "reasonctl", "run", "--config", str(config),
             "--output-dir", str(outputs[name]), *extra],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
            timeout=420)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    def losses(out: Path) -> list[float]:
        rows = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(row)["loss"] for row in rows if '"loss"' in row]

    def weights(out: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in (out / "export" / "final").glob("*.safetensors")
                for k, v in load_file(f).items()}

    assert losses(outputs["fsdp2"]) == pytest.approx(losses(outputs["single"]), rel=1e-4)
    single, sharded = weights(outputs["single"]), weights(outputs["fsdp2"])
    assert single.keys() == sharded.keys() and not any("lora" in k for k in single)
    for key, tensor in single.items():
        torch.testing.assert_close(sharded[key], tensor, rtol=1e-4, atol=1e-5)


def test_without_peft_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from transformers import AutoModelForCausalLM

    from reasonctl.core.config import LoraSection
    from reasonctl.models.lora import apply_lora
    from reasonctl.testing import build_tiny_tokenizer, tiny_qwen2_config

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(len(build_tiny_tokenizer())))
    with pytest.raises(reasonctl.MissingDependencyError, match=r"pip install -e .*\[lora\]"):
        apply_lora(model, LoraSection())
