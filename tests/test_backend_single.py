"""The single-device backend and the pieces under it: log-probs, step, schedule, loading."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from reasonctl.backends.compile import compile_blocks
from reasonctl.backends.lm_head import linear_token_logprobs
from reasonctl.backends.optim import lr_multiplier
from reasonctl.backends.single import SingleDeviceBackend
from reasonctl.backends.token_logprobs import chunked_token_logprobs
from reasonctl.core.config import RunConfig
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import RunContext
from reasonctl.data.collate import collate
from reasonctl.data.processing import EncodedSample
from reasonctl.models.loading import (
    ModelLoadError,
    apply_trainable_patterns,
    auto_model_class,
    resolve_model_dir,
)


def make_backend(model_dir: Path, tmp_path: Path, *, chunk_tokens: int = 2048,
                 **sections: Any) -> SingleDeviceBackend:
    values: dict[str, Any] = {
        "model": {"name_or_path": str(model_dir)},
        "train": {"lr": 1e-2, "max_grad_norm": 1.0},
        "backend": {"device": "cpu"},
        "run": {"output_dir": str(tmp_path)},
    }
    for key, value in sections.items():
        values.setdefault(key, {}).update(value)
    config = RunConfig(**values)
    host = PluginHost.load()
    ctx = RunContext(config=config, registry=host.registry, hooks=LifecycleHooks(host.pm),
                     output_dir=tmp_path)
    ctx.total_steps = 10
    backend = SingleDeviceBackend(chunk_tokens=chunk_tokens, export_shard_size="5GB")
    ctx.backend = backend
    backend.setup(ctx)
    return backend


def token_batch(lengths: list[int], *, seed: int = 0, pack: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        ids = torch.randint(0, 250, (length,), generator=generator).tolist()
        samples.append(EncodedSample(ids, [0] * (length // 2) + [1] * (length - length // 2)))
    return collate(samples, pad_id=256, pack=pack)


def reference_logprobs(model: Any, batch: dict[str, Any], temperature: float = 1.0):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch.get("attention_mask")).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    targets = batch["input_ids"][:, 1:]
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


def test_token_outputs_match_full_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir, tmp_path, chunk_tokens=7)  # forces several chunks
    batch = token_batch([12, 9, 5])
    out = backend.token_outputs(batch, with_entropy=True, temperature=0.7)
    want, entropy = reference_logprobs(backend.hf_model, batch, temperature=0.7)
    assert out.logprobs.shape == (3, 11)
    valid = batch["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(out.logprobs[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy[valid], entropy[valid], atol=1e-5, rtol=1e-5)
    assert backend.token_outputs(batch).entropy is None


def test_packed_batch_gives_the_same_logprobs_as_padded(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir, tmp_path)
    padded = backend.token_outputs(token_batch([10, 6], seed=1)).logprobs
    packed = backend.token_outputs(token_batch([10, 6], seed=1, pack=True)).logprobs
    torch.testing.assert_close(packed[0, :9], padded[0, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[0, 10:15], padded[1, :5], atol=1e-5, rtol=1e-5)


def test_chunked_gradients_equal_unchunked() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (2, 9))
    grads = []
    for chunk in (4, 1000):
        out = chunked_token_logprobs(hidden, targets, weight, chunk_tokens=chunk,
                                     with_entropy=True)
        assert out.entropy is not None
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_logprobs_match_float64_log_softmax(temperature: float, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = (torch.randn(50, dtype=torch.float64, generator=generator, requires_grad=True)
            if with_bias else None)
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    g_logprob, g_entropy = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    logprobs, entropy = linear_token_logprobs(hidden, targets, weight, bias,
                                              temperature=temperature, with_entropy=True,
                                              chunk_tokens=4)
    assert entropy is not None and logprobs.shape == entropy.shape == (3, 7)
    grads = torch.autograd.grad((logprobs * g_logprob).sum() + (entropy * g_entropy).sum(),
                                inputs)

    log_softmax = torch.log_softmax(F.linear(hidden, weight, bias) / temperature, dim=-1)
    ref_logprobs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ref_grads = torch.autograd.grad(
        (ref_logprobs * g_logprob).sum() + (ref_entropy * g_entropy).sum(), inputs)

    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-4, rtol=0)
    for got, want in zip(grads, ref_grads, strict=True):  # float32 softmax statistics
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_compiled_blocks_keep_names_and_run_eagerly_without_grad(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir, tmp_path)
    batch = token_batch([10, 6], seed=1)
    before = backend.token_outputs(batch).logprobs
    names = [n for n, _ in backend.hf_model.named_parameters()]
    assert compile_blocks(backend.hf_model) == backend.hf_model.config.num_hidden_layers
    assert [n for n, _ in backend.hf_model.named_parameters()] == names
    torch.testing.assert_close(backend.token_outputs(batch).logprobs, before)


def nll_loss(total_tokens: int):
    def loss_fn(outputs: Any, batch: dict[str, Any]):
        mask = batch["loss_mask"][:, 1:].float()
        return -(outputs.logprobs * mask).sum() / total_tokens, {"tokens": float(mask.sum())}
    return loss_fn


def test_train_step_memorises_a_batch(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir, tmp_path)
    batch = token_batch([16, 16])
    total = int(batch["loss_mask"][:, 1:].sum())
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    metrics = [backend.train_step(halves, nll_loss(total)) for _ in range(25)]
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    assert metrics[0]["lr"] == pytest.approx(1e-2)
    assert metrics[0]["grad_norm"] > 0
    assert metrics[0]["tokens"] == pytest.approx(total / 2)  # averaged over micro-batches


def test_frozen_parameters_do_not_change(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir, tmp_path,
                           model={"freeze": [r"^model\.layers\.0\."]})
    frozen = {n: p.detach().clone() for n, p in backend.hf_model.named_parameters()
              if n.startswith("model.layers.0.")}
    trained = backend.hf_model.model.layers[1].mlp.up_proj.weight.detach().clone()
    batch = token_batch([12])
    backend.train_step([batch], nll_loss(int(batch["loss_mask"][:, 1:].sum())))
    for name, param in backend.hf_model.named_parameters():
        if name in frozen:
            assert not param.requires_grad
            assert torch.equal(param, frozen[name])
    assert not torch.equal(backend.hf_model.model.layers[1].mlp.up_proj.weight, trained)
    counts = backend.parameter_counts
    assert 0 < counts.trainable < counts.total


def test_trainable_patterns_report_typos(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ModelLoadError, match="matches no parameter"):
        apply_trainable_patterns(model, freeze=[r"^model\.visual\."])
    counts = apply_trainable_patterns(model, trainable=[r"lm_head|embed_tokens"])
    assert counts.trainable == model.model.embed_tokens.weight.numel()


def test_lr_schedules() -> None:
    def lr(step: int, schedule: str) -> float:
        return lr_multiplier(step, total_steps=12, schedule=schedule, warmup_steps=2,
                             min_lr_ratio=0.1)

    assert [lr(s, "constant") for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    assert lr(2, "linear") == pytest.approx(1.0)
    assert lr(7, "linear") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr(12, "linear") == pytest.approx(0.1)
    assert lr(7, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(12, "cosine") == pytest.approx(0.1)


def test_model_class_follows_the_config() -> None:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        Qwen2_5_VLConfig,
        Qwen2Config,
    )

    assert auto_model_class(Qwen2Config()) is AutoModelForCausalLM
    vl = Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"])
    assert auto_model_class(vl) is AutoModelForImageTextToText


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_dir(str(tmp_path / "nope"))
    assert resolve_model_dir(str(tmp_path)) == tmp_path


THREADS_SCRIPT = """
import sys, torch
from reasonctl.backends.distributed import run_device
from reasonctl.core.config import RunConfig
backend = {"device": sys.argv[1]}
if len(sys.argv) > 2:
    backend["cpu_threads"] = int(sys.argv[2])
run_device(RunConfig(backend=backend))
print(torch.get_num_threads())
"""


def test_cpu_runs_use_one_thread_unless_the_user_says_otherwise(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def threads(*args: str, omp: str | None = None) -> int:
        extra = {"OMP_NUM_THREADS": omp} if omp else {}
        out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, *args], env={**env, **extra},
                             capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    assert threads("cpu") == 1  # torch's default is one per core
    assert threads("auto", omp="2") == 2  # an exported OMP_NUM_THREADS is kept
    assert threads("cpu", "3", omp="1") == 3  # the config key wins over both
    before = torch.get_num_threads()
    try:  # the backend a run builds applies it
        make_backend(tiny_model_dir, tmp_path, backend={"cpu_threads": 2})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
