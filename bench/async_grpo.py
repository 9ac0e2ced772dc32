"""GRPO with separate rollout workers against colocated GRPO, on one machine, through the CLI.

Speed: a random Qwen2.5-shaped model (``--size``, 1.5B by default), ``--prompts`` prompts
of 128 tokens x ``--group`` completions (256 by default) of up to ``--max-new-tokens``
(1024) tokens per step, the even-word reward, the ``fsdp`` backend. Each configuration is
one ``reasonctl run --algo grpo`` (its own processes, its own Redis) on the same ``G``
GPUs:

- ``colocated``: ``G`` trainer processes, each generating its share between updates;
- ``separate-S`` for ``S`` in ``--staleness`` (default 0, 1, 2): ``G/2`` trainer processes
  and ``G/2`` rollout workers on the other GPUs, ``rollout.workers.max_staleness = S``.

Reported per configuration: mean step time and generated tokens per second per GPU over
the steps after ``--warmup``, the speed-up over colocated, and the workers' staleness, the
trainer's idle fraction and the weight-sync milliseconds.

Reward curve: the quickstart toy task (``examples/configs/quickstart_grpo.toml``, the tiny
model) for ``--toy-steps`` steps colocated and separate (``--toy-staleness``, one worker),
for each of ``--toy-seeds``, reporting each reward curve, the mean reward of its last ten
steps and the gap between the two (colocated minus separate).

    python -m bench.async_grpo                            # every GPU of the machine
    python -m bench.async_grpo --size tiny --steps 3      # CPU smoke run
    python -m bench.async_grpo --gpus 2 --parts colocated,separate --staleness 1

``--parts`` picks what runs (``colocated``, ``separate``, ``toy``; default all), so a
machine with a time limit per command can run them one command each: the colocated
summary is kept in ``--out`` per size and GPU count, and a later ``separate`` command
reports its speed-up against it.

Needs ``redis-server`` on PATH and redis-py; ``bash bench/redis_bundle.sh DIR`` packs both
on a Debian machine for a host without them (``DIR/bin`` first on PATH, the wheel in
``DIR/wheels``).

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPT_WORDS = 123
"""Words per prompt: with the chat template's 5 tokens the encoded prompt is 128 tokens."""


DEFAULTS = {"steps": 6, "warmup": 2, "prompts": 16, "group": 16, "max_new_tokens": 1024,
            "toy_steps": 60}
TINY_DEFAULTS = {"steps": 3, "warmup": 1, "prompts": 4, "group": 4, "max_new_tokens": 16,
                 "toy_steps": 4}
