"""Exports are Hugging Face directories that reload in transformers with the trained logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reasonctl.core.config import load_config
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.runtime.runner import run


def chat(question: str, answer: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=question)]),
                   Message("assistant", [ContentPart("text", text=answer)])])


class KeepFinalModel:
    """Records the trained model's logits and weights when the run ends."""

    @hookimpl
    def on_run_end(self, ctx: Any, status: str, error: Any) -> None:
        model = ctx.backend.hf_model
        with torch.no_grad():
            self.logits = model(input_ids=PROBE).logits
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.full_state = {n: t.clone() for n, t in ctx.backend.full_state_dict()}


PROBE = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70], [257, 1, 2, 3, 4, 5, 6, 7]])


def train_and_export(
    tmp_path: Path, model_dir: Path, *overrides: str
) -> tuple[Path, KeepFinalModel]:
    samples = [chat(f"{i} times two?", f"<answer>{2 * i}</answer>") for i in range(8)]

    class Data:
        @hookimpl
        def register_datasets(self, register: Any) -> None:
            from reasonctl.data.datasets import as_dataset

            register("probe-data", lambda _cfg, **_: as_dataset(samples))

    keeper = KeepFinalModel()
    host = PluginHost.load()
    host.add_plugin(Data(), name="probe-data")
    host.add_plugin(keeper, name="keeper")
    config = load_config(overrides=[
        f"run.output_dir={tmp_path}", f"model.name_or_path={model_dir}",
        "data.format=probe-data", "logging.loggers=[]", "backend.device=cpu",
        "train.max_steps=3", "train.global_batch_size=4", "train.lr=1e-2", *overrides,
    ], registry=host.registry)
    result = run(config, host=host)
    assert result.status == "completed" and result.export_dir is not None
    return result.export_dir, keeper


def test_export_reloads_with_matching_logits(tmp_path: Path, tiny_model_dir: Path) -> None:
    export, keeper = train_and_export(tmp_path, tiny_model_dir)
    assert export == tmp_path / "export" / "final"
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "model.safetensors"):
        assert (export / name).is_file(), name
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        logits = reloaded(input_ids=PROBE).logits
    torch.testing.assert_close(logits, keeper.logits, atol=1e-5, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=PROBE).logits, logits, atol=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_sharded_bfloat16_export_has_an_index(tmp_path: Path, tiny_model_dir: Path) -> None:
    export, keeper = train_and_export(tmp_path, tiny_model_dir,
                                      "backend.single.export_shard_size=100KB",
                                      "checkpoint.export_dtype=bfloat16")
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((export / s).is_file() for s in shards)
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    assert reloaded.dtype == torch.bfloat16
    live = keeper.params
    for name, param in reloaded.named_parameters():
        torch.testing.assert_close(param, live[name].detach().to(torch.bfloat16))


def test_full_state_dict_yields_hf_names(tmp_path: Path, tiny_model_dir: Path) -> None:
    _, keeper = train_and_export(tmp_path, tiny_model_dir, "train.max_steps=1")
    names = keeper.full_state
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(fresh.state_dict()) == set(names)
    fresh.load_state_dict(names)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=PROBE).logits, keeper.logits)


