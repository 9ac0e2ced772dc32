"""Context parallelism: the longest trainable SFT row and tokens/s at cp = 1, 2, 4.

Every measurement is a real ``python -m reasonctl run --nproc-per-node N`` (FSDP2 backend,
``backend.fsdp.cp`` = each of ``--cp``, bf16 compute, gradient checkpointing, the random
Qwen2.5-shaped model of ``--size`` with the word tokenizer of :mod:`bench.common`). A step
trains one row of ``seq`` tokens per data-parallel rank (global batch = N / cp rows), so
at cp = 4 on 4 GPUs the four GPUs share one row. For each cp the ladder ``--seqs`` is run
shortest first until a run fails (out of memory, usually) or ``--timeout`` passes; the
longest row that trained is that cp's *longest trainable sequence*, and tokens/s (tokens
per step x timed steps / their summed ``step_time_s``, after ``--warmup`` steps) is
reported for every row length that trained, next to the cp = 1 figure at that length.

Four GPUs, 7B shape (an estimated 2-3 minutes per command, mostly model start-up; the
random model is written once under ``--out`` and reused)::

    python -m bench.context_parallel --cp 1 --seqs 16384,32768
    python -m bench.context_parallel --cp 2 --seqs 32768,65536
    python -m bench.context_parallel --cp 4 --seqs 65536,131072

CPU smoke run (gloo, tiny model, two processes)::

    python -m bench.context_parallel --device cpu --size tiny --gpus 2 --cp 1,2 \\
        --seqs 64,128 --steps 2 --warmup 1

The log goes to stderr; the last line on stdout is a JSON summary (also
``<out>/summary.json``) with every command that ran. Exit code 1 when no row trained at
some cp.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import emit, log
from bench.multi_gpu import (
    SFT_PROMPT_WORDS,
    SFT_TEMPLATE_TOKENS,
    Runner,
    base_values,
    prepare,
    run_record,
    timed_rows,
    write_sft_data,
    write_toml,
)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4, help="Processes (one GPU each).")
    parser.add_argument("--cp", default="1,2,4", help="Context-parallel sizes to measure.")
    parser.add_argument("--seqs", default="8192,16384,32768,65536",
                        help="Row lengths in tokens, tried shortest first for each cp.")
    parser.add_argument("--size", default="7b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="Untimed first steps.")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default="outputs/bench_context_parallel")
    parser.add_argument("--timeout", type=int, default=600, help="Seconds per run at most.")
    parser.add_argument("--launcher", default="cli", choices=["cli", "torchrun"])
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        metavar="KEY=VALUE", help="Extra config override for every run.")
    args = parser.parse_args()
    args.cp = sorted({int(c) for c in args.cp.split(",") if c})
    args.seqs = sorted({int(s) for s in args.seqs.split(",") if s})
    bad = [c for c in args.cp if c < 1 or args.gpus % c]
    if bad:
        parser.error(f"--cp {bad} must divide --gpus {args.gpus}")
    if not args.seqs or args.seqs[0] < SFT_PROMPT_WORDS + SFT_TEMPLATE_TOKENS + 2:
        parser.error("--seqs must be at least 16 tokens")
    return args


def run_values(args: argparse.Namespace, data: Path, cp: int) -> dict[str, Any]:
    """The config of one run at ``cp``: one row per data-parallel rank and step."""
    rows = args.gpus // cp
    return {
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}, "shuffle": False},
        "train": {"global_batch_size": rows, "micro_batch_size": 1, "max_steps": args.steps,
                  "lr": args.lr, "compile": False},
        "model": {"gradient_checkpointing": True, "max_length": max(args.seqs)},
        "backend": {"fsdp": {"cp": cp}},
    }


def measure(runner: Runner, args: argparse.Namespace, config: Path, cp: int, seq: int
            ) -> dict[str, Any]:
    """One run at ``cp`` with rows of ``seq`` tokens: tokens/s and peak memory."""
    data = write_sft_data(Path(args.out) / "data" / f"rows_{seq}.jsonl",
                          rows=args.gpus * args.steps, seq=seq, seed=seq)
    run = runner.run(f"cp{cp}_seq{seq}", config, args.gpus, run_values(args, data, cp))
    out = {"cp": cp, "seq": seq, **run_record(run)}
    rows = run["rows"]
    out["ok"] = run["rc"] == 0 and len(rows) == args.steps
    if not out["ok"]:
        return out
    timed = timed_rows(rows, args.warmup)
    tokens = (args.gpus // cp) * seq
    seconds = sum(float(r["step_time_s"]) for r in timed)
    out.update(tokens_per_step=tokens, timed_steps=len(timed),
               tokens_per_s=round(tokens * len(timed) / seconds, 1),
               step_time_s=round(seconds / len(timed), 3),
               peak_mem_gb=max((float(r["peak_mem_gb"]) for r in rows if "peak_mem_gb" in r),
                               default=None),
               loss=rows[-1].get("loss"))
    return out


def main() -> int:
    """Run the ladder for every cp and print the summary."""
    args = parse_args()
    info = prepare(args, {args.size})
    model_dir = info["models"][args.size]
    config = write_toml(Path(args.out) / "configs" / "sft.toml", base_values(model_dir, args))
    runner = Runner(args)
    results: list[dict[str, Any]] = []
    longest: dict[int, int | None] = {}
    for cp in args.cp:
        longest[cp] = None
        for seq in args.seqs:
            result = measure(runner, args, config, cp, seq)
            results.append(result)
            if not result["ok"]:
                log(f"cp={cp}: rows of {seq} tokens did not train (rc {result['rc']}); "
                    "stopping this ladder")
                break
            longest[cp] = seq
            log(f"cp={cp} seq={seq}: {result['tokens_per_s']:.0f} tokens/s, "
                f"{result['step_time_s']} s/step, peak {result['peak_mem_gb']} GB")
    base = {r["seq"]: r["tokens_per_s"] for r in results if r["cp"] == args.cp[0] and r["ok"]}
    for result in results:
        if result["ok"] and result["seq"] in base and result["cp"] != args.cp[0]:
            result[f"speedup_vs_cp{args.cp[0]}"] = round(
                result["tokens_per_s"] / base[result["seq"]], 3)
    summary = {
        "bench": "context_parallel", "size": args.size, "gpus": args.gpus,
        "device": args.device, "env": info["env"],
        "longest_trainable_seq": {str(cp): seq for cp, seq in longest.items()},
        "runs": results, "prepare_command": info["command"],
    }
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    emit(summary)
    return 0 if all(seq is not None for seq in longest.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