"""The workload: 256 completions of up to 1024 tokens; ``--size tiny`` a CPU smoke run."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5b", choices=["0.5b", "1.5b", "tiny"])
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs to use (default: all; even; 0 GPUs: CPU processes).")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--group", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--parts", default="colocated,separate,toy",
                        help="Comma-separated: colocated, separate, toy.")
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--weight-sync", default="broadcast", choices=["broadcast", "file"])
    parser.add_argument("--toy-steps", type=int)
    parser.add_argument("--toy-staleness", type=int, default=1)
    parser.add_argument("--toy-seeds", default="0",
                        help="Comma-separated run.seed values of the toy pairs (the "
                             "seed-to-seed spread is the noise the curves are judged by).")
    parser.add_argument("--toy-lr", type=float,
                        help="train.lr of both toy runs (default: the quickstart's 5e-3).")
    parser.add_argument("--out", default="outputs/bench_async_grpo")
    args = parser.parse_args()
    args.parts = {p for p in args.parts.split(",") if p}
    unknown = args.parts - {"colocated", "separate", "toy"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; use colocated, separate, toy")
    defaults = TINY_DEFAULTS if args.size == "tiny" else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def log(message: str) -> None:
    """Progress on stderr (stdout ends with the JSON line)."""
    print(message, file=sys.stderr, flush=True)


def gpu_count(requested: int) -> int:
    """``requested`` GPUs (default all of them; 0 without CUDA)."""
    import torch

    available = torch.cuda.device_count()
    count = requested or available
    if count > available:
        raise SystemExit(f"--gpus {count}: this machine has {available}")
    if count % 2:
        raise SystemExit(f"--gpus {count}: an even number splits into trainer and rollout halves")
    return count


def write_prompts(path: Path, count: int) -> Path:
    """``count`` prompts of random words (fixed seed)."""
    from bench.common import random_rows, words

    rows = random_rows(count, PROMPT_WORDS, seed=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": words(r), "reference": ""}) + "\n"
                            for r in rows))
    return path


def speed_settings(args: argparse.Namespace, model_dir: Path, data: Path) -> list[str]:
    """The ``--set`` overrides shared by every speed configuration."""
    from bench.common import tokenizer_dir

    values = {
        "model.name_or_path": str(model_dir), "model.tokenizer": str(tokenizer_dir(model_dir)),
        "model.dtype": "bfloat16", "model.max_length": 128 + args.max_new_tokens,
        "model.gradient_checkpointing": args.size != "tiny",
        "data.format": "jsonl", "data.jsonl.path": str(data),
        "algorithm.grpo.prompts_per_step": args.prompts,
        "rollout.n": args.group, "rollout.max_new_tokens": args.max_new_tokens,
        "rollout.hf.max_batch_size": args.prompts * args.group,
        "train.max_steps": args.steps, "train.micro_batch_size": args.micro_batch,
        "train.lr": 1e-6, "checkpoint.every_steps": 0, "checkpoint.export_final": False,
        "logging.loggers": ["jsonl"],
    }
    reward = 'rewards.components=[{name = "bench.common:even_word_reward"}]'
    return [f"{k}={json.dumps(v)}" for k, v in values.items()] + [reward]


def run_cli(out: Path, config: str | None, overrides: list[str], nproc: int,
            backend: str) -> dict[str, Any]:
    """One ``reasonctl run --algo grpo``; its metrics rows and wall time."""
    command = [sys.executable, "-m", "reasonctl", "run", "--algo", "grpo", "--backend", backend,
               "--set", f"run.output_dir={json.dumps(str(out))}"]
    if config:
        command += ["--config", config]
    for item in overrides:
        command += ["--set", item]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    shutil.rmtree(out, ignore_errors=True)  # each run starts fresh
    log(f"$ {' '.join(command)}")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        log(done.stdout[-4000:] + done.stderr[-4000:])
        return {"exit_code": done.returncode, "wall_s": wall, "rows": []}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"exit_code": 0, "wall_s": wall, "rows": rows}


def summarise(run: dict[str, Any], warmup: int, gpus: int, completions: int) -> dict[str, Any]:
    """Step time, tokens/s/GPU and the async metrics over the timed steps."""
    rows = run["rows"][warmup:]
    if not rows:
        return {"exit_code": run["exit_code"], "wall_s": run["wall_s"]}
    step_s = statistics.fmean(r["step_time_s"] for r in rows)
    tokens = statistics.fmean(r["response_length/mean"] * completions for r in rows)
    out: dict[str, Any] = {"exit_code": run["exit_code"], "wall_s": round(run["wall_s"], 1),
                           "step_s": round(step_s, 3),
                           "tokens_per_s_per_gpu": round(tokens / step_s / max(gpus, 1), 1),
                           "tokens_per_step": round(tokens)}
    for key in ("async/staleness/mean", "async/trainer_idle_frac", "weights/stage_ms",
                "weights/sync_ms", "rollout/tokens_per_s", "time/update_s", "time/rollout_s"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = round(statistics.fmean(values), 3)
    return out


def speed(args: argparse.Namespace, out: Path, gpus: int) -> dict[str, Any]:
    """Colocated against separate with each staleness bound, same machine (the parts
    asked for)."""
    from bench.common import build_model_dir

    model_dir = build_model_dir(out / "models", args.size)
    data = write_prompts(out / "prompts.jsonl", max(64, args.prompts * (args.steps + 1)))
    shared = speed_settings(args, model_dir, data)
    processes = max(gpus, 1)
    half = max(gpus // 2, 1)
    completions = args.prompts * args.group
    results: dict[str, Any] = {}
    device = [] if gpus else ["backend.device='cpu'"]
    if "colocated" in args.parts:
        colocated = run_cli(out / "colocated", None, shared + device, processes, "fsdp")
        results["colocated"] = summarise(colocated, args.warmup, gpus, completions)
    bounds = [int(s) for s in args.staleness.split(",") if s] if "separate" in args.parts else []
    for staleness in bounds:
        separate = shared + device + [
            "rollout.placement='separate'", f"rollout.workers.count={half}",
            f"rollout.workers.max_staleness={staleness}",
            f"rollout.workers.weight_sync='{args.weight_sync}'"]
        run = run_cli(out / f"separate-{staleness}", None, separate, half, "fsdp")
        results[f"separate-{staleness}"] = summarise(run, args.warmup, gpus, completions)
    baseline = out / f"colocated-{args.size}-{gpus}gpu.json"
    if "colocated" in results:
        baseline.write_text(json.dumps(results["colocated"]))
    elif baseline.is_file():  # an earlier command on this machine, same size and GPUs
        results["colocated (earlier command)"] = json.loads(baseline.read_text())
    base = next((r.get("tokens_per_s_per_gpu") for k, r in results.items()
                 if k.startswith("colocated")), None)
    for result in results.values():
        if base and result.get("tokens_per_s_per_gpu"):
            result["speedup"] = round(result["tokens_per_s_per_gpu"] / base, 3)
    return results


def reward_curves(args: argparse.Namespace, out: Path, gpus: int) -> dict[str, Any]:
    """The quickstart task colocated and with one separate worker, per ``--toy-seeds``;
    ``last10_gap`` is colocated's last-ten mean reward minus the separate run's."""
    config = "examples/configs/quickstart_grpo.toml"
    common = [f"train.max_steps={args.toy_steps}", "checkpoint.every_steps=0",
              "checkpoint.export_final=false", "eval.every_steps=0",
              'logging.loggers=["jsonl"]']
    if not gpus:
        common.append("backend.device='cpu'")
    if args.toy_lr is not None:
        common.append(f"train.lr={args.toy_lr}")
    separate = f"separate-{args.toy_staleness}"
    curves: dict[str, Any] = {}
    for seed in [int(s) for s in args.toy_seeds.split(",") if s]:
        seeded = [*common, f"run.seed={seed}"]
        runs = {
            "colocated": run_cli(out / f"toy-colocated-{seed}", config, seeded, 1, "single"),
            separate: run_cli(
                out / f"toy-separate-{seed}", config,
                seeded + ["rollout.placement='separate'", "rollout.workers.count=1",
                          f"rollout.workers.max_staleness={args.toy_staleness}"], 1, "single"),
        }
        pair: dict[str, Any] = {}
        for name, run in runs.items():
            rewards = [round(r["reward/mean"], 4) for r in run["rows"]]
            pair[name] = {"exit_code": run["exit_code"], "wall_s": round(run["wall_s"], 1),
                          "last10_mean": round(statistics.fmean(rewards[-10:]), 4)
                          if rewards else None, "reward_mean": rewards}
        if pair["colocated"]["last10_mean"] is not None and \
                pair[separate]["last10_mean"] is not None:
            pair["last10_gap"] = round(pair["colocated"]["last10_mean"]
                                       - pair[separate]["last10_mean"], 4)
        curves[f"seed{seed}"] = pair
    return curves


def check_redis() -> None:
    """Fail before the first run when the separate runs could not start Redis."""
    import importlib.util

    missing = []
    if shutil.which("redis-server") is None:
        missing.append("redis-server is not on PATH (apt-get install redis-server, or build "
                       "a bundle elsewhere with `bash bench/redis_bundle.sh DIR` and put "
                       "DIR/bin first on PATH)")
    if importlib.util.find_spec("redis") is None:
        missing.append("redis-py is not installed (pip install 'reasonctl[async]', or the "
                       "wheel in DIR/wheels of bench/redis_bundle.sh)")
    if missing:
        raise SystemExit("separate rollout workers need Redis: " + "; ".join(missing))


def main() -> None:
    """Run the parts asked for and print the JSON summary."""
    from bench.common import emit, environment

    args = parse_args()
    if args.parts & {"separate", "toy"}:
        check_redis()
    out = (REPO / args.out).resolve()
    gpus = gpu_count(args.gpus)
    summary = {
        "bench": "async_grpo", "size": args.size, "gpus": gpus,
        "completions_per_step": args.prompts * args.group,
        "max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup,
        "weight_sync": args.weight_sync,
        "speed": speed(args, out, gpus) if args.parts & {"colocated", "separate"} else {},
        "toy_reward": reward_curves(args, out, gpus) if "toy" in args.parts else {},
        "environment": environment(),
    }
    emit(summary)


if __name__ == "__main__":
    main()
