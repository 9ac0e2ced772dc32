"""FlowGRPO on a world-model DiT with its latent tokens split over ``cp`` GPUs: iteration
time and peak memory at ``backend.fsdp.cp`` = 1, 2, ... for the same samples, in one job.

Workload: the random-weight Wan2.1-T2V-1.3B- (or Cosmos-Predict2.5-2B-) shaped pipeline and
precomputed text embeddings of :mod:`bench.world_model`, one prompt per step, a group of
``--group`` samples of ``--frames`` x ``--height`` x ``--width`` (default 33 x 480 x 832:
9 latent frames, 14,040 tokens for Wan), ``--sample-steps`` SDE steps of which the first
``--train-steps`` train; bfloat16 compute, gradient checkpointing. Each ``cp`` value runs
``reasonctl run --backend fsdp --nproc-per-node cp --set backend.fsdp.cp=cp`` (so one
data-parallel group: every setting samples and trains the same samples, and their rewards
must agree up to bfloat16 summation order: ``reward_max_abs_diff``). The figures are the
mean ``time/step_s`` after ``--warmup`` steps and the peak memory of rank 0.

    python -m bench.world_model_cp --model wan1.3b --cps 1,2          # 2 GPUs
    python -m bench.world_model_cp --model wan1.3b --size tiny        # CPU smoke run

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import emit, environment, log
from bench.world_model import TRANSFORMERS, build_model_dir, reasonctl_config, text_embedding


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan1.3b", choices=sorted(TRANSFORMERS))
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--cps", default="1,2", help="Comma-separated cp sizes to run.")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33, help="Pixel frames (4k + 1).")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--sample-steps", type=int, default=6)
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2, help="Iterations, warm-up included.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default="/tmp/reasonctl-bench-world-model")
    args = parser.parse_args()
    # the options bench.world_model's config builder reads
    args.micro_batch, args.compile, args.vae_batch = 0, False, 0
    args.param_dtype, args.no_checkpointing, args.backend, args.nproc = \
        "float32", False, "fsdp", 1
    args.checkpointing, args.cudnn_attention = "true", "auto"
    if args.size == "tiny":
        args.height = args.width = 32
        args.frames, args.group, args.sample_steps, args.train_steps = 5, 2, 3, 2
        args.iters, args.warmup = 2, 1
    return args


def run_cp(root: Path, model_dir: Path, embedding: Path, args: argparse.Namespace,
           cp: int) -> dict[str, Any]:
    """One ``reasonctl run`` over ``cp`` processes; per-step times and peak memory."""
    import tomli_w

    out = root / "run-cp" / f"{args.model}-{args.size}-cp{cp}"
    config = copy.deepcopy(reasonctl_config(out, model_dir, embedding, args))
    config["algorithm"]["flow_grpo"]["prompts_per_step"] = 1
    config["backend"] = {"name": "fsdp", "device": "auto", "fsdp": {"cp": cp}}
    path = out / "config.bench.toml"
    path.write_text(tomli_w.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--nproc-per-node",
                           str(cp), "--config", str(path)], check=False)
    if proc.returncode:
        raise SystemExit(f"reasonctl run with cp={cp} failed ({proc.returncode})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup:] or rows
    return {
        "s_per_iter": statistics.fmean(r["time/step_s"] for r in timed),
        "rollout_s": statistics.fmean(r["time/rollout_s"] for r in timed),
        "update_s": statistics.fmean(r["time/update_s"] for r in timed),
        "peak_gb": max(r.get("peak_mem_gb", 0.0) for r in rows),
        "reward_mean": [r["reward/mean"] for r in rows],
    }


def main() -> None:
    """Build the weights, run every cp size, print the JSON summary."""
    args = parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(root, args)
    embedding, _ = text_embedding(root, model_dir)
    cps = [int(c) for c in args.cps.split(",") if c.strip()]
    from reasonctl.diffusion.adapters import adapter_for

    adapter = adapter_for(model_dir)
    shape = adapter.latent_shape(args.frames, args.height, args.width)
    patch = adapter.transformer_config.get("patch_size", (1, 2, 2))
    tokens = shape[1] * (shape[2] // patch[1]) * (shape[3] // patch[2])
    summary: dict[str, Any] = {
        "bench": "world_model_cp", "model": args.model, "size": args.size,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames,
                  "latent_tokens": tokens, "group": args.group,
                  "sample_steps": args.sample_steps, "train_steps": args.train_steps},
        **environment(),
    }
    for cp in cps:
        summary[f"cp{cp}"] = run_cp(root, model_dir, embedding, args, cp)
        log(f"cp={cp}: {summary[f'cp{cp}']}")
    first = summary[f"cp{cps[0]}"]
    for cp in cps[1:]:
        other = summary[f"cp{cp}"]
        other["speedup_vs_cp" + str(cps[0])] = first["s_per_iter"] / other["s_per_iter"]
        if first["peak_gb"]:
            other["peak_ratio_vs_cp" + str(cps[0])] = other["peak_gb"] / first["peak_gb"]
        other["reward_max_abs_diff"] = max(
            abs(a - b) for a, b in zip(first["reward_mean"], other["reward_mean"], strict=True))
    emit(summary)


if __name__ == "__main__":
    main()
