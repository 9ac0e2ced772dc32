"""GRPO step time as users run it: ``reasonctl run --algo grpo`` against TRL's GRPOTrainer.

The workload of :mod:`bench.grpo` (random Qwen2.5-shaped model with identical bf16 weights,
``--prompts-per-step`` prompts x ``--group`` completions, prompts of 128 tokens, up to
``--max-new-tokens`` sampled at temperature 1, the rule reward
``bench.common:even_word_reward``, group-normalised advantages, token-mean clipped loss, no
KL, one optimizer step per rollout, bf16 weights), but reasonctl's side is a real
``python -m reasonctl run --algo grpo --config <file>`` in its own process, timed from its
``metrics.jsonl`` (``step_time_s`` of the steps after ``--warmup``). TRL's side is
:func:`bench.grpo.run_trl` in this process.

    python -m bench.cli_grpo --size 0.5b
    python -m bench.cli_grpo --size tiny --steps 3 --max-new-tokens 16 --impls reasonctl

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import CliRun, build_model_dir, emit, environment, log, tokenizer_dir
from bench.grpo import prompt_texts, run_trl


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--impls", default="reasonctl,trl")
    parser.add_argument("--steps", type=int, default=12, help="reasonctl steps (incl. warm-up).")
    parser.add_argument("--trl-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default="outputs/bench_cli_grpo")
    return parser.parse_args()


def run_reasonctl(model_dir: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``reasonctl run --algo grpo`` with a config file; step time from its metrics."""
    data = out / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    texts = prompt_texts(args.prompts_per_step * args.steps)
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    run_dir = out / "reasonctl"
    config = {
        "run": {"name": "bench_cli_grpo", "output_dir": str(run_dir), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "dtype": "bfloat16", "max_length": 4096},
        "data": {"format": "jsonl", "shuffle": False, "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {
            "prompts_per_step": args.prompts_per_step, "loss_aggregation": "token-mean",
            "scale_rewards": "group", "kl_beta": 0.0}},
        "rollout": {"engine": "hf", "n": args.group, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "max_new_tokens": args.max_new_tokens},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": args.lr, "max_steps": args.steps, "micro_batch_size": args.micro_batch,
                  "schedule": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0,
                  "compile": not args.no_compile},
        "backend": {"name": "single", "single": {"param_dtype": "compute"}},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    run = CliRun("grpo", config, out / "reasonctl.toml", run_dir)
    if not run.ok:
        return run.failure()
    rows = run.rows

    def mean(key: str) -> float | None:
        return run.mean(key, args.warmup)

    return {"ok": True, "command": " ".join(run.command), "wall_s": run.wall_s,
            "step_s": mean("step_time_s"), "rollout_s": mean("time/rollout_s"),
            "update_s": mean("time/update_s"), "rollout_tokens_per_s": mean(
                "rollout/tokens_per_s"), "response_length": mean("response_length/mean"),
            "rewards": [round(r["reward/mean"], 4) for r in rows]}


def main() -> None:
    """Run the selected implementations and print the JSON summary."""
    args = parse_args()
    out = Path(args.out)
    model_dir = build_model_dir(out / "models", args.size)
    results: dict[str, Any] = {}
    for impl in args.impls.split(","):
        log(f"--- {impl}")
        if impl == "reasonctl":
            results[impl] = run_reasonctl(model_dir, args, out)
        else:
            results[impl] = run_trl(model_dir, args)
    summary: dict[str, Any] = {"bench": "cli_grpo", "size": args.size,
                               "completions": args.prompts_per_step * args.group,
                               "max_new_tokens": args.max_new_tokens, **environment(),
                               "results": results}
    mine, theirs = results.get("reasonctl", {}), results.get("trl", {})
    if mine.get("ok") and theirs.get("wall_s"):
        summary["speedup"] = round(theirs["wall_s"] / mine["step_s"], 2)
    emit(summary)


if __name__ == "__main__":
    main()
