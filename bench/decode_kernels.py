"""Decode-step kernels one at a time: the fused kernels against the stock operations.

At the shapes of one decode step of a Qwen2.5-shaped model (``--size``) at ``--batch``
rows, bf16, on CUDA:

- attention: :func:`reasonctl.rollout.kernels.decode_attention.decode_attention` (rotary, cache
  store, attention bounded by each row's length) at several ``splits`` against the stock
  path it replaces (rotary, indexed cache stores, SDPA over the whole cache with a mask),
  for rows of mixed lengths up to ``--max-len``;
- sampling: :func:`reasonctl.rollout.kernels.race_sampling.race_sample` against drawing the noise
  and running :func:`reasonctl.rollout.sampling.exponential_race`, eager and compiled;
- mlp: :func:`reasonctl.rollout.kernels.decode_mlp.gated_silu` (at its chosen tiles and a sweep
  of others) against ``F.linear`` followed by the compiled SwiGLU activation. Each timed
  call reads a different copy of the weight (as many copies as ``--repeat``), so the
  weights come from memory, not from the L2 cache, as they do in a decode step.

Each variant is first checked against the reference, then timed as a CUDA graph of
``--repeat`` calls (so launch overhead is that of a decode step's graph), median of
``--trials`` replays. Prints a table and a JSON summary as the last line.

    python -m bench.decode_kernels --size 0.5b --batch 64 --max-len 640
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.common import emit, environment, log

SHAPES = {  # hidden, ffn, heads, kv_heads, vocab
    "0.5b": (896, 4864, 14, 2, 151936),
    "1.5b": (1536, 8960, 12, 2, 151936),
}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=640)
    parser.add_argument("--repeat", type=int, default=24)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--parts", default="attention,sampling,mlp",
                        help="Comma-separated kernels to check and time.")
    return parser.parse_args()


def time_graph(fn: Callable[[], Any], repeat: int, trials: int) -> float:
    """Median microseconds per call of ``fn`` replayed ``repeat`` times in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeat)
    return statistics.median(times)


def attention_case(args: argparse.Namespace, qkv: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, positions: torch.Tensor, heads: int) -> dict[str, Any]:
    """Check, then time, each attention variant for rows at ``positions``."""
    from reasonctl.rollout.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
        default_splits,
        processor_count,
    )

    batch, kv_heads, max_len, head_dim = keys.shape
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=keys.device).float()
                              / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    scale = head_dim ** -0.5
    expected = decode_attention_reference(qkv, cos, sin, positions, keys.clone(),
                                          values.clone(), heads=heads, scale=scale)
    row: dict[str, Any] = {}
    row["stock_us"] = time_graph(lambda: decode_attention_reference(
        qkv, cos, sin, positions, keys, values, heads=heads, scale=scale),
        args.repeat, args.trials)
    for splits in (1, 2, 4, 8):
        got = decode_attention(qkv, cos, sin, positions, keys.clone(), values.clone(),
                               heads=heads, scale=scale, splits=splits)
        row[f"splits{splits}_max_error"] = float((got.float() - expected.float()).abs().max())
        row[f"splits{splits}_us"] = time_graph(
            lambda s=splits: decode_attention(qkv, cos, sin, positions, keys, values,
                                              heads=heads, scale=scale, splits=s),
            args.repeat, args.trials)
    row["default_splits"] = default_splits(batch, kv_heads, max_len,
                                           processor_count(keys.device))
    return row


