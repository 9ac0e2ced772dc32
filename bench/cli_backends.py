"""The same quickstart runs through the CLI with two backends, compared step by step.

For each algorithm (``sft``, ``grpo``) this runs ``reasonctl run --algo A --backend B``
with the bundled quickstart config once per backend (default ``fsdp`` and ``megatron``),
each in its own process, on the same data, seed and model (the built-in ``tiny-random``
unless ``--model`` names another), and compares the ``loss`` column of the runs'
``metrics.jsonl`` step by step. The GRPO runs use a KL penalty (``kl_beta``), so the
reference-policy path of each backend runs too. After the SFT runs both exports are loaded
with ``transformers`` and their logits on the same tokens compared.

    python -m bench.cli_backends --steps 30                     # float32
    python -m bench.cli_backends --steps 30 --dtype bfloat16

The last line printed is a JSON summary; the exit code is 1 when a comparison fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = {"sft": "examples/configs/quickstart_sft.toml",
           "grpo": "examples/configs/quickstart_grpo.toml"}
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
"""Largest relative loss difference accepted per dtype (bf16: rounding of 8-bit mantissas)."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fsdp,megatron")
    parser.add_argument("--algos", default="sft,grpo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--out", default="outputs/bench_cli_backends")
    return parser.parse_args()


def run_cli(algo: str, backend: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``reasonctl run``; returns its losses, rewards, wall time and exit code."""
    steps = args.steps if algo == "sft" else args.grpo_steps
    command = [
        sys.executable, "-m", "reasonctl", "run", "--algo", algo, "--backend", backend,
        "--config", CONFIGS[algo],
        "--set", f"run.output_dir={json.dumps(str(out))}",
        "--set", f"model.name_or_path={json.dumps(args.model)}",
        "--set", f"model.dtype={json.dumps(args.dtype)}",
        "--set", f"train.max_steps={steps}",
        "--set", "checkpoint.every_steps=0",
    ]
    if algo == "grpo":
        command += ["--set", "algorithm.grpo.kl_beta=0.05", "--set", "eval.every_steps=0"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
    rows = []
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    return {"rc": result.returncode, "seconds": seconds,
            "loss": [r["loss"] for r in train],
            "reward": [r.get("reward/mean") for r in train],
            "kl": [r.get("kl") for r in train]}


def relative_gap(a: list[float], b: list[float]) -> float:
    """Largest ``|a - b| / max(|a|, |b|, 1e-6)`` over the common steps (inf if none)."""
    pairs = list(zip(a, b, strict=False))
    if not pairs or len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(x), abs(y), 1e-6) for x, y in pairs)


def export_logit_gap(first: Path, second: Path) -> float:
    """Largest absolute logit difference between two exports on the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for p in (first, second)]
    vocab = models[0].config.vocab_size
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in models]
    return float((logits[0] - logits[1]).abs().max())


def main() -> None:
    """Run every algorithm with every backend and compare."""
    args = parse_args()
    backends = args.backends.split(",")
    root = Path(args.out) / args.dtype
    summary: dict[str, Any] = {"bench": "cli_backends", "dtype": args.dtype,
                               "model": args.model, "backends": backends}
    ok = True
    for algo in args.algos.split(","):
        runs = {}
        for backend in backends:
            runs[backend] = run_cli(algo, backend, args, root / f"{algo}-{backend}")
            print(f"{algo} {backend}: rc={runs[backend]['rc']} "
                  f"{runs[backend]['seconds']:.1f} s losses={runs[backend]['loss'][:3]}...",
                  flush=True)
        base, other = (runs[b] for b in backends[:2])
        gap = relative_gap(base["loss"], other["loss"])
        passed = all(r["rc"] == 0 for r in runs.values()) and gap <= TOLERANCE[args.dtype]
        summary[algo] = {"runs": runs, "max_relative_loss_gap": gap, "passed": passed}
        print(f"{algo}: largest relative loss gap {gap:.2e} -> "
              f"{'ok' if passed else 'FAILED'}", flush=True)
        ok = ok and passed
        if algo == "sft" and passed:
            gap_logits = export_logit_gap(*(root / f"sft-{b}" / "export" / "final"
                                            for b in backends[:2]))
            summary["sft"]["export_max_logit_gap"] = gap_logits
            print(f"sft exports: largest logit difference {gap_logits:.2e}", flush=True)
    summary["passed"] = ok
    print(json.dumps(summary))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
