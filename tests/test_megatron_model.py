"""megatron-core's GPTModel built from Hugging Face configs matches transformers on CPU.

Needs megatron-core (the ``megatron`` extra); skipped without it. megatron-core assumes CUDA
in three places these tests work around (the backend itself runs on CUDA only):

- ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()`` on
  the first forward: ``torch.cuda.current_device`` is patched to return the CPU device;
- dropout runs inside the CUDA RNG tracker's ``fork()``: the inference tracker (whose
  ``fork`` does nothing; dropout is 0 anyway) is installed instead;
- without an explicit mask the local attention allocates its causal mask on ``"cuda"``:
  the batches carry explicit masks (as the backend's always do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra 'megatron')")

from reasonctl.backends.megatron.batches import prepare
from reasonctl.backends.megatron.convert import (
    ModelShape,
    ParallelLayout,
    StateDictSource,
    hf_to_megatron,
    megatron_to_hf_tensors,
    merge_tp,
)
from reasonctl.backends.megatron.logprobs import vocab_parallel_logprobs
from tests.gloo_workers import gloo_group, run_gloo_workers

VOCAB = 300


def _configs() -> dict[str, Any]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "qwen2": Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, rope_theta=1e6),
        "qwen3": Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, tie_word_embeddings=False),
        "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=128, rope_theta=5e5,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}),
    }


def _hf_model(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms start at 1, biases at 0: make them matter
                param.normal_(1.0, 0.2)
    return model


def _cpu_workarounds() -> None:
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _megatron_model(hf_config: Any, hf_state: dict[str, torch.Tensor], layout: ParallelLayout
                    ) -> Any:
    from reasonctl.backends.megatron.model import (
        ModelParallelSizes,
        build_gpt_model,
        transformer_config,
    )
    from reasonctl.backends.megatron.weights import load_chunk_weights

    sizes = ModelParallelSizes(tp=layout.tp_size)
    config = transformer_config(hf_config, sizes=sizes, dtype=torch.float32, cpu_init=True)
    model = build_gpt_model(hf_config, config, pre_process=True, post_process=True)
    shape = ModelShape.from_hf_config(hf_config)
    load_chunk_weights(model, hf_to_megatron(StateDictSource(hf_state), shape, layout))
    return model


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 14), generator=generator)
    attention = torch.ones_like(ids)
    attention[1, 10:] = 0  # right padding
    attention[2, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": attention}


def _hf_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, batch["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def world_of_one() -> Any:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_workarounds()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_gpt_model_logits_match_transformers(world_of_one: Any, arch: str) -> None:
    hf_config = _configs()[arch]
    hf = _hf_model(hf_config)
    model = _megatron_model(hf_config, hf.state_dict(), ParallelLayout()).eval()
    batch = _batch()
    prepared = prepare(batch)
    with torch.no_grad():
        logits = model(prepared.tokens, prepared.position_ids, prepared.attention_mask)
        reference = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = _hf_logprobs(hf, batch)
    valid = batch["attention_mask"].bool()
    assert logits.shape[-1] == ModelShape.from_hf_config(hf_config).padded_vocab_size
    assert torch.allclose(logits[..., :VOCAB][valid], reference[valid], atol=1e-4)
    out = vocab_parallel_logprobs(logits[:, :-1], prepared.tokens[:, 1:], vocab_start=0,
                                  vocab_size=VOCAB)
    targets = valid[:, 1:] & valid[:, :-1]
    assert torch.allclose(prepared.restore(out.logprobs)[targets], expected[targets], atol=1e-4)


def test_packed_batch_matches_separate_rows(world_of_one: Any) -> None:
    hf_config = _configs()["qwen2"]
    hf = _hf_model(hf_config)
    model = _megatron_model(hf_config, hf.state_dict(), ParallelLayout()).eval()
    first, second = torch.randint(0, VOCAB, (7,)), torch.randint(0, VOCAB, (5,))
    packed = {"input_ids": torch.cat([first, second])[None],
              "position_ids": torch.cat([torch.arange(7), torch.arange(5)])[None]}
    prepared = prepare(packed)
    assert prepared.shape == (2, 7)
    with torch.no_grad():
        logits = model(prepared.tokens, prepared.position_ids, prepared.attention_mask)
        out = prepared.restore(vocab_parallel_logprobs(
            logits[:, :-1], prepared.tokens[:, 1:], vocab_start=0, vocab_size=VOCAB).logprobs)
        alone = [_hf_logprobs(hf, {"input_ids": t[None], "attention_mask": torch.ones(1, len(t))})
                 for t in (first, second)]
    assert out.shape == (1, 11)
    assert torch.allclose(out[0, :6], alone[0][0], atol=1e-4)
    assert out[0, 6] == 0  # predicts across the sample boundary: never a target
    assert torch.allclose(out[0, 7:], alone[1][0], atol=1e-4)


# --- tensor parallelism over two gloo processes -------------------------------------------


def _tp_worker(rank: int, world: int, port: int, arch: str, result_path: str) -> None:
    from megatron.core import parallel_state

    with gloo_group(rank, world, port):
        try:
            _tp_outputs(rank, arch, result_path)
        finally:
            parallel_state.destroy_model_parallel()


def _tp_outputs(rank: int, arch: str, result_path: str) -> None:
    """Rank ``rank``'s log-probs, entropy and gradients of the TP=2 model; rank 0 saves
    them with the gathered gradients and the gradient norm."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    _cpu_workarounds()
    group = parallel_state.get_tensor_model_parallel_group()
    hf_config = _configs()[arch]
    hf = _hf_model(hf_config)
    shape = ModelShape.from_hf_config(hf_config)
    model = _megatron_model(hf_config, hf.state_dict(), ParallelLayout(2, rank))
    batch = _batch()
    prepared = prepare(batch)
    logits = model(prepared.tokens, prepared.position_ids, prepared.attention_mask)
    per_rank = shape.padded_vocab_size // 2
    out = vocab_parallel_logprobs(
        logits[:, :-1], prepared.tokens[:, 1:], vocab_start=rank * per_rank,
        vocab_size=VOCAB, group=group, group_size=2, temperature=0.7, with_entropy=True)
    logprobs = prepared.restore(out.logprobs)
    entropy = prepared.restore(out.entropy)
    targets = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).float()
    ((logprobs - 0.1 * entropy) * targets).sum().backward()
    # the gradient norm as megatron's optimizers compute it: TP duplicates counted once
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squares = sum((p.grad.double() ** 2).sum() for p in model.parameters()
                  if param_is_not_tensor_parallel_duplicate(p))
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    grads = {}  # gradients gathered over TP and mapped to Hugging Face names
    for name, param in model.named_parameters():
        parts = [torch.empty_like(param.grad) for _ in range(2)]
        dist.all_gather(parts, param.grad.contiguous(), group=group)
        grads.update(megatron_to_hf_tensors(name, merge_tp(name, parts), shape))
    if rank == 0:
        torch.save({"logprobs": logprobs.detach(), "entropy": entropy.detach(),
                    "grads": grads, "grad_norm": float(squares.sqrt())}, result_path)


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tensor_parallel_model_matches_transformers_with_gradients(arch: str, tmp_path: Path
                                                                   ) -> None:
    """TP=2: log-probs, entropy (temperature 0.7), every weight gradient and the norm match."""
    path = str(tmp_path / "result.pt")
    run_gloo_workers(_tp_worker, 2, arch, path)
    result = torch.load(path)

    hf_config = _configs()[arch]
    hf = _hf_model(hf_config)
    batch = _batch()
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float() / 0.7
    logprobs = torch.log_softmax(logits, -1)
    picked = logprobs.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    targets = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).float()
    ((picked - 0.1 * entropy) * targets).sum().backward()
    mask = targets.bool()
    assert torch.allclose(result["logprobs"][mask], picked[mask].detach(), atol=1e-4)
    assert torch.allclose(result["entropy"][mask], entropy[mask].detach(), atol=1e-4)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert sorted(result["grads"]) == sorted(hf_grads)
    for name, grad in hf_grads.items():
        assert torch.allclose(result["grads"][name], grad, atol=1e-4, rtol=1e-3), name
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in hf_grads.values())))
    assert result["grad_norm"] == pytest.approx(norm, rel=1e-4)
