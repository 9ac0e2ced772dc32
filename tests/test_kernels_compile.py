"""The decode step's Triton kernels compile for a Hopper GPU (sm_90) with the shapes and
tile settings the engine uses for a Qwen2.5-0.5B-shaped model, and fit its shared memory;
the kernel chain's variants compile as programmatic dependent launches.

Compilation needs no GPU (Triton ships its own ptxas), so this runs everywhere Triton is
installed; it runs in a subprocess because other test modules switch the process to
Triton's interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a thread block may use on H100/H200


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("compiled ")]
    assert len(lines) == 27, proc.stdout  # every variant built below
    for line in lines:
        shared = int(line.rsplit(" ", 1)[1])
        assert shared <= SHARED_MEMORY_LIMIT, line


def compile_all() -> None:
    """Compile every kernel variant the engine launches (printed one per line)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from reasonctl.rollout.kernels import (
        decode_attention,
        decode_linear,
        decode_mlp,
        decode_norm,
        head_sampling,
        prefill_kernels,
        race_sampling,
        step_record,
    )

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, types: dict, constexprs: dict, **options) -> None:
        names = kernel.arg_names
        signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(source, target=target, options=options)
        print(f"compiled {kernel.fn.__name__} {compiled.metadata.shared}")

    attend, combine = decode_attention._kernels()
    for dtype, splits, norm, pdl, parts in (("bf16", 1, False, False, 0),
                                            ("bf16", 2, False, True, 0),
                                            ("bf16", 2, True, True, 0),
                                            ("fp32", 2, True, False, 0),
                                            ("bf16", 4, False, True, 4)):  # split QKV
        build(attend, {
            "qkv_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}",
            "positions_ptr": "*i64", "key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}",
            "q_norm_ptr": f"*{dtype}", "k_norm_ptr": f"*{dtype}", "norm_eps": "fp32",
            "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "partial_ptr": "*fp32",
            "stats_ptr": "*fp32", "scale_log2": "fp32", "max_len": "i32",
            "qkv_stride": "i32", "part_stride": "i32", "table_stride": "i32",
        }, {"HEADS": 14, "KV_HEADS": 2, "GROUP": 7, "GROUP_PAD": 16, "HEAD_DIM": 64,
            "BLOCK_N": 64, "SPLITS": splits, "HAS_NORM": norm, "UPCAST": dtype == "fp32",
            "PDL": pdl, "QKV_PARTS": parts, "QKV_BIAS": parts > 0,
            "ROTARY_BY_POSITION": pdl}, num_warps=4,
            num_stages=decode_attention.ATTEND_STAGES, launch_pdl=pdl)
    build(combine, {"partial_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16",
                    "batch": "i32"}, {"HEADS": 14, "SPLITS": 2, "HEAD_DIM": 64, "PDL": True},
          num_warps=2, launch_pdl=True)

    partial, choose = race_sampling._kernels()
    for bias in (False, True):  # with and without suppressed tokens
        build(partial, {"logits_ptr": "*bf16", "seed_ptr": "*i64", "best_ptr": "*fp32",
                        "bias_ptr": "*fp32", "row_stride": "i32", "vocab": "i32",
                        "chunks": "i32", "inverse_t": "fp32"},
              {"CHUNK": race_sampling.CHUNK, "BLOCK": race_sampling.BLOCK, "BIAS": bias},
              num_warps=4)
    for parts_pad in (64, 4096):  # the race's chunks, the head sampler's tiles
        build(choose, {"partials_ptr": "*fp32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32",
                       "parts": "i32"}, {"PARTS_PAD": parts_pad, "PDL": True}, num_warps=4)

    tiles = decode_mlp.choose_tiles(896)
    build(decode_mlp._kernels(), {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "rows": "i32", "ffn": "i32",
        "depth": "i32", "x_stride": "i32", "w_stride": "i32",
    }, {"BLOCK_M": 64, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "EVEN_K": True,
        "EVEN_N": True, "UPCAST": False, "PDL": True}, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, launch_pdl=True)

    skinny = decode_linear._kernels()
    linear_types = {"b_ptr": "*bf16", "rows": "i32", "columns": "i32", "depth": "i32",
                    "x_stride": "i32"}
    for columns, depth, may_split, bias in ((1152, 896, False, True), (1152, 896, None, False),
                                            (896, 896, True, False), (896, 4864, True, False)):
        linear_tiles = (decode_linear.choose_qkv_tiles(columns, depth, 132)  # the chain's QKV
                        if may_split is None else
                        decode_linear.choose_linear_tiles(columns, depth, 132,
                                                          may_split=may_split))
        partial = linear_tiles.splits(depth) > 1
        block_k = linear_tiles.block_k
        # per-thread loads, tensor descriptors; a preloaded share: per-thread loads only
        for descriptors in ((False,) if linear_tiles.preload else (False, True)):
            sources = ({"x_source": f"tensordesc<bf16[64, {block_k}]>",
                        "w_source": f"tensordesc<bf16[{linear_tiles.block_n}, {block_k}]>"}
                       if descriptors else {"x_source": "*bf16", "w_source": "*bf16"})
            build(skinny, {**linear_types, **sources,
                           "out_ptr": "*fp32" if partial else "*bf16"}, {
                "BLOCK_M": 64, "BLOCK_N": linear_tiles.block_n, "BLOCK_K": block_k,
                "K_SPLIT": linear_tiles.k_split, "HAS_BIAS": bias, "PARTIAL": partial,
                "UPCAST": False, "PDL": True, "DESCRIPTORS": descriptors,
                "PRELOAD": linear_tiles.preload},
                num_warps=linear_tiles.num_warps,
                num_stages=1 if linear_tiles.preload else linear_tiles.num_stages,
                launch_pdl=True)
    norm_types = {"residual_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                  "rows": "i32", "hidden": "i32", "eps": "fp32"}
    for update, parts, gather in (("*fp32", 8, False), ("*bf16", 0, False),
                                  ("*bf16", 0, True)):  # the embedding lookup's norm
        build(decode_norm._kernels(), {**norm_types, "update_ptr": update, "ids_ptr": "*i64"},
              {"PARTS": parts, "GATHER": gather, "BLOCK_H": 1024, "PDL": True}, num_warps=4,
              launch_pdl=True)

    rotary, activation = prefill_kernels._kernels()
    for heads in (14, 2):  # queries, keys
        build(rotary, {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                       "positions_ptr": "*i64", "out_ptr": "*bf16", "x_stride": "i32",
                       "table_stride": "i32"},
              {"HEADS": heads, "HEADS_PAD": 16 if heads == 14 else 2, "HEAD_DIM": 64},
              num_warps=4)
    build(activation, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "ffn": "i32",
                       "row_stride": "i32"}, {"BLOCK": prefill_kernels.ACTIVATION_BLOCK},
          num_warps=4)

    build(step_record._kernels(), {
        "tokens_ptr": "*i64", "logprobs_ptr": "*fp32", "done_ptr": "*i1",
        "generated_ptr": "*i64", "window_tokens_ptr": "*i64", "window_logprobs_ptr": "*fp32",
        "window_valid_ptr": "*i1", "window_stride": "i32", "input_ids_ptr": "*i64",
        "positions_ptr": "*i64", "eos_ptr": "*i64", "eos_count": "i32", "seed_ptr": "*i64",
        "rows": "i32", "max_new_tokens": "i32", "max_position": "i32",
    }, {"ADVANCE_SEED": True, "BLOCK": step_record.BLOCK, "PDL": True}, num_warps=4)

    for bias in (False, True):
        build(head_sampling._kernels(), {
            "h_ptr": "*bf16", "w_ptr": "*bf16", "seed_ptr": "*i64", "stats_ptr": "*fp32",
            "bias_ptr": "*fp32", "rows": "i32", "vocab": "i32", "depth": "i32",
            "h_stride": "i32", "tiles": "i32", "inverse_t": "fp32",
        }, {"BLOCK_M": 64, "QUARTER": head_sampling.TILE // 4,
            "BLOCK_K": head_sampling.BLOCK_K, "UPCAST": False, "FAST_LOG": True, "PDL": True,
            "BIAS": bias}, num_warps=head_sampling.NUM_WARPS,
            num_stages=head_sampling.NUM_STAGES)


if __name__ == "__main__":
    compile_all()
