"""Rollout throughput: reasonctl's embedded engine against ``transformers`` ``generate``.

Both sample from the same random Qwen2.5-shaped model (bf16 weights, the ``single``
backend's module, which the ``hf`` engine shares as it does in GRPO) on the same random
prompts: ``--prompts`` prompts of ``--prompt-len`` tokens, ``--new-tokens`` new tokens
each, temperature 1, no top-k/top-p. Each side warms up untimed (compilation, graph
capture: the engine runs twice, since it captures a prefill's graph the second time it
sees the prefill's shape, ``generate`` once), then the engine runs ``--repeats`` times
(its figure is the median rollout's) and ``generate`` once; tokens/s counts generated
tokens (up to and including an end token) over wall time.

Also reported:

- greedy parity: the engine with temperature 0 against ``generate(do_sample=False)`` on
  ``--parity-prompts`` prompts (identical ids, or the first position that differs);
- the sampled log-prob gap: the engine's log-prob of each sampled token against the
  trainer's recomputation (``backend.token_outputs``), the ``rollout/logprob_gap`` of GRPO.

    python -m bench.rollout                    # static KV cache + CUDA graphs (default)
    python -m bench.rollout --compile          # ... with the decode step compiled
    python -m bench.rollout --decode dynamic   # the per-token dynamic-cache loop
    python -m bench.rollout --no-pdl           # one part of the fast path switched off

Switches such as ``--no-pdl`` or ``--hf-prefill`` build the engine with a
:class:`reasonctl.rollout.DecodeOptions` that turns that part off.

The summary's ``reasonctl.decode`` says which path ran (``static+cuda_graphs``,
``static`` or ``dynamic``).

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    build_model_dir,
    build_rollout_engine,
    emit,
    environment,
    free_memory,
    log,
    now,
    random_rows,
    reasonctl_backend,
)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--parity-prompts", type=int, default=4)
    parser.add_argument("--parity-tokens", type=int, default=64)
    parser.add_argument("--gap-rows", type=int, default=16,
                        help="Sampled completions whose log-probs are recomputed.")
    parser.add_argument("--decode", default="static", choices=["static", "dynamic"],
                        help="The hf engine's decode path ([rollout.hf] decode).")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="Run the static decode step eagerly ([rollout.hf] cuda_graphs).")
    parser.add_argument("--compile", action="store_true",
                        help="Compile the static decode step ([rollout.hf] compile).")
    parser.add_argument("--stock-kernels", action="store_true",
                        help="Stock torch attention, gate/up and sampling in the decode step "
                        "instead of the fused Triton kernels ([rollout.hf] fused_kernels = false).")
    parser.add_argument("--max-autotune", action="store_true",
                        help="With --compile, let the compiler autotune matmul kernels.")
    parser.add_argument("--profile", action="store_true",
                        help="Print the GPU kernel time table of one extra short rollout.")
    parser.add_argument("--breakdown", action="store_true",
                        help="Also time the parts of one decode step at the full batch: the "
                        "forward graph alone, the sampler alone.")
    parser.add_argument("--phases", action="store_true",
                        help="Also run one rollout with the time of its phases recorded "
                        "(prefill, host synchronisation and hand-over, detokenising, the "
                        "rest is decode steps); synchronises around each, so slightly slower.")
    parser.add_argument("--stock-mlp", action="store_true",
                        help="The gate/up matmul and a separate activation instead of the "
                        "fused gate/up kernel (the other fused kernels stay).")
    parser.add_argument("--no-chain", action="store_true",
                        help="Library matmuls and the model's norms instead of the kernel "
                        "chain (the fused attention and gate/up kernels stay).")
    parser.add_argument("--no-pdl", action="store_true",
                        help="Launch the kernel chain's kernels ordinarily instead of as "
                        "programmatic dependent launches.")
    parser.add_argument("--no-descriptors", action="store_true",
                        help="Per-thread loads in the kernel chain's matmuls instead of "
                        "tensor-descriptor (bulk copy) loads.")
    parser.add_argument("--hf-prefill", action="store_true",
                        help="Prefill prompts with the Hugging Face forward pass instead of "
                        "the decode step's dedicated prefill.")
    parser.add_argument("--no-head-sampling", action="store_true",
                        help="Write logits and sample them (two kernels) instead of applying "
                        "the output head inside the sampler.")
    parser.add_argument("--sync-every", type=int, default=0,
                        help="Decode steps between host synchronisations "
                        "(DecodeOptions.sync_every; 0 keeps its default).")
    parser.add_argument("--repeats", type=int, default=5,
                        help="Timed rollouts of the engine (seeds 1, 2, ...); tokens/s is "
                        "that of the median rollout, every run's figure is listed too.")
    parser.add_argument("--skip-generate", action="store_true",
                        help="Skip the sampled transformers baseline (slow).")
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def engine_config(ctx_values: dict[str, Any], max_batch_size: int,
                  args: argparse.Namespace) -> dict[str, Any]:
    """``[rollout]`` values for the ``hf`` engine with room for every sequence at once."""
    engine = {"max_batch_size": max_batch_size, "decode": args.decode,
              "cuda_graphs": not args.no_cuda_graphs, "compile": args.compile,
              "fused_kernels": not args.stock_kernels}
    return {**ctx_values, "hf": engine}


def decode_options(args: argparse.Namespace) -> Any:
    """The engine's :class:`~reasonctl.rollout.DecodeOptions`: the fast path with the
    parts the command line switches off."""
    from reasonctl.rollout import DecodeOptions

    default = DecodeOptions()
    return replace(default, fused_mlp=not args.stock_mlp, kernel_chain=not args.no_chain,
                   programmatic_launches=not args.no_pdl,
                   tensor_descriptors=not args.no_descriptors,
                   dedicated_prefill=not args.hf_prefill,
                   head_sampling=not args.no_head_sampling,
                   sync_every=args.sync_every or default.sync_every)


def sampling(new_tokens: int, *, temperature: float, seed: int) -> Any:
    """Plain sampling parameters (no top-k/top-p), one completion per prompt."""
    from reasonctl.core.types import SamplingParams

    return SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=0,
                          max_new_tokens=new_tokens, seed=seed)


def engine_generate(engine: Any, prompts: list[list[int]], params: Any
                    ) -> tuple[list[Any], float]:
    """Completions of ``prompts`` (one each) and the wall time."""
    started = now()
    groups = engine.generate([{"input_ids": p} for p in prompts], params)
    return [g[0] for g in groups], now() - started


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, *, sample: bool,
                eos: int, pad: int) -> tuple[list[list[int]], float]:
    """``model.generate`` on equal-length prompts; returns new ids (cut after an end token)."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    options: dict[str, Any] = {"do_sample": sample, "max_new_tokens": new_tokens,
                               "eos_token_id": eos, "pad_token_id": pad}
    if sample:
        options.update(temperature=1.0, top_k=0, top_p=1.0)
    started = now()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
    elapsed = now() - started
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows, elapsed


