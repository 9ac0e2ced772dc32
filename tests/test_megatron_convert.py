"""Hugging Face <-> Megatron weight mapping: exact round trips under simulated TP/PP sharding.

These tests need no megatron-core: the mapping is pure tensor code. The layout rules they
check against (grouped QKV rows, per-rank ``[gate; up]``, row-parallel sums) are megatron's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reasonctl.backends.megatron.convert import (
    ConversionError,
    ModelShape,
    ParallelLayout,
    SafetensorsSource,
    StateDictSource,
    hf_to_megatron,
    interleave_qkv,
    megatron_to_hf,
    split_qkv,
)

VOCAB = 300  # not a multiple of 128: exercises vocabulary padding


def _qwen2_config() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True)


def _qwen3_config() -> object:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, tie_word_embeddings=False)


def _llama_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       tie_word_embeddings=False)


CONFIGS = {"qwen2": _qwen2_config, "qwen3": _qwen3_config, "llama": _llama_config}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]


def _hf_state(config: object, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise so mistakes show
        for param in model.parameters():
            if param.ndim == 1:
                param.normal_()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _shard_all(source: object, shape: ModelShape, tp: int, pp: int, vpp: int
               ) -> dict[ParallelLayout, dict[str, torch.Tensor]]:
    return {
        layout: hf_to_megatron(source, shape, layout)
        for p in range(pp) for v in range(vpp) for t in range(tp)
        for layout in [ParallelLayout(tp, t, pp, p, vpp, v)]
    }


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize(("tp", "pp", "vpp"), LAYOUTS)
def test_round_trip_is_exact(arch: str, tp: int, pp: int, vpp: int) -> None:
    config = CONFIGS[arch]()
    hf = _hf_state(config)
    shape = ModelShape.from_hf_config(config)
    shards = _shard_all(StateDictSource(hf), shape, tp, pp, vpp)
    back = megatron_to_hf(shards, shape)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_shape_flags_per_family() -> None:
    qwen2 = ModelShape.from_hf_config(_qwen2_config())
    qwen3 = ModelShape.from_hf_config(_qwen3_config())
    llama = ModelShape.from_hf_config(_llama_config())
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_word_embeddings) == (True, False, True)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 16)
    assert (llama.qkv_bias, llama.qk_norm) == (False, False)
    assert qwen2.padded_vocab_size == 384


def test_pipeline_stages_hold_their_parts() -> None:
    config = _qwen2_config()  # tied embeddings
    shape = ModelShape.from_hf_config(config)
    source = StateDictSource(_hf_state(config))
    first = hf_to_megatron(source, shape, ParallelLayout(pp_size=2, pp_rank=0))
    last = hf_to_megatron(source, shape, ParallelLayout(pp_size=2, pp_rank=1))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" \
        not in last
    # a tied model keeps a copy of the embedding as the last stage's output layer
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0", "1"}
    # local layer 0 of the last stage is global layer 2
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       source.get("model.layers.2.input_layernorm.weight"))
    # interleaved virtual stages: chunk 1 of pp rank 0 holds global layer 2
    chunk = hf_to_megatron(source, shape, ParallelLayout(pp_size=2, vpp_size=2, vpp_rank=1))
    assert torch.equal(chunk["decoder.layers.0.input_layernorm.weight"],
                       source.get("model.layers.2.input_layernorm.weight"))
    single = hf_to_megatron(source, shape, ParallelLayout())
    assert "output_layer.weight" not in single  # tied, one stage: no separate weight


def test_tensor_parallel_shards_compute_what_megatron_computes() -> None:
    """Each TP rank's shard, used the way megatron uses it, reproduces the HF computation."""
    config = _qwen2_config()
    hf = _hf_state(config)
    shape = ModelShape.from_hf_config(config)
    tp = 2
    shards = [hf_to_megatron(StateDictSource(hf), shape, ParallelLayout(tp, r)) for r in range(tp)]
    x = torch.randn(5, shape.hidden_size)
    d = shape.head_dim
    # attention projections: rank r's local qkv output, split per KV group like megatron
    # (view [groups, (heads_per_group + 2) * d] then split q | k | v), gives r's heads
    q_full = x @ hf["model.layers.0.self_attn.q_proj.weight"].T + \
        hf["model.layers.0.self_attn.q_proj.bias"]
    k_full = x @ hf["model.layers.0.self_attn.k_proj.weight"].T + \
        hf["model.layers.0.self_attn.k_proj.bias"]
    for r, shard in enumerate(shards):
        out = x @ shard["decoder.layers.0.self_attention.linear_qkv.weight"].T + \
            shard["decoder.layers.0.self_attention.linear_qkv.bias"]
        groups = shape.num_kv_heads // tp
        grouped = out.view(5, groups, (shape.heads_per_group + 2) * d)
        q, k, _ = torch.split(grouped, [shape.heads_per_group * d, d, d], dim=-1)
        heads = shape.num_heads // tp
        assert torch.allclose(q.reshape(5, -1), q_full[:, r * heads * d:(r + 1) * heads * d])
        assert torch.allclose(k.reshape(5, -1), k_full[:, r * groups * d:(r + 1) * groups * d])
    # SwiGLU MLP: silu(first half) * second half of the local fc1, then the row-parallel
    # fc2 partial sums add up to the full output
    mlp = {n: hf[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
    expected = (F.silu(x @ mlp["gate"].T) * (x @ mlp["up"].T)) @ mlp["down"].T
    total = torch.zeros_like(expected)
    for shard in shards:
        gate, up = torch.chunk(x @ shard["decoder.layers.0.mlp.linear_fc1.weight"].T, 2, dim=-1)
        total += (F.silu(gate) * up) @ shard["decoder.layers.0.mlp.linear_fc2.weight"].T
    assert torch.allclose(total, expected, atol=1e-5)
    # vocab-parallel embedding: rank r holds padded rows [r * V'/tp, (r + 1) * V'/tp)
    rows = shape.padded_vocab_size // tp
    emb = [s["embedding.word_embeddings.weight"] for s in shards]
    assert all(e.shape == (rows, shape.hidden_size) for e in emb)
    assert torch.equal(emb[1][: VOCAB - rows], hf["model.embed_tokens.weight"][rows:])
    assert not emb[1][VOCAB - rows:].any()


def test_split_qkv_inverts_the_grouping() -> None:
    shape = ModelShape.from_hf_config(_llama_config())
    d = shape.head_dim
    q = torch.arange(shape.num_heads * d * 3.0).view(-1, 3)
    k = -torch.arange(shape.num_kv_heads * d * 3.0).view(-1, 3)
    v = 1000 + torch.arange(shape.num_kv_heads * d * 3.0).view(-1, 3)
    fused = interleave_qkv(q, k, v, shape.num_kv_heads)
    # first group: two query heads, then its key head, then its value head
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d: 3 * d], k[:d])
    assert torch.equal(fused[3 * d: 4 * d], v[:d])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v), strict=True))


def test_lazy_safetensors_source_reads_slices(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _qwen3_config()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several files + index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    shape = ModelShape.from_hf_config(config)
    source = SafetensorsSource(tmp_path)
    assert torch.equal(source.get("model.layers.1.mlp.down_proj.weight", slice(2, 5),
                                  slice(8, 16)),
                       hf["model.layers.1.mlp.down_proj.weight"][2:5, 8:16])
    back = megatron_to_hf(_shard_all(source, shape, 2, 2, 1), shape)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.items())


def test_unsupported_models_and_layouts_say_why() -> None:
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ConversionError, match="model types"):
        ModelShape.from_hf_config(GPT2Config())
    with pytest.raises(ConversionError, match="o_proj bias"):
        ModelShape.from_hf_config(LlamaConfig(attention_bias=True))
    shape = ModelShape.from_hf_config(_qwen2_config())
    with pytest.raises(ConversionError, match="num_key_value_heads = 2 is not divisible by tp = 4"):
        ParallelLayout(tp_size=4).check(shape)
    with pytest.raises(ConversionError, match="pp x vpp = 8"):
        ParallelLayout(pp_size=4, vpp_size=2).check(shape)