def test_vision_language_sft_with_frozen_tower_exports_and_reloads(tmp_path: Path) -> None:
    pytest.importorskip("av", reason="video decoding needs the 'video' extra (PyAV)")
    from data_factories import write_png, write_tiny_mp4
    from transformers import AutoModelForImageTextToText

    from reasonctl.data.collate import collate
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir
    from reasonctl.sdk.api import run as sdk_run

    model_dir = make_tiny_qwen2_5_vl_dir(tmp_path / "tiny-vl", seed=0)
    image = write_png(tmp_path / "img.png", (56, 56))
    video = write_tiny_mp4(tmp_path / "clip.mp4", frames=8, fps=4, size=(32, 32))

    def media(kind: str, path: Path, answer: str, **settings: Any) -> Sample:
        return Sample([Message("user", [ContentPart(kind, path=str(path), **settings),
                                        ContentPart("text", text="What is shown?")]),
                       Message("assistant", [ContentPart("text", text=answer)])])

    samples = [media("image", image, "<answer>noise</answer>"),
               media("video", video, "<answer>a fading clip</answer>", fps=2)]

    class Final:
        @hookimpl
        def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
            self.losses = [*getattr(self, "losses", []), metrics["loss"]]

        @hookimpl
        def on_run_end(self, ctx: Any, status: str, error: Any) -> None:
            self.batch = collate([ctx.processor.encode_sft(s) for s in samples],
                                 ctx.processor.pad_id)
            self.logprobs = ctx.backend.token_outputs(self.batch).logprobs

    final = Final()
    config = {
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"name_or_path": str(model_dir), "freeze": [r"^model\.visual\."],
                  "max_length": 512},
        "train": {"lr": 1e-2, "max_steps": 8, "global_batch_size": 2},
        "backend": {"name": "single", "device": "cpu"},
        "logging": {"loggers": []},
    }
    result = sdk_run(config, datasets=samples, plugins=[final])
    assert result.status == "completed" and result.export_dir is not None
    assert final.losses[-1] < 0.5 * final.losses[0]
    assert (result.export_dir / "preprocessor_config.json").is_file()

    exported = AutoModelForImageTextToText.from_pretrained(result.export_dir)
    source = AutoModelForImageTextToText.from_pretrained(model_dir)
    exported_params = dict(exported.named_parameters())
    for name, param in source.named_parameters():
        same = torch.equal(param, exported_params[name])
        assert same == name.startswith("model.visual."), name
    inputs = {k: v for k, v in final.batch.items() if k != "loss_mask"}
    with torch.no_grad():
        logits = exported(**inputs, use_cache=False).logits[:, :-1].float()
    want = torch.log_softmax(logits, -1).gather(
        -1, final.batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    valid = final.batch["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(final.logprobs[valid], want[valid], atol=1e-5, rtol=1e-5)
    ChatProcessor.from_pretrained(result.export_dir, max_length=64)  # processor files travel


def test_infer_without_a_config_generates_as_the_run_s_rollouts(tmp_path: Path,
                                                                 tiny_model_dir: Path) -> None:
    import tomllib

    from transformers import GenerationConfig
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.core.types import SamplingParams
    from reasonctl.evaluation.standalone import load_engine

    export, _ = train_and_export(
        tmp_path, tiny_model_dir, "rollout.max_new_tokens=5", "rollout.stop=['1', '</a>']",
        "rollout.temperature=0.7", "data.system_prompt='Answer with a number.'")
    tokenizer = AutoTokenizer.from_pretrained(export)
    (one,) = tokenizer.encode("1", add_special_tokens=False)
    generation = GenerationConfig.from_pretrained(export)  # transformers reads the run's rollout
    assert set(generation.eos_token_id) == {tokenizer.eos_token_id, one}
    assert (generation.max_new_tokens, generation.do_sample, generation.temperature,
            generation.top_k) == (5, True, 0.7, 0)
    settings = tomllib.loads((export / "reasonctl_generation.toml").read_text())
    assert settings["rollout"]["stop"] == ["1", "</a>"]

    host = PluginHost.load()
    app = build_app(host)
    answer = CliRunner().invoke(app, ["infer", "--model", str(export), "--prompt", "3 times two?"])
    assert answer.exit_code == 0, answer.output
    engine, processor = load_engine(str(export), load_config(registry=host.registry),
                                    host.registry)
    prompt = processor.encode_prompt(Sample([
        Message("system", [ContentPart("text", text="Answer with a number.")]),
        Message("user", [ContentPart("text", text="3 times two?")])]))
    (expected,) = engine.generate([prompt.as_prompt()], SamplingParams(
        temperature=0.0, max_new_tokens=5, stop=["1", "</a>"]))[0]
    assert answer.stdout == expected.text + "\n"  # greedy, as reasonctl eval answers

    # a settings file holding more than generation settings is refused, naming the keys
    with (export / "reasonctl_generation.toml").open("a") as file:
        file.write('[[rewards.components]]\nname = "os:system"\n')
    refused = CliRunner().invoke(app, ["infer", "--model", str(export), "--prompt", "x"])
    assert refused.exit_code == 2
    assert "rewards.components" in " ".join(refused.output.split())
