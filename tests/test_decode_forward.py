"""The dedicated decode step against the Hugging Face forward pass it replaces."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from reasonctl.core.types import SamplingParams
from reasonctl.rollout import DecodeOptions
from reasonctl.rollout.static.decode_forward import DecodeForward, supports_decode_forward
from reasonctl.rollout.static.slot_cache import SlotKVCache

SHAPE = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128}


def _model(kind: str, **extra: Any) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    if kind == "qwen2":
        config = Qwen2Config(**{**SHAPE, **extra}, tie_word_embeddings=True)
    elif kind == "qwen3":
        config = Qwen3Config(**{**SHAPE, **extra}, head_dim=16, tie_word_embeddings=False)
    else:
        config = LlamaConfig(**SHAPE, attention_bias=False, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32},
                             **extra)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # large weights: differences between the paths would show
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_decode_step_equals_the_full_forward_pass(kind: str) -> None:
    _check_decode_step(kind, fused=False)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_decode_step_with_fused_kernels_equals_the_full_forward_pass(kind: str) -> None:
    pytest.importorskip("triton")
    _check_decode_step(kind, fused=True)


@pytest.mark.usefixtures("triton_interpreter")
def test_fused_kernels_without_the_chain_equal_the_full_forward_pass() -> None:
    pytest.importorskip("triton")
    # library matmuls, fused attention and gate/up kernels
    _check_decode_step("qwen3", fused=True, options=DecodeOptions(kernel_chain=False))


@pytest.mark.usefixtures("triton_interpreter")
def test_chain_with_an_embedding_of_its_own_kind_equals_the_full_forward_pass() -> None:
    """An embedding module other than a plain ``nn.Embedding`` runs its own forward
    before the first norm kernel (a plain one is looked up inside that kernel)."""
    pytest.importorskip("triton")

    class OwnEmbedding(torch.nn.Embedding):
        pass

    model = _model("qwen2")
    inner = model.model
    own = OwnEmbedding(*inner.embed_tokens.weight.shape)
    own.weight = inner.embed_tokens.weight  # still tied to the output head
    inner.embed_tokens = own
    _check_decode_step("qwen2", fused=True, model=model)


@pytest.mark.usefixtures("triton_interpreter")
def test_chain_with_a_split_qkv_matmul_equals_the_full_forward_pass() -> None:
    """The QKV matmul's reduction split in two: attention sums the partial products and
    adds the projection's bias."""
    pytest.importorskip("triton")
    from reasonctl.rollout.kernels.decode_linear import LinearTiles

    model = _model("qwen3", hidden_size=256, attention_bias=True)
    _check_decode_step("qwen3", fused=True, model=model, qkv_tiles=LinearTiles(16, 128))


