"""Context parallelism on CPU (gloo): sequences split over 2 and 4 processes give the log-probs,
entropy and weight gradients of the unsplit model (Qwen2 padded and packed rows, Qwen3, the
Qwen2.5-VL language tower with images, LoRA adapters on Qwen2), and the fsdp backend with
``cp = 2`` follows the single-process SFT and GRPO runs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from reasonctl.core.types import ContentPart, Message, Sample
from tests.gloo_workers import gloo_group, run_gloo_workers

TEMPERATURE = 0.7


def _load(model_dir: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    cls = (Qwen2_5_VLForConditionalGeneration if config.model_type == "qwen2_5_vl"
           else AutoModelForCausalLM)
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def _attach_lora(model: Any) -> None:
    """peft adapters (``[model.lora]``'s path) with nonzero B factors, so every factor
    gets a gradient; the base weights are frozen."""
    from reasonctl.backends.lora import LoraState
    from reasonctl.core.config import LoraSection

    LoraState.attach(model, LoraSection(rank=4, alpha=8), seed=3, trainable_dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def _outputs(model_dir: str, batch: dict[str, torch.Tensor], group: Any = None,
             lora: bool = False) -> dict[str, Any]:
    """Log-probs, entropy and the gradients of a loss using both (summed over ``group``);
    ``lora``: of the trainable parameters of a LoRA model."""
    import torch.distributed as dist

    from reasonctl.backends.context_parallel import enable_context_parallel
    from reasonctl.backends.token_logprobs import TokenLogprobModel

    torch.manual_seed(0)
    model = _load(model_dir)
    if lora:
        _attach_lora(model)
    policy = TokenLogprobModel(model, chunk_tokens=7)
    if group is not None:
        policy.context_parallel = enable_context_parallel(model, group)
    logprobs, entropy = policy(batch, True, TEMPERATURE)
    mask = batch["loss_mask"][:, 1:].float()
    ((logprobs - 0.1 * entropy) * mask).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if lora and not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    # a view would make FSDP2 warn that an in-place op on it skips its backward hook
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grads": grads,
            "views": [t._base is not None for t in (logprobs, entropy)]}


def _worker(rank: int, world: int, port: int, cases_path: str, result_path: str) -> None:
    import torch.distributed as dist

    with gloo_group(rank, world, port):
        cases = torch.load(cases_path, weights_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results: dict[str, Any] = {
                name: _outputs(case["model_dir"], case["batch"], dist.group.WORLD,
                               case.get("lora", False))
                for name, case in cases.items()}
        results["warnings"] = [str(w.message) for w in caught]
        if rank == 0:
            torch.save(results, result_path)


def _chat(prompt: str, answer: str, image: Path | None = None) -> Sample:
    parts = [ContentPart("image", path=str(image))] if image is not None else []
    user = Message("user", [*parts, ContentPart("text", text=prompt)])
    return Sample([user, Message("assistant", [ContentPart("text", text=answer)])])


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    from data_factories import write_png
    from transformers import Qwen3Config

    from reasonctl.data.collate import collate
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.models.tiny import build_tiny_tokenizer
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    root = tmp_path_factory.mktemp("cp-cases")
    tokenizer = build_tiny_tokenizer()
    qwen3_dir = root / "qwen3"
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(qwen3_dir)
    tokenizer.save_pretrained(qwen3_dir)
    vl_dir = make_tiny_qwen2_5_vl_dir(root / "vl", seed=0)

    text = [_chat("reverse abc", "<answer>cba</answer>"),
            _chat("count the letters of context", "<answer>7</answer>"),
            _chat("hi", "ok")]
    processor = ChatProcessor.from_pretrained(tiny_model_dir, max_length=256)
    encoded = [processor.encode_sft(s) for s in text]
    images = [_chat("which picture?", f"<answer>{i}</answer>",
                    write_png(root / f"{i}.png", (56, 56), seed=i)) for i in range(2)]
    vl = ChatProcessor.from_pretrained(vl_dir, max_length=512)
    vl_encoded = [vl.encode_sft(s) for s in images]
    return {
        "qwen2_padded": {"model_dir": str(tiny_model_dir), "batch": collate(encoded, 0)},
        "qwen2_packed": {"model_dir": str(tiny_model_dir),
                         "batch": collate(encoded, 0, pack=True)},
        "qwen2_lora": {"model_dir": str(tiny_model_dir), "batch": collate(encoded, 0),
                       "lora": True},
        "qwen3": {"model_dir": str(qwen3_dir), "batch": collate(encoded[:2], 0)},
        "qwen2_5_vl": {"model_dir": str(vl_dir), "batch": collate(vl_encoded, 0)},
        "qwen2_5_vl_packed": {"model_dir": str(vl_dir),
                              "batch": collate(vl_encoded, 0, pack=True)},
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_split_sequences_match_the_whole_model(world: int, cases: dict[str, Any],
                                               tmp_path: Path) -> None:
    cases_path, result_path = tmp_path / "cases.pt", tmp_path / "result.pt"
    torch.save(cases, cases_path)
    run_gloo_workers(_worker, world, str(cases_path), str(result_path))
    results = torch.load(result_path, weights_only=True)
    # the collectives are the current ones (a user sees no deprecation notice each step)
    assert not [w for w in results["warnings"] if "torch.distributed" in w], results["warnings"]
    for name, case in cases.items():
        want = _outputs(case["model_dir"], case["batch"], lora=case.get("lora", False))
        got = results[name]
        assert got["views"] == [False, False], name
        if case.get("lora"):
            assert want["grads"] and all("lora_" in p for p in want["grads"]), name
            assert all(g.abs().sum() > 0 for g in want["grads"].values()), name
        mask = case["batch"]["loss_mask"][:, 1:].bool()
        assert got["logprobs"].shape == want["logprobs"].shape, name
        torch.testing.assert_close(got["logprobs"][mask], want["logprobs"][mask],
                                   atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(got["entropy"][mask], want["entropy"][mask],
                                   atol=1e-5, rtol=1e-4, msg=name)
        assert got["grads"].keys() == want["grads"].keys()
        for param, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, atol=1e-5, rtol=1e-3,
                                       msg=f"{name}: {param}")


# --- the fsdp backend with cp = 2, through `reasonctl run` ---------------------------------------


def _run_in_process(config_file: Path, *overrides: str) -> Any:
    from reasonctl.core.config import load_config
    from reasonctl.core.plugins import PluginHost
    from reasonctl.runtime.runner import run

    host = PluginHost.load()
    result = run(load_config(config_file, list(overrides), registry=host.registry), host=host)
    assert result.status == "completed"
    return result


def _launch(config_file: Path, output_dir: Path, *extra: str, processes: int = 2) -> str:
    import subprocess
    import sys

    command = [sys.executable, "-m", "reasonctl", "run", "--backend", "fsdp",
               "--nproc-per-node", str(processes), "--config", str(config_file),
               "--output-dir", str(output_dir), *extra]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _losses(output_dir: Path) -> dict[int, float]:
    from reasonctl.loggers.metrics_file import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl")}


def _sft_config(root: Path, model_dir: Path) -> Path:
    import json

    words = ("context", "parallel", "sequence", "attention", "gather", "shard", "ring", "chunk")
    rows = [{"messages": [
        {"role": "user", "content": f"Spell '{w}' backwards, then repeat it twice: "},
        {"role": "assistant", "content": f"<answer>{w[::-1]} {w[::-1]} {w[::-1]}</answer>"}]}
        for w in words]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "sft.toml"
    config.write_text(f"""
[run]
seed = 5
[model]
name_or_path = "{model_dir}"
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[train]
lr = 5e-3
max_steps = 4
global_batch_size = 4
micro_batch_size = 2
[backend]
device = "cpu"
[checkpoint]
every_steps = 2
[logging]
loggers = ["jsonl"]
plot = false
""")
    return config


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_with_cp_pair_matches_one_process_and_resumes_in_one(tmp_path: Path,
                                                                 tiny_model_dir: Path) -> None:
    """``backend.fsdp.cp = 2``: both processes train on the same rows, each on half of
    every sequence; the losses and the exported weights are the single-device run's, and
    the pair's checkpoint resumes in one process."""
    from safetensors.torch import load_file

    config = _sft_config(tmp_path, tiny_model_dir)
    single, pair = tmp_path / "single", tmp_path / "cp2"
    _run_in_process(config, f"run.output_dir={single}", "backend.name=single")
    output = _launch(config, pair, "--set", "backend.fsdp.cp=2")
    assert "on cpu x2 (1 data-parallel)" in output  # two processes, one batch between them
    assert "Slicing a flattened dim" not in output  # the flattened mesh is kept, not sliced
    want, got = _losses(single), _losses(pair)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step

    def weights(run: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for file in (run / "export" / "final").glob("*.safetensors"):
            out.update(load_file(file))
        return out

    exported, reference = weights(pair), weights(single)
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-5, rtol=1e-4)
    config_json = (pair / "export" / "final" / "config.json").read_text()
    assert "context_parallel" not in config_json  # the export loads with stock attention

    resumed = tmp_path / "resumed"
    _run_in_process(config, f"run.output_dir={resumed}", "backend.name=single",
                    f"run.resume=\"{pair / 'checkpoints' / 'step_2'}\"")
    after = _losses(resumed)
    assert sorted(after) == [3, 4]
    for step in after:
        assert after[step] == pytest.approx(got[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_with_cp_pair_matches_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    """GRPO with a KL reference and two updates per rollout (so the old-log-prob,
    reference and update passes all run split over the pair) follows the one-process run."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": f"Item {i}: reply with a short word about context.",
                    "reference": "A"}) + "\n" for i in range(8)))
    config = tmp_path / "grpo.toml"
    config.write_text(f"""
[run]
seed = 1
[model]
name_or_path = "{tiny_model_dir}"
max_length = 96
[data]
format = "jsonl"
[data.jsonl]
path = "{prompts}"
[algorithm]
name = "grpo"
[algorithm.grpo]
prompts_per_step = 2
kl_beta = 0.1
ppo_epochs = 2
[rollout]
n = 4
max_new_tokens = 8
[train]
lr = 1e-2
max_steps = 2
micro_batch_size = 4
[backend]
device = "cpu"
[[rewards.components]]
name = "length"
max_length = 4
buffer = 4
[checkpoint]
export_final = false
[logging]
loggers = ["jsonl"]
plot = false
""")
    single, pair = tmp_path / "single", tmp_path / "cp2"
    _run_in_process(config, f"run.output_dir={single}", "backend.name=fsdp")
    _launch(config, pair, "--set", "backend.fsdp.cp=2")
    want, got = _losses(single), _losses(pair)
    assert sorted(got) == [1, 2]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), step