def parity(engine_ids: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Per prompt: equal, or the first position where the greedy ids differ."""
    first_diffs = []
    for a, b in zip(engine_ids, reference, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        first_diffs.append(diff)
    return {"identical": sum(d is None for d in first_diffs), "prompts": len(first_diffs),
            "first_diff": first_diffs}


def greedy_parity(engine: Any, model: Any, prompts: list[list[int]], args: argparse.Namespace,
                  *, eos: int, pad: int) -> dict[str, Any]:
    """The engine at temperature 0 against ``generate(do_sample=False)``."""
    chosen = prompts[: args.parity_prompts]
    greedy, _ = engine_generate(engine, chosen,
                                sampling(args.parity_tokens, temperature=0.0, seed=0))
    reference, _ = hf_generate(model, chosen, args.parity_tokens, sample=False, eos=eos,
                               pad=pad)
    result = parity([list(c.token_ids) for c in greedy], reference)
    log(f"greedy parity ({next(model.parameters()).dtype}): {result}")
    return result


def logprob_gap(backend: Any, prompts: list[list[int]], completions: list[Any]
                ) -> dict[str, float]:
    """Engine log-probs of sampled tokens against the trainer's recomputation."""
    from reasonctl.data.collate import collate
    from reasonctl.data.processing import EncodedSample

    samples = [EncodedSample(p + list(c.token_ids), [0] * len(p) + [1] * len(c.token_ids))
               for p, c in zip(prompts, completions, strict=True)]
    batch = collate(samples, pad_id=0)
    trainer = backend.token_outputs(batch).logprobs.float().cpu()
    gaps = []
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start = len(prompt) - 1
        recomputed = trainer[row, start : start + len(completion.token_ids)]
        gaps.append((torch.tensor(completion.logprobs) - recomputed).abs())
    flat = torch.cat(gaps)
    return {"max_abs": float(flat.max()), "mean_abs": float(flat.mean())}


def profile(engine: Any, prompts: list[list[int]]) -> None:
    """Kernel time table (top 45 by device time) of a 64-token rollout of ``prompts``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        engine_generate(engine, prompts, sampling(64, temperature=1.0, seed=3))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    log(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90))


def rollout_phases(engine: Any, prompts: list[list[int]], new_tokens: int
                   ) -> dict[str, float]:
    """Milliseconds spent in each phase of one rollout of ``prompts``: the prefill calls,
    the synchronisations with their hand-over of tokens to the rows, the completions'
    detokenising, and the total (the remainder is the decode steps)."""
    import time

    from reasonctl.rollout.static.run import DecodeRun

    spent = {"prefill_ms": 0.0, "collect_ms": 0.0, "detokenise_ms": 0.0}
    originals = {}

    def timed(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            torch.cuda.synchronize()
            spent[key] += (time.perf_counter() - started) * 1e3
            return result

        setattr(owner, name, wrapper)

    decoder = engine.static_decoder
    timed(DecodeRun, "_prefill", "prefill_ms")
    timed(DecodeRun, "_collect", "collect_ms")
    timed(decoder, "decode_many", "detokenise_ms")
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine_generate(engine, prompts, sampling(new_tokens, temperature=1.0, seed=4))
        torch.cuda.synchronize()
        spent["total_ms"] = (time.perf_counter() - started) * 1e3
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    spent["decode_steps_ms"] = spent["total_ms"] - sum(
        v for k, v in spent.items() if k != "total_ms")
    return spent


def _time_part(name: str, fn: Any, repeat: int) -> dict[str, float]:
    """Device and wall microseconds per call of ``fn`` run ``repeat`` times back to back."""
    import time

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.perf_counter()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return {f"{name}_us": start.elapsed_time(end) * 1000 / repeat,
            f"{name}_wall_us": (time.perf_counter() - wall) * 1e6 / repeat}


def _chain_uses_descriptors(step: Any) -> bool:
    """True when the kernel chain's matmuls load through tensor descriptors."""
    if step is None or not step.chain or step.descriptors is False \
            or not torch.cuda.is_available():
        return False
    from reasonctl.rollout.kernels.decode_linear import uses_descriptors

    weight = step.layers[0].down
    x = torch.empty((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return uses_descriptors(x, weight)


def step_breakdown(engine: Any, batch: int, repeat: int = 200) -> dict[str, float]:
    """Microseconds per call of the decode step's forward graph and of its sampler at
    ``batch`` rows, each run ``repeat`` times back to back (device time from CUDA events,
    and wall time including the host's launches)."""
    from reasonctl.rollout.kernels.head_sampling import MAX_ROWS as HEAD_SAMPLE_ROWS
    from reasonctl.rollout.kernels.head_sampling import head_sample
    from reasonctl.rollout.kernels.race_sampling import race_sample
    from reasonctl.rollout.sampling import sample_tokens

    decoder = engine.static_decoder
    if decoder is None or decoder.graphs is None or not torch.cuda.is_available():
        return {}
    logits = decoder.buffers.logits[:batch]
    seed = torch.tensor([5], device=logits.device)
    generator = torch.Generator(logits.device).manual_seed(5)
    parts = {
        "forward_graph": lambda: decoder.graphs.run(batch, True),
        "sample_fused": lambda: race_sample(logits, 1.0, seed),
        "sample_stock": lambda: sample_tokens(logits, temperature=1.0, generator=generator,
                                              race=decoder.race),
    }
    step = decoder.decode_forward
    if step is not None and batch <= HEAD_SAMPLE_ROWS:
        hidden = decoder.buffers.hidden[:batch]
        parts["forward_graph_no_head"] = lambda: decoder.graphs.run(batch, False)
        parts["head_sample"] = lambda: head_sample(hidden, step.lm_head, 1.0, seed)
    result = {}
    for name, fn in parts.items():
        with torch.inference_mode():  # a graph captured here reads the engine's buffers
            result.update(_time_part(name, fn, repeat))
    return result


def main() -> None:
    """Run the engine and the baseline and print the comparison."""
    args = parse_args()
    if args.max_autotune:
        import torch._inductor.config as inductor_config

        inductor_config.max_autotune_gemm = True
    options = decode_options(args)
    out = Path(args.out)
    model_dir = build_model_dir(out / "models", args.size)
    prompts = random_rows(args.prompts, args.prompt_len, seed=2)
    backend, ctx = reasonctl_backend(model_dir, out / "run" / "rollout", values={
        "model": {"max_length": args.prompt_len + args.new_tokens},
        "backend": {"single": {"param_dtype": "compute"}},
        "rollout": engine_config({"engine": "hf"}, args.prompts, args),
    })
    engine = build_rollout_engine(ctx, options)
    eos = int(backend.hf_model.config.eos_token_id)
    pad = int(backend.hf_model.config.pad_token_id)
    summary: dict[str, Any] = {"bench": "rollout", "size": args.size, "prompts": args.prompts,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                               **environment()}

    log("--- reasonctl engine (warm-up, then timed)")
    warm_started = now()
    for _ in range(2):  # the second captures the prefill's graph
        engine_generate(engine, prompts, sampling(args.new_tokens, temperature=1.0, seed=0))
    summary["reasonctl_warmup_s"] = now() - warm_started
    log(f"warm-up: {summary['reasonctl_warmup_s']:.1f} s")
    def rate(run: tuple[float, list[Any]]) -> float:
        return sum(len(c.token_ids) for c in run[1]) / run[0]

    runs = []
    for repeat in range(max(1, args.repeats)):
        completions, seconds = engine_generate(
            engine, prompts, sampling(args.new_tokens, temperature=1.0, seed=1 + repeat))
        runs.append((seconds, completions))
    seconds, completions = sorted(runs, key=rate)[len(runs) // 2]  # the median rate
    tokens = sum(len(c.token_ids) for c in completions)
    decoder = getattr(engine, "static_decoder", None)
    step = getattr(decoder, "decode_forward", None)
    summary["reasonctl"] = {"decode": engine.last_stats.decode, "compile": args.compile,
                            "fused_attention": bool(getattr(step, "fused_attention", False)),
                            "fused_mlp": bool(getattr(step, "fused_mlp", False))
                            and options.fused_mlp,
                            "chain": bool(getattr(step, "chain", False))
                            and getattr(step, "chain_rows", 0) > 0,
                            "pdl": bool(getattr(step, "pdl", False)),
                            "descriptors": _chain_uses_descriptors(step),
                            "dedicated_prefill": step is not None and step.prefills,
                            "max_autotune": args.max_autotune,
                            "tokens": tokens, "seconds": seconds,
                            "tokens_per_s": tokens / seconds,
                            "runs_tokens_per_s": [rate(run) for run in runs],
                            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9
                            if torch.cuda.is_available() else 0.0}
    log(f"reasonctl ({engine.last_stats.decode} decode): {tokens} tokens in {seconds:.2f} s "
        f"= {tokens / seconds:.0f} tok/s (median of {len(runs)} rollouts: "
        f"{', '.join(f'{r:.0f}' for r in summary['reasonctl']['runs_tokens_per_s'])})")
    if args.profile:
        profile(engine, prompts)
    if args.breakdown:
        summary["step_breakdown"] = step_breakdown(engine, args.prompts)
        summary["step_us"] = seconds / args.new_tokens * 1e6
        log(f"one decode step {summary['step_us']:.0f} us (prefill included); parts: "
            f"{summary['step_breakdown']}")
    if args.phases and torch.cuda.is_available() and engine.static_decoder is not None:
        summary["phases"] = rollout_phases(engine, prompts, args.new_tokens)
        log(f"rollout phases: {summary['phases']}")
    summary["logprob_gap"] = logprob_gap(backend, prompts[: args.gap_rows],
                                         completions[: args.gap_rows])
    log(f"sampled log-prob gap vs trainer: {summary['logprob_gap']}")

    summary["greedy_parity"] = {"bfloat16": greedy_parity(engine, backend.hf_model,
                                                           prompts, args, eos=eos, pad=pad)}

    if not args.skip_generate:
        log("--- transformers generate (warm-up, then timed)")
        free_memory()
        hf_generate(backend.hf_model, prompts, 8, sample=True, eos=eos, pad=pad)
        log("generate warm-up done")
        rows, hf_seconds = hf_generate(backend.hf_model, prompts, args.new_tokens, sample=True,
                                       eos=eos, pad=pad)
        hf_tokens = sum(len(r) for r in rows)
        summary["generate"] = {"tokens": hf_tokens, "seconds": hf_seconds,
                               "tokens_per_s": hf_tokens / hf_seconds}
        summary["speedup"] = summary["reasonctl"]["tokens_per_s"] / (hf_tokens / hf_seconds)
        log(f"generate: {hf_tokens} tokens in {hf_seconds:.2f} s = "
            f"{hf_tokens / hf_seconds:.0f} tok/s; reasonctl is {summary['speedup']:.1f}x")
    backend.close()
    free_memory()
    # random weights give nearly flat logits, so bf16 rounding alone can flip a greedy
    # choice; float32 weights separate implementation differences from rounding
    backend, ctx = reasonctl_backend(model_dir, out / "run" / "rollout-fp32", values={
        "model": {"max_length": args.prompt_len + args.new_tokens, "dtype": "float32"},
        "backend": {"single": {"param_dtype": "compute"}},
        "rollout": engine_config({"engine": "hf"}, args.prompts, args),
    })
    summary["greedy_parity"]["float32"] = greedy_parity(
        build_rollout_engine(ctx, options), backend.hf_model, prompts, args, eos=eos, pad=pad)
    backend.close()
    emit(summary)


if __name__ == "__main__":
    main()