@pytest.mark.usefixtures("triton_interpreter")
def test_prefill_equals_the_full_forward_pass_and_fills_the_cache_alike() -> None:
    """Left-padded prompts, one of them in two slots: the dedicated prefill's last hidden
    states and stored keys/values are the Hugging Face forward pass's."""
    pytest.importorskip("triton")
    model = _model("qwen3", attention_bias=True)
    step = DecodeForward(model, torch.float32, fused_kernels=True)
    assert step.prefills
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((3, width), dtype=torch.long)
    real = torch.zeros((3, width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        real[row, width - len(prompt):] = True
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    store_at = torch.where(real, positions, 15)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = ((causal & real.view(-1, 1, width)) | torch.eye(width, dtype=torch.bool)
               ).unsqueeze(1)
    slots, source_rows = torch.tensor([2, 0, 1, 3]), torch.tensor([0, 1, 2, 0])
    caches = [SlotKVCache(layers=2, slots=4, kv_heads=2, max_len=16, head_dim=16,
                          dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        cache.prepare_prefill(slots, source_rows, store_at)
    with torch.no_grad():
        ours = step.prefill_hidden(ids, positions, allowed, caches[0])
        forward = inspect.signature(type(model.model).forward).parameters
        cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        theirs = model.model(input_ids=ids, position_ids=positions, attention_mask=allowed,
                             use_cache=True, **{cache_kwarg: caches[1]}).last_hidden_state
        torch.testing.assert_close(ours, theirs[:, -1], rtol=1e-5, atol=1e-5)
        for mine, reference in zip(caches[0].keys + caches[0].values,
                                   caches[1].keys + caches[1].values, strict=True):
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
        for row, prompt in enumerate(prompts):  # padding changes nothing
            alone = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(step.logits(ours)[row], alone, rtol=1e-4, atol=1e-4)


def test_chain_runs_only_where_every_kernel_does() -> None:
    model = _model("qwen3")
    assert not DecodeForward(model, torch.float32, fused_kernels=False).chain
    # without Triton's interpreter, CPU tensors run no kernel at all
    assert not DecodeForward(model, torch.float32, fused_kernels=True).chain


def _check_decode_step(kind: str, *, fused: bool, model: Any = None,
                       qkv_tiles: Any = None, options: DecodeOptions = DecodeOptions()
                       ) -> None:
    model = _model(kind) if model is None else model
    assert supports_decode_forward(model)
    step = DecodeForward(model, torch.float32, fused_kernels=fused, options=options)
    if qkv_tiles is not None:
        step.qkv_tiles = qkv_tiles
        assert qkv_tiles.splits(model.config.hidden_size) > 1
    assert step.fused_mlp is fused
    assert step.fused_attention is (fused and kind == "qwen3")  # the others: head size 8
    # the whole step as the kernel chain where attention is fused too (never PDL on CPU)
    assert step.chain is step.fused_attention and not step.pdl
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = [9, 5, 7]  # rows of different lengths: each decodes at its own position
    cache = SlotKVCache(layers=2, slots=3, kv_heads=2, max_len=16,
                        head_dim=model.config.head_dim if kind == "qwen3" else 8,
                        dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        # fill each slot by decoding its tokens one by one through the dedicated step
        key_index = torch.arange(16)
        for position in range(max(lengths)):
            positions = torch.tensor([min(position, n - 1) for n in lengths])
            tokens = ids[torch.arange(3), positions]
            allowed = (key_index.view(1, -1) <= positions.view(-1, 1)).view(3, 1, 1, -1)
            logits = step(tokens, positions, cache, None if step.fused_attention else allowed)
        for row, length in enumerate(lengths):
            reference = model(input_ids=ids[row : row + 1, :length]).logits[0, -1]
            torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)


def test_refresh_follows_weight_changes_and_unsupported_models_are_refused() -> None:
    model = _model("qwen2")
    step = DecodeForward(model, torch.bfloat16)  # float32 weights: every matmul weight copied
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(1.0)
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    step.refresh()
    k_rows = slice(SHAPE["hidden_size"], SHAPE["hidden_size"] + 16)
    torch.testing.assert_close(step.layers[0].qkv[k_rows].float(),
                               model.model.layers[0].self_attn.k_proj.weight, atol=2e-2,
                               rtol=1e-2)
    torch.testing.assert_close(step.layers[1].down.float(),
                               model.model.layers[1].mlp.down_proj.weight, atol=2e-2, rtol=1e-2)
    assert not supports_decode_forward(_model("llama", mlp_bias=True))
    same_dtype = DecodeForward(model, torch.float32)  # weights of the compute dtype are shared
    down = model.model.layers[0].mlp.down_proj.weight
    assert same_dtype.layers[0].down.data_ptr() == down.data_ptr()
    # ... unless their rows are not contiguous (the kernels read rows by a fixed stride)
    transposed = model.model.layers[1].mlp.down_proj.weight
    transposed.data = transposed.data.t().contiguous().t()
    copied = DecodeForward(model, torch.float32).layers[1].down
    assert copied.is_contiguous() and copied.data_ptr() != transposed.data_ptr()
    assert torch.equal(copied, transposed)


def test_engine_uses_the_step_and_compiled_step_gives_the_same_greedy_text(
        tiny_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [{"input_ids": list(range(5, 5 + n))} for n in (3, 8, 5)]
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    eager = HFRolloutEngine(model, tokenizer)
    compiled = HFRolloutEngine(model, tokenizer, compile_decode=True)
    outputs = [engine.generate(prompts, params) for engine in (eager, compiled)]
    assert eager.static_decoder is not None and eager.static_decoder.decode_forward is not None
    assert [g[0].token_ids for g in outputs[0]] == [g[0].token_ids for g in outputs[1]]
    for prompt, group in zip(prompts, outputs[0], strict=True):
        reference = model.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=20,
                                   do_sample=False)
        assert group[0].token_ids == reference[0, len(prompt["input_ids"]) :].tolist()


@pytest.mark.usefixtures("triton_interpreter")
def test_compiled_engine_with_fused_kernels_matches_greedy_generate() -> None:
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = _model("qwen3")
    engine = HFRolloutEngine(model, _NoTextTokenizer(), eos_token_ids=[96], pad_token_id=0,
                             compile_decode=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 8, 5)]
    groups = engine.generate([{"input_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_new_tokens=10))
    step = engine.static_decoder.decode_forward
    assert step is not None and step.fused_mlp and step.fused_attention
    for prompt, group in zip(prompts, groups, strict=True):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                   eos_token_id=96, pad_token_id=0)
        assert group[0].token_ids == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize("vocab", [151936, 97, 128])
def test_two_stage_row_reductions_equal_the_plain_ones(vocab: int) -> None:
    from reasonctl.rollout.sampling import _row_argmax, _row_logsumexp

    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    x[0, 3] = x[0, vocab - 1] = 100.0  # a tie: the first maximum wins, as in argmax
    assert torch.equal(_row_argmax(x), x.argmax(-1))
    torch.testing.assert_close(_row_logsumexp(x), x.logsumexp(-1))


class _NoTextTokenizer:
    """Enough of a tokenizer for the engine: ids only, no text."""

    pad_token_id = 0
    eos_token_id = 96

    def decode(self, ids: Any, **_: Any) -> str:
        return ""


@pytest.mark.parametrize(("kind", "extra", "dedicated"), [
    ("qwen3", {}, True), ("llama", {}, True), ("llama", {"mlp_bias": True}, False)])
def test_engine_greedy_equals_generate_for_each_family(kind: str, extra: dict[str, Any],
                                                       dedicated: bool) -> None:
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = _model(kind, **extra)
    engine = HFRolloutEngine(model, _NoTextTokenizer(), eos_token_ids=[96], pad_token_id=0)
    prompts = [list(range(5, 5 + n)) for n in (3, 8, 5)]  # padded differently in prefill
    groups = engine.generate([{"input_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_new_tokens=12))
    assert engine.last_stats.decode == "static"
    assert engine.static_decoder is not None
    assert (engine.static_decoder.decode_forward is not None) is dedicated
    for prompt, group in zip(prompts, groups, strict=True):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=96, pad_token_id=0)
        assert group[0].token_ids == reference[0, len(prompt) :].tolist()


def test_prefill_store_without_source_rows_takes_rows_in_order() -> None:
    keys = torch.randn(3, 2, 4, 8)  # [rows, kv_heads, tokens, head_dim]
    values = torch.randn(3, 2, 4, 8)
    slots = torch.tensor([2, 0, 3])
    store_at = torch.tensor([[0, 1, 2, 3], [7, 0, 1, 2], [7, 7, 0, 1]])
    caches = [SlotKVCache(layers=1, slots=4, kv_heads=2, max_len=8, head_dim=8,
                          dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
    caches[0].prepare_prefill(slots, None, store_at)
    caches[1].prepare_prefill(slots, torch.arange(3), store_at)
    for cache in caches:
        cache.update(keys, values, 0)
    assert torch.equal(caches[0].keys[0], caches[1].keys[0])
    assert torch.equal(caches[0].values[0], caches[1].values[0])
    assert torch.equal(caches[0].keys[0][2, :, 1], keys[0, :, 1])  # row 0's second token
    assert torch.equal(caches[0].values[0][3, :, 0], values[2, :, 2])  # row 2 at position 0