def attention_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Fused decode attention at several splits against the stock path."""
    hidden, _, heads, kv_heads, _ = SHAPES[args.size]
    head_dim = hidden // heads
    batch, max_len, device = args.batch, args.max_len, torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, device=device,
                      generator=gen).bfloat16()
    keys = torch.randn(batch, kv_heads, max_len, head_dim, device=device,
                       generator=gen).bfloat16()
    values = torch.randn_like(keys)
    results: dict[str, Any] = {}
    for label, positions in (
        ("mixed", torch.randint(128, max_len, (batch,), device=device, generator=gen)),
        ("full", torch.full((batch,), max_len - 1, device=device)),
        ("short", torch.full((batch,), 200, device=device)),
    ):
        row = attention_case(args, qkv, keys, values, positions, heads)
        results[label] = row
        log(f"attention {label}: {row}")
    return results


def sampling_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The two-kernel sampler against noise + exponential race, eager and compiled."""
    from reasonctl.rollout.kernels.race_sampling import race_sample
    from reasonctl.rollout.sampling import exponential_race

    vocab = SHAPES[args.size][4]
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(3)
    logits = torch.randn(args.batch, vocab, device=device, generator=gen).bfloat16()
    seed = torch.tensor([17], device=device)
    compiled_race = torch.compile(exponential_race, dynamic=True)

    def stock(race: Any) -> Any:
        noise = torch.empty(logits.shape, dtype=torch.float32, device=device)
        noise.exponential_()
        return race(logits, noise, 1.0)

    tokens, logprobs = race_sample(logits, 1.0, seed)
    expected = torch.log_softmax(logits.float(), -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    row = {
        "max_logprob_error": float((logprobs - expected).abs().max()),
        "stock_eager_us": time_graph(lambda: stock(exponential_race), args.repeat, args.trials),
        "stock_compiled_us": time_graph(lambda: stock(compiled_race), args.repeat,
                                        args.trials),
        "fused_us": time_graph(lambda: race_sample(logits, 1.0, seed), args.repeat,
                               args.trials),
    }
    log(f"sampling: {row}")
    return row


def mlp_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The gate/up projection and SwiGLU: ``F.linear`` and a compiled activation against
    :func:`~reasonctl.rollout.kernels.decode_mlp.gated_silu` at a sweep of tiles."""
    import torch.nn.functional as F

    from reasonctl.rollout.kernels.decode_mlp import Tiles, choose_tiles, gated_silu

    depth, ffn = SHAPES[args.size][:2]
    columns = 2 * ffn
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(4)
    x = torch.randn(args.batch, depth, device=device, generator=gen).bfloat16()
    weights = [torch.randn(columns, depth, device=device, generator=gen).bfloat16()
               / depth ** 0.5 for _ in range(args.repeat)]
    activation = torch.compile(lambda y: F.silu(y[:, : columns // 2]) * y[:, columns // 2 :])
    calls = iter(range(10**9))

    def pick() -> torch.Tensor:
        return weights[next(calls) % len(weights)]

    expected = activation(F.linear(x, weights[0]))
    row: dict[str, Any] = {"linear_and_activation_us": time_graph(
        lambda: activation(F.linear(x, pick())), args.repeat, args.trials)}
    chosen = choose_tiles(depth)
    candidates = [chosen] + [Tiles(n, k, w, st) for n in (32, 64, 128) for k in (64, 128)
                             for w in (4, 8) for st in (3, 4) if n * k <= 8192]
    timings = []
    for tiles in candidates:
        try:
            error = float((gated_silu(x, weights[0], tiles).float()
                           - expected.float()).abs().max())
            micros = time_graph(lambda t=tiles: gated_silu(x, pick(), t), args.repeat,
                                args.trials)
        except Exception as exc:  # a setting that does not fit is skipped
            log(f"gated {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        timings.append((micros, tiles, error))
    row["chosen"] = {"tiles": str(chosen), "us": timings[0][0], "max_error": timings[0][2]}
    timings.sort(key=lambda item: item[0])
    row["best"] = [{"tiles": str(t), "us": us, "max_error": err} for us, t, err in timings[:6]]
    log(f"mlp gate_up_silu: {row}")
    return row


def main() -> None:
    """Time each kernel and print the comparison."""
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_kernels needs a CUDA device")
    summary: dict[str, Any] = {"bench": "decode_kernels", "size": args.size,
                               "batch": args.batch, "max_len": args.max_len, **environment()}
    parts = {"attention": attention_bench, "sampling": sampling_bench, "mlp": mlp_bench}
    chosen = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {sorted(parts)}")
    with torch.inference_mode():
        for part in chosen:
            summary[part] = parts[part](args)
    emit(summary)


if __name__ == "__main__":
    main()
