"""Checks of the decode step's kernel chain on a CUDA GPU: for each model family the
engine's greedy ids equal ``generate``'s, sampled log-probs equal a full forward pass's,
and the paths it can take (chain or library matmuls, head sampling or logits,
programmatic dependent launches and tensor-descriptor loads where the GPU has them) agree.

``tests/test_decode_cuda.py`` runs this file in a separate pytest process without the
suite's ``conftest.py``, which switches Triton to its interpreter for the CPU kernel
tests; on a GPU machine it can also be run directly:

    python -m pytest --noconftest tests/cuda_checks.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from reasonctl.core.types import SamplingParams
from reasonctl.rollout import DecodeOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 640,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512}


class _NoTextTokenizer:
    """Enough of a tokenizer for the engine: ids only, no text."""

    pad_token_id = 0
    eos_token_id = 999

    def decode(self, ids: Any, **_: Any) -> str:
        return ""


def _model(kind: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    if kind == "qwen2":
        config = Qwen2Config(**SHAPE, tie_word_embeddings=True)
    elif kind == "qwen3":
        config = Qwen3Config(**SHAPE, head_dim=128, tie_word_embeddings=False)
    else:
        config = LlamaConfig(**SHAPE, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # large weights: differences between the paths would show
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model.cuda()


def _engine(model: Any, options: DecodeOptions = DecodeOptions()) -> Any:
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(model, _NoTextTokenizer(), eos_token_ids=[999], pad_token_id=0,
                           max_batch_size=8, options=options)


PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 17, 9, 25)]  # ragged, five of eight slots


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_greedy_equals_generate_through_the_kernel_chain(kind: str) -> None:
    model = _model(kind)
    engine = _engine(model)
    groups = engine.generate([{"input_ids": p} for p in PROMPTS],
                             SamplingParams(temperature=0.0, max_new_tokens=40))
    step = engine.static_decoder.decode_forward
    assert step is not None and step.chain
    assert step.pdl is (torch.cuda.get_device_capability()[0] >= 9)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        reference = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40,
                                   do_sample=False, eos_token_id=999, pad_token_id=0)
        assert group[0].token_ids == reference[0, len(prompt):].tolist()


@pytest.mark.parametrize("head_sampling", [True, False])
def test_sampled_logprobs_equal_a_full_forward_pass(head_sampling: bool) -> None:
    model = _model("qwen3")
    engine = _engine(model, DecodeOptions(head_sampling=head_sampling))
    # more sequences than slots: refills while others decode
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=30, seed=5)
    groups = engine.generate([{"input_ids": p} for p in PROMPTS], params)
    again = engine.generate([{"input_ids": p} for p in PROMPTS], params)
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g]
                                                         for g in again]
    with torch.no_grad():
        for prompt, group in zip(PROMPTS, groups, strict=True):
            for completion in group:
                ids = torch.tensor([prompt + completion.token_ids], device="cuda")
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                expected = torch.log_softmax(logits / 0.8, dim=-1).gather(
                    1, torch.tensor(completion.token_ids, device="cuda").unsqueeze(1))
                torch.testing.assert_close(torch.tensor(completion.logprobs),
                                           expected.squeeze(1).cpu(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n", [1, 3])
def test_prefill_graphs_decode_what_eager_prefills_decode(n: int) -> None:
    model = _model("qwen2")
    # n = 3: more sequences than slots (refills of fewer slots), prompts filling several
    # slots; three calls: each shape prefills eagerly, is captured, then replayed
    params = SamplingParams(n=n, temperature=0.8, max_new_tokens=24, seed=11)
    results = {}
    for graphs in (False, True):
        engine = _engine(model, DecodeOptions(prefill_graphs=graphs))
        results[graphs] = [
            [[(c.token_ids, c.logprobs) for c in g]
             for g in engine.generate([{"input_ids": p} for p in PROMPTS], params)]
            for _ in range(3)]
        assert bool(engine.static_decoder.prefill_graphs.graphs) is graphs
    assert results[True] == results[False]
    assert results[True][0] == results[True][2]  # a seed repeats its draws


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_chain_equals_library_matmuls_in_bfloat16(kind: str) -> None:
    from reasonctl.rollout.static.decode_forward import DecodeForward
    from reasonctl.rollout.static.slot_cache import SlotKVCache

    model = _model(kind).to(torch.bfloat16)
    step = DecodeForward(model, torch.bfloat16, fused_kernels=True)
    assert step.chain
    config = model.config
    cache = SlotKVCache(layers=config.num_hidden_layers, slots=8, kv_heads=2, max_len=256,
                        head_dim=step.head_dim, dtype=torch.bfloat16,
                        device=torch.device("cuda"))
    generator = torch.Generator("cuda").manual_seed(1)
    for tensor in cache.keys + cache.values:
        tensor.normal_(generator=generator)
    ids = torch.randint(0, 1000, (7,), device="cuda", generator=generator)
    positions = torch.tensor([3, 200, 64, 65, 127, 0, 255], device="cuda")
    with torch.no_grad():
        chain = step.chain_hidden(ids, positions, cache).float()
        library = step.stock_hidden(ids, positions, cache, None).float()
    # the same function with bf16 rounding in a different order
    torch.testing.assert_close(chain, library, atol=0.05, rtol=0.05)
    assert (chain - library).abs().mean() < 0.01


def test_batches_above_the_chain_use_library_matmuls_with_the_same_result() -> None:
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = _model("qwen2")
    prompts = [list(range(5 + i % 7, 12 + i % 7 + i % 5)) for i in range(72)]
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    # 72 slots: every step runs 72 rows with library matmuls and written logits
    wide = HFRolloutEngine(model, _NoTextTokenizer(), eos_token_ids=[999], pad_token_id=0,
                           max_batch_size=72)
    got = wide.generate([{"input_ids": p} for p in prompts], params)
    assert (72, True) in wide.static_decoder.graphs.graphs
    # 8 slots: the kernel chain
    narrow = _engine(model)
    want = narrow.generate([{"input_ids": p} for p in prompts], params)
    assert all(key[0] <= 8 for key in narrow.static_decoder.graphs.graphs)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]


def test_descriptor_loads_equal_per_thread_loads_on_the_gpu() -> None:
    from reasonctl.rollout.kernels.decode_linear import LinearTiles, skinny_linear, uses_descriptors

    generator = torch.Generator("cuda").manual_seed(3)
    for rows, columns, depth, tiles in ((64, 1152, 896, LinearTiles(16, 896)),
                                        (37, 896, 4864, LinearTiles(64, 640)),
                                        (5, 200, 392, LinearTiles(16, 256))):
        x = torch.randn(rows, depth, device="cuda", generator=generator).bfloat16()
        weight = (torch.randn(columns, depth, device="cuda", generator=generator)
                  / depth ** 0.5).bfloat16()
        if torch.cuda.get_device_capability()[0] >= 9:
            assert uses_descriptors(x, weight)
        pointers = skinny_linear(x, weight, None, tiles, descriptors=False)
        if uses_descriptors(x, weight):
            assert torch.equal(skinny_linear(x, weight, None, tiles, descriptors=True),
                               pointers)
        exact = (x.float() @ weight.float().T)
        summed = pointers.float().sum(0) if pointers.dim() == 3 else pointers.float()
        torch.testing.assert_close(summed, exact, atol=2e-2, rtol=2e-2)


def test_head_sampling_with_the_hardware_logarithm() -> None:
    from reasonctl.rollout.kernels import head_sampling

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 256, generator=generator).bfloat16().cuda()
    weight = (torch.randn(1000, 256, generator=generator) * 0.1).bfloat16().cuda()
    seeds = [torch.tensor([s], device="cuda") for s in range(20)]
    fast = torch.stack([head_sampling.head_sample(hidden, weight, 1.0, s)[0] for s in seeds])
    exact = torch.stack([head_sampling.head_sample(hidden, weight, 1.0, s, fast_log=False)[0]
                         for s in seeds])
    # the noise differs by about 2^-22 relative: only near-ties could be drawn differently
    assert (fast != exact).sum() <= 1
    # six likely entries over three tiles: draws follow the softmax
    likely = torch.tensor([0, 63, 64, 100, 128, 129])
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    table = torch.full((130, 16), -1e4)
    table[:, 1:] = 0
    table[likely, 0] = probs.log()
    ones = torch.zeros(64, 16)
    ones[:, 0] = 1
    tokens = torch.cat([head_sampling.head_sample(ones.cuda(), table.cuda(), 1.0,
                                                  torch.tensor([99 + i], device="cuda"))[0]
                        for i in range(50)]).cpu()
    assert set(tokens.tolist()) <= set(likely.tolist())
    counts = torch.tensor([(tokens == entry).sum() for entry in likely]).float()
    expected = probs * tokens.numel()
    assert float(((counts - expected) ** 2 / expected).sum()) < 20.5  # 5 dof, p < 0.001
