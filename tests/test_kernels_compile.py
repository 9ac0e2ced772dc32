"""The decode step's Triton kernels compile for a Hopper GPU (sm_90) with the shapes and
tile settings the engine uses for a Qwen2.5-0.5B-shaped model, and fit its shared memory.

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
    assert len(lines) == 8, proc.stdout  # every variant built below
    for line in lines:
        shared = int(line.rsplit(" ", 1)[1])
        assert shared <= SHARED_MEMORY_LIMIT, line


def compile_all() -> None:
    """Compile every kernel variant the engine launches (printed one per line)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from reasonctl.rollout import decode_attention, decode_mlp, race_sampling

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, types: dict, constexprs: dict, **options) -> None:
        names = kernel.arg_names
        signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(k),): v for k, v in constexprs.items()})
        compiled = triton.compile(source, target=target, options=options)
        print(f"compiled {kernel.fn.__name__} {compiled.metadata.shared}")

    attend, combine = decode_attention._kernels()
    for dtype, splits, norm in (("bf16", 1, False), ("bf16", 2, False), ("bf16", 2, True),
                                ("fp32", 2, True)):
        build(attend, {
            "qkv_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}",
            "positions_ptr": "*i64", "key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}",
            "q_norm_ptr": f"*{dtype}", "k_norm_ptr": f"*{dtype}", "norm_eps": "fp32",
            "out_ptr": f"*{dtype}", "partial_ptr": "*fp32", "stats_ptr": "*fp32",
            "scale_log2": "fp32", "max_len": "i32", "qkv_stride": "i32", "table_stride": "i32",
        }, {"HEADS": 14, "KV_HEADS": 2, "GROUP": 7, "GROUP_PAD": 16, "HEAD_DIM": 64,
            "BLOCK_N": 64, "SPLITS": splits, "HAS_NORM": norm, "UPCAST": dtype == "fp32"},
            num_warps=4)
    build(combine, {"partial_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16",
                    "batch": "i32"}, {"HEADS": 14, "SPLITS": 2, "HEAD_DIM": 64}, num_warps=2)

    partial, choose = race_sampling._kernels()
    build(partial, {"logits_ptr": "*bf16", "seed_ptr": "*i64", "best_ptr": "*fp32",
                    "row_stride": "i32", "vocab": "i32", "chunks": "i32", "inverse_t": "fp32"},
          {"CHUNK": race_sampling.CHUNK, "BLOCK": race_sampling.BLOCK}, num_warps=4)
    build(choose, {"logits_ptr": "*bf16", "best_ptr": "*fp32", "tokens_ptr": "*i64",
                   "logprobs_ptr": "*fp32", "row_stride": "i32", "chunks": "i32",
                   "inverse_t": "fp32"}, {"CHUNKS_PAD": 64}, num_warps=1)

    tiles = decode_mlp.choose_tiles(896)
    build(decode_mlp._kernels(), {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "rows": "i32", "ffn": "i32",
        "depth": "i32", "x_stride": "i32", "w_stride": "i32",
    }, {"BLOCK_M": 64, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "EVEN_K": True,
        "EVEN_N": True, "UPCAST": False}, num_warps=tiles.num_warps, num_stages=tiles.num_stages)

if __name__ == "__main__":
    compile_all()
