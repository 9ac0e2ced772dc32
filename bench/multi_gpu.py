"""Multi-GPU runs of the fsdp backend through the CLI: scaling, HSDP, GRPO and resharded resume.

Every measurement is a real ``python -m reasonctl run`` (one process per GPU, started by the
CLI's ``--nproc-per-node`` or, with ``--launcher torchrun``, by ``torch.distributed.run``),
reading the run's ``metrics.jsonl`` afterwards. Models are the random Qwen2.5-shaped ones of
:mod:`bench.common` with its word tokenizer (``w12 w7 ...``: one word = one token); data is
random words with a fixed seed. Parts (``--parts``, default all):

- ``scaling``: FSDP2 SFT, bf16 compute, ``--seq`` tokens per row, ``--per-gpu-batch`` rows
  per GPU per step (weak scaling: global batch = per-GPU batch x N), ``train.compile`` on
  CUDA, for each N of ``--gpus``. Tokens/s = tokens per step x timed steps / their summed
  ``step_time_s`` (the steps after ``--warmup``); scaling efficiency = per-GPU tokens/s at N
  / per-GPU tokens/s at the smallest N (1 by default). With ``--single-baseline`` (the
  default) the single backend first runs the same rows per step on one GPU, and each N's
  per-GPU tokens/s is also given against it (``efficiency_vs_single``, target
  ``TARGET_VS_SINGLE``). ``--param-dtype compute`` keeps bf16 weights and optimizer state
  in both backends; ``--reduce-dtype``, ``--prefetch``, ``--reshard-after-forward`` and
  ``--gradient-sync`` set the fsdp backend's other speed settings.
- ``hsdp``: the same SFT on the largest N as HSDP (``backend.fsdp.dp_replicate`` =
  ``--hsdp-replicate`` replicas x N / replicate shards), against plain FSDP at that N.
- ``tp``: the same SFT on the largest N with ``backend.fsdp.tp`` = ``--tp`` (DTensor tensor
  parallelism inside each group of ``--tp`` GPUs, FSDP over the N / tp groups, same global
  batch) against plain FSDP at that N, with the largest relative loss difference.
- ``grpo``: GRPO with the fsdp backend on each N, same global workload (``--prompts`` x
  ``--group`` completions of prompts of ``--prompt-tokens`` tokens, ``--max-new-tokens``
  sampled at temperature 1, the rule reward ``bench.common:even_word_reward``); mean step
  time after ``--grpo-warmup`` and its split (``time/rollout_s``, ``time/update_s``, ...),
  speedup against the smallest N.
- ``resume``: float32 SFT on the largest N that saves a checkpoint at step S
  (``--resume-steps``) and stops, resumed to step 2S on N/2 processes and on 1 (DCP
  reshards the checkpoint), each compared step by step with an uninterrupted 2S-step run on
  N; passes when the largest relative loss difference after the resume is at most
  ``LOSS_RTOL`` and the largest relative grad-norm difference at most ``GRAD_NORM_RTOL``.

Four GPUs (the defaults: 1.5B-shaped model for scaling and HSDP, 0.5B for GRPO and resume;
an estimated 8-10 minutes on H100/H200, mostly process start-up, weight loading and the
first step's compilation of each of the 11 runs)::

    python -m bench.multi_gpu --gpus 1,2,4
    python -m bench.multi_gpu --gpus 1,2,4 --parts scaling,hsdp --steps 12 --warmup 4
    python -m bench.multi_gpu --gpus 1,4 --parts grpo --max-new-tokens 512

CPU smoke run (gloo, tiny model)::

    python -m bench.multi_gpu --device cpu --size tiny --gpus 1,2 --seq 128 --steps 4 \\
        --warmup 1 --max-new-tokens 16 --prompt-tokens 32 --grpo-steps 3 --resume-seq 64

Child processes get ``NCCL_NVLS_ENABLE=0`` (no NVLink multicast). Each run's output is
written to ``<out>/logs/<run>.log``. The log goes to stderr; the last line on stdout is a
JSON summary (also saved as ``<out>/summary.json``) holding every command that ran. The exit
code is 1 when a run fails or a check does not pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import emit, log, random_rows, tokenizer_dir, words

PARTS = ("scaling", "hsdp", "tp", "grpo", "resume")
LOSS_RTOL = 1e-4
"""Largest relative loss difference between a resumed and an uninterrupted float32 run."""
GRAD_NORM_RTOL = 1e-3
"""Largest relative grad-norm difference between a resumed and an uninterrupted run."""
SFT_PROMPT_WORDS = 8
"""Words of an SFT row's user turn; the chat template adds 6 tokens, the answer the rest."""
SFT_TEMPLATE_TOKENS = 6
GRPO_TEMPLATE_TOKENS = 5
"""Tokens the chat template adds to a prompt (with the generation prompt)."""
REWARD = "bench.common:even_word_reward"
TARGET_VS_SINGLE = 0.9
"""Per-GPU tokens/s of fsdp on every N against the single backend's on one GPU."""
RESUME_VOCABULARY = 64
"""The resume runs' rows use this many distinct words: the loss moves a lot every step, so
a wrong weight, optimizer or data state after the resume changes it visibly."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"Comma-separated subset of {','.join(PARTS)}.")
    parser.add_argument("--gpus", default="1,2,4", help="Process counts (one GPU each).")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"])
    parser.add_argument("--size", default=None, choices=["0.5b", "1.5b", "7b", "tiny"],
                        help="Model of every part (default: 1.5b for scaling/hsdp, "
                             "0.5b for grpo and resume).")
    parser.add_argument("--grpo-size", default=None, choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--resume-size", default=None, choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--out", default="outputs/bench_multi_gpu")
    parser.add_argument("--launcher", default="cli", choices=["cli", "torchrun"],
                        help="cli: reasonctl run --nproc-per-node N; torchrun: "
                             "python -m torch.distributed.run ... -m reasonctl run.")
    parser.add_argument("--timeout", type=int, default=900, help="Seconds per run at most.")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        metavar="KEY=VALUE", help="Extra config override for every run.")
    sft = parser.add_argument_group("scaling / hsdp")
    sft.add_argument("--seq", type=int, default=2048, help="Tokens per SFT row.")
    sft.add_argument("--per-gpu-batch", type=int, default=4, help="Rows per GPU per step.")
    sft.add_argument("--micro-batch", type=int, default=None,
                     help="Rows per forward/backward (default: --per-gpu-batch).")
    sft.add_argument("--steps", type=int, default=12)
    sft.add_argument("--warmup", type=int, default=4, help="Untimed first steps.")
    sft.add_argument("--lr", type=float, default=1e-5)
    sft.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="train.compile (default: on when GPUs are visible).")
    sft.add_argument("--param-dtype", default="float32", choices=["float32", "compute"],
                     help="backend.fsdp.param_dtype and, for the baseline, "
                          "backend.single.param_dtype (compute: bf16 weights and optimizer "
                          "state).")
    sft.add_argument("--reduce-dtype", default="float32", choices=["float32", "compute"],
                     help="backend.fsdp.reduce_dtype (gradient reduction).")
    sft.add_argument("--prefetch", type=int, default=None,
                     help="backend.fsdp.prefetch (default: the backend's).")
    sft.add_argument("--reshard-after-forward", default=None,
                     choices=["default", "always", "never"],
                     help="backend.fsdp.reshard_after_forward (default: the backend's; never: "
                          "blocks stay gathered from forward to backward, as ZeRO-2).")
    sft.add_argument("--gradient-sync", default=None,
                     choices=["every_micro_batch", "last_micro_batch"],
                     help="backend.fsdp.gradient_sync (default: the backend's).")
    sft.add_argument("--single-baseline", action=argparse.BooleanOptionalAction, default=True,
                     help="scaling: also run the single backend on one GPU (same rows per "
                          "step, micro-batch and param dtype) and report efficiency against it.")
    sft.add_argument("--hsdp-replicate", type=int, default=2)
    sft.add_argument("--tp", type=int, default=2, help="Tensor-parallel size of the tp part.")
    grpo = parser.add_argument_group("grpo")
    grpo.add_argument("--prompts", type=int, default=8, help="Prompts per step (global).")
    grpo.add_argument("--group", type=int, default=8, help="Completions per prompt.")
    grpo.add_argument("--prompt-tokens", type=int, default=128)
    grpo.add_argument("--max-new-tokens", type=int, default=256)
    grpo.add_argument("--grpo-steps", type=int, default=4)
    grpo.add_argument("--grpo-warmup", type=int, default=1)
    grpo.add_argument("--grpo-micro-batch", type=int, default=16,
                      help="Completions per forward/backward of the update.")
    grpo.add_argument("--grpo-lr", type=float, default=1e-6)
    resume = parser.add_argument_group("resume")
    resume.add_argument("--resume-steps", type=int, default=3, help="S: checkpoint step.")
    resume.add_argument("--resume-seq", type=int, default=512)
    resume.add_argument("--resume-lr", type=float, default=1e-4,
                        help="Large enough that a wrong optimizer or data state shows.")
    resume.add_argument("--resume-procs", default=None,
                        help="Process counts to resume with (default: N/2 and 1).")
    args = parser.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    args.gpus = sorted({int(n) for n in args.gpus.split(",") if n})
    if not args.gpus or args.gpus[0] < 1:
        parser.error("--gpus needs positive process counts, e.g. 1,2,4")
    args.micro_batch = args.micro_batch or args.per_gpu_batch
    if args.per_gpu_batch % args.micro_batch:
        parser.error("--per-gpu-batch must be a multiple of --micro-batch")
    if args.seq < SFT_PROMPT_WORDS + SFT_TEMPLATE_TOKENS + 2 or args.resume_seq < 16:
        parser.error("--seq and --resume-seq must be at least 16")
    if args.prompt_tokens <= GRPO_TEMPLATE_TOKENS:
        parser.error(f"--prompt-tokens must exceed {GRPO_TEMPLATE_TOKENS}")
    if args.resume_procs:
        args.resume_procs = sorted({int(p) for p in args.resume_procs.split(",") if p},
                                   reverse=True)
    else:
        args.resume_procs = sorted({max(1, args.gpus[-1] // 2), 1}, reverse=True)
    global_batch = args.per_gpu_batch * args.gpus[-1]
    bad = [m for m in args.resume_procs if m < 1 or global_batch % (m * args.micro_batch)]
    if "resume" in args.parts and bad:
        parser.error(f"resume: the global batch {global_batch} (--per-gpu-batch x largest "
                     f"--gpus) cannot be split over {bad} process(es) x --micro-batch "
                     f"{args.micro_batch}")
    return args


# --- processes -----------------------------------------------------------------------------


def child_env(args: argparse.Namespace, nproc: int = 1) -> dict[str, str]:
    """The environment of every child: ours, NVLink multicast off, unbuffered output."""
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def run_process(command: list[str], log_path: Path, env: dict[str, str], timeout: float
                ) -> int:
    """Run ``command`` in its own session with output to ``log_path``; return its exit code.

    On timeout the whole process group (launcher and workers) gets SIGTERM, then SIGKILL,
    and the code is 124.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w", encoding="utf-8") as handle:
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            handle.write(f"\n[bench.multi_gpu] killed after {timeout} s\n")
            return 124


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def toml_literal(value: Any) -> str:
    """``value`` as the TOML literal ``--set`` expects (strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config tables as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def prepare(args: argparse.Namespace, sizes: set[str]) -> dict[str, Any]:
    """Build the random models in a child process (the parent never touches a GPU).

    Returns the model directories by size, the child's :func:`bench.common.environment`
    and the number of visible CUDA devices.
    """
    code = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from bench.common import build_model_dir, environment\n"
        "root, sizes = Path(sys.argv[1]), sys.argv[2].split(',')\n"
        "paths = {s: str(build_model_dir(root, s).resolve()) for s in sizes}\n"
        "print(json.dumps({'models': paths, 'env': environment(),\n"
        "                  'cuda_devices': torch.cuda.device_count()}))\n"
    )
    command = [sys.executable, "-c", code, str(Path(args.out) / "models"), ",".join(sorted(sizes))]
    env = child_env(args)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    log_path = Path(args.out) / "logs" / "prepare.log"
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        log(f"model preparation failed:\n{tail(log_path)}")
        sys.exit(1)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    info["command"] = shlex.join(command)
    log(f"models {info['models']} ready in {time.perf_counter() - started:.0f} s; "
        f"{info['cuda_devices']} CUDA device(s), {info['env']['gpu']}")
    return info


class Runner:
    """Starts ``reasonctl run`` processes and collects what they logged."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(args.out).resolve()

    def command(self, config: Path, nproc: int, sets: dict[str, Any]) -> list[str]:
        """The command line of one run on ``nproc`` processes."""
        run_args = ["run", "--config", str(config)]
        for key, value in flatten(sets).items():
            run_args += ["--set", f"{key}={toml_literal(value)}"]
        for item in self.args.extra:
            run_args += ["--set", item]
        if self.args.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(nproc), "-m", "reasonctl", *run_args]
        return [sys.executable, "-m", "reasonctl", *run_args, "--nproc-per-node", str(nproc)]

    def run(self, name: str, config: Path, nproc: int, sets: dict[str, Any]) -> dict[str, Any]:
        """One run in a fresh ``<out>/runs/<name>``; its metric rows, exit code and wall time."""
        from reasonctl.loggers.metrics_file import read_metrics

        output_dir = self.root / "runs" / name
        shutil.rmtree(output_dir, ignore_errors=True)
        sets = {**sets, "run": {**sets.get("run", {}), "output_dir": str(output_dir)}}
        command = self.command(config, nproc, sets)
        log_path = self.root / "logs" / f"{name}.log"
        log(f"--- {name}: {nproc} process(es)")
        started = time.perf_counter()
        rc = run_process(command, log_path, child_env(self.args, nproc), self.args.timeout)
        wall = time.perf_counter() - started
        metrics = output_dir / "metrics.jsonl"
        rows = read_metrics(metrics) if metrics.is_file() else []
        if rc != 0:
            log(f"{name} FAILED (exit code {rc}); last lines of {log_path}:\n{tail(log_path)}")
        else:
            log(f"{name}: {len(rows)} step(s) in {wall:.1f} s wall")
        return {"name": name, "nproc": nproc, "rc": rc, "wall_s": round(wall, 2),
                "command": shlex.join(command), "log": str(log_path),
                "output_dir": str(output_dir), "rows": rows}


# --- configs and data ----------------------------------------------------------------------


def write_toml(path: Path, values: dict[str, Any]) -> Path:
    """Write a config file."""
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(values))
    return path


def base_values(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Config shared by every run: model, fsdp backend, no export, jsonl metrics."""
    return {
        "run": {"name": "bench_multi_gpu", "seed": 0},
        "model": {"name_or_path": model_dir, "tokenizer": str(tokenizer_dir(Path(model_dir))),
                  "dtype": "bfloat16"},
        "train": {"weight_decay": 0.0, "max_grad_norm": 1.0, "schedule": "constant",
                  "warmup_steps": 0},
        "backend": {"name": "fsdp", "device": "cpu" if args.device == "cpu" else "auto"},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["console", "jsonl"], "plot": False},
    }


def write_sft_data(path: Path, rows: int, seq: int, seed: int, vocabulary: int | None = None
                   ) -> Path:
    """``rows`` SFT rows of exactly ``seq`` tokens (user turn of random words, answer).

    With ``vocabulary`` the words are drawn from the first ``vocabulary`` ids only, so the
    loss falls fast from the first steps on (the model learns which words occur).
    """
    answer = seq - SFT_PROMPT_WORDS - SFT_TEMPLATE_TOKENS
    lines = []
    for ids in random_rows(rows, SFT_PROMPT_WORDS + answer, seed=seed):
        if vocabulary:
            ids = [i % vocabulary for i in ids]
        lines.append(json.dumps({"prompt": words(ids[:SFT_PROMPT_WORDS]),
                                 "response": words(ids[SFT_PROMPT_WORDS:])}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_prompts(path: Path, count: int, tokens: int) -> Path:
    """``count`` prompts of ``tokens`` tokens once the chat template is applied."""
    rows = random_rows(count, tokens - GRPO_TEMPLATE_TOKENS, seed=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": words(r)}) + "\n" for r in rows))
    return path


# --- summaries -----------------------------------------------------------------------------


def timed_rows(rows: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The rows after the warm-up steps (all rows if there are no others)."""
    return [r for r in rows if r["step"] > warmup] or rows


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the rows that have it."""
    values = [float(r[key]) for r in rows if key in r]
    return statistics.fmean(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded, ``None`` kept."""
    return None if value is None else round(value, digits)


def run_record(run: dict[str, Any]) -> dict[str, Any]:
    """What the JSON keeps of a run (no per-step rows)."""
    return {k: run[k] for k in ("nproc", "rc", "wall_s", "command", "log")}


def sft_result(run: dict[str, Any], args: argparse.Namespace, global_batch: int
               ) -> dict[str, Any]:
    """Tokens/s (total and per GPU), step time and memory of an SFT throughput run."""
    rows = run["rows"]
    out = run_record(run)
    out["ok"] = run["rc"] == 0 and len(rows) == args.steps
    if not rows:
        return out
    timed = timed_rows(rows, args.warmup)
    tokens = global_batch * args.seq
    targets = global_batch * (args.seq - SFT_PROMPT_WORDS - SFT_TEMPLATE_TOKENS + 1)
    if any(r.get("loss_tokens") != targets for r in rows):
        log(f"warning: {run['name']}: target tokens per step differ from {targets}; the rows "
            f"are not {args.seq} tokens long, so tokens/s is off")
    seconds = sum(r["step_time_s"] for r in timed)
    out.update(
        global_batch=global_batch, tokens_per_step=tokens, timed_steps=len(timed),
        step_s=round(seconds / len(timed), 4),
        tokens_per_s=round(tokens * len(timed) / seconds, 1),
        tokens_per_s_per_gpu=round(tokens * len(timed) / seconds / run["nproc"], 1),
        metric_tokens_per_s=rounded(mean_of(timed, "tokens_per_s"), 1),
        first_step_s=round(rows[0]["step_time_s"], 2),
        mfu=rounded(mean_of(timed, "mfu")),
        peak_mem_gb=rounded(max((r.get("peak_mem_gb", 0.0) for r in rows), default=0.0), 2),
        truncated_rows=int(sum(r.get("truncated", 0) for r in rows)),
        losses=[round(r["loss"], 5) for r in rows],
    )
    return out


def relative_differences(got: list[dict[str, Any]], want: list[dict[str, Any]], key: str,
                         steps: range) -> list[float | None]:
    """``|got - want| / |want|`` of ``key`` at each step (``None`` where a step is missing)."""
    got_by, want_by = {r["step"]: r for r in got}, {r["step"]: r for r in want}
    out: list[float | None] = []
    for step in steps:
        if step not in got_by or step not in want_by:
            out.append(None)
            continue
        a, b = float(got_by[step][key]), float(want_by[step][key])
        out.append(abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a + b) else math.inf)
    return out


def worst(values: list[float | None]) -> float:
    """The largest value; infinity when one is missing (or there are none)."""
    if not values or any(v is None for v in values):
        return math.inf
    return max(v for v in values if v is not None)


def json_number(value: float | None) -> float | None:
    """``value`` for the JSON summary: ``None`` instead of a non-finite number."""
    return value if value is not None and math.isfinite(value) else None


# --- parts ---------------------------------------------------------------------------------


def backend_values(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The ``[backend]`` settings of a throughput run with backend ``name``."""
    if name == "single":
        return {"name": "single", "single": {"param_dtype": args.param_dtype}}
    fsdp: dict[str, Any] = {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype}
    if args.prefetch is not None:
        fsdp["prefetch"] = args.prefetch
    if args.reshard_after_forward is not None:
        fsdp["reshard_after_forward"] = args.reshard_after_forward
    if args.gradient_sync is not None:
        fsdp["gradient_sync"] = args.gradient_sync
    return {"name": "fsdp", "fsdp": fsdp}


def sft_values(data: Path, args: argparse.Namespace, nproc: int, backend: str = "fsdp"
               ) -> dict[str, Any]:
    """The per-run settings of a throughput SFT run on ``nproc`` processes."""
    return {
        "backend": backend_values(args, backend),
        "train": {"global_batch_size": args.per_gpu_batch * nproc,
                  "micro_batch_size": args.micro_batch, "max_steps": args.steps,
                  "lr": args.lr, "compile": args.compile},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "model": {"max_length": args.seq},
    }


def part_scaling(runner: Runner, args: argparse.Namespace, config: Path, data: Path
                 ) -> dict[str, Any]:
    """Weak scaling of FSDP2 SFT over ``--gpus``."""
    single = None
    if args.single_baseline:
        run = runner.run("scaling-single-1", config, 1, sft_values(data, args, 1, "single"))
        single = sft_result(run, args, args.per_gpu_batch)
    results: dict[str, Any] = {}
    for nproc in args.gpus:
        run = runner.run(f"scaling-fsdp-{nproc}", config, nproc,
                         sft_values(data, args, nproc))
        results[str(nproc)] = sft_result(run, args, args.per_gpu_batch * nproc)
    base = results[str(args.gpus[0])].get("tokens_per_s_per_gpu")
    single_rate = (single or {}).get("tokens_per_s_per_gpu")
    log(f"{'run':>9}{'global batch':>14}{'tok/s':>12}{'tok/s/GPU':>12}{'efficiency':>12}"
        f"{'vs single':>11}{'step s':>9}{'MFU':>7}{'peak GB':>9}{'wall s':>8}")
    rows = [("single 1", single)] if single else []
    rows += [(f"fsdp {n}", results[str(n)]) for n in args.gpus]
    for label, r in rows:
        per_gpu = r.get("tokens_per_s_per_gpu")
        if label.startswith("fsdp"):
            r["efficiency"] = round(per_gpu / base, 4) if per_gpu and base else None
        r["efficiency_vs_single"] = (round(per_gpu / single_rate, 4)
                                     if per_gpu and single_rate else None)
        if "tokens_per_s" in r:
            log(f"{label:>9}{r['global_batch']:>14}{r['tokens_per_s']:>12.0f}{per_gpu:>12.0f}"
                f"{(r.get('efficiency') or 0):>12.3f}{(r['efficiency_vs_single'] or 0):>11.3f}"
                f"{r['step_s']:>9.3f}{(r['mfu'] or 0):>7.1%}{r['peak_mem_gb']:>9.1f}"
                f"{r['wall_s']:>8.0f}")
        else:
            log(f"{label:>9}  failed (exit code {r['rc']})")
    ratios = [r.get("efficiency_vs_single") for r in results.values()]
    out = {"baseline_nproc": args.gpus[0], "per_gpu_batch": args.per_gpu_batch,
           "micro_batch": args.micro_batch, "seq": args.seq, "compile": args.compile,
           "backend": backend_values(args, "fsdp"), "results": results,
           "ok": all(r["ok"] for r in results.values()) and (single is None or single["ok"])}
    if single is not None:
        out["single"] = single
        out["min_efficiency_vs_single"] = (min(ratios) if ratios and None not in ratios
                                           else None)
        out["target_vs_single"] = TARGET_VS_SINGLE
        out["target_met"] = out["min_efficiency_vs_single"] is not None and (
            out["min_efficiency_vs_single"] >= TARGET_VS_SINGLE)
    return out


def plain_fsdp_result(runner: Runner, args: argparse.Namespace, config: Path,
                      values: dict[str, Any], scaling: dict[str, Any] | None, part: str
                      ) -> dict[str, Any]:
    """Plain FSDP SFT on the largest N: the scaling part's run when it succeeded, else a
    run of its own (named after ``part``)."""
    nproc = args.gpus[-1]
    fsdp = (scaling or {}).get("results", {}).get(str(nproc))
    if fsdp and fsdp.get("ok"):
        return fsdp
    return sft_result(runner.run(f"{part}-reference-fsdp-{nproc}", config, nproc, values),
                      args, args.per_gpu_batch * nproc)


def part_hsdp(runner: Runner, args: argparse.Namespace, config: Path, data: Path,
              scaling: dict[str, Any] | None) -> dict[str, Any]:
    """HSDP (replicate x shard) against plain FSDP on the largest N."""
    nproc = args.gpus[-1]
    replicate = args.hsdp_replicate
    if nproc < 2 or nproc % replicate:
        reason = f"needs N >= 2 divisible by --hsdp-replicate {replicate} (N = {nproc})"
        log(f"hsdp skipped: {reason}")
        return {"skipped": reason, "ok": True}
    values = sft_values(data, args, nproc)
    fsdp = plain_fsdp_result(runner, args, config, values, scaling, "hsdp")
    values["backend"]["fsdp"].update(dp_replicate=replicate, dp_shard=-1)
    hsdp = sft_result(runner.run(f"hsdp-{replicate}x{nproc // replicate}", config, nproc,
                                 values), args, args.per_gpu_batch * nproc)
    ratio = (hsdp["tokens_per_s"] / fsdp["tokens_per_s"]
             if hsdp.get("tokens_per_s") and fsdp.get("tokens_per_s") else None)
    if ratio is not None:
        log(f"N={nproc}: FSDP {fsdp['tokens_per_s']:.0f} tok/s, HSDP {replicate}x"
            f"{nproc // replicate} {hsdp['tokens_per_s']:.0f} tok/s -> {ratio:.3f}x "
            f"(peak {fsdp['peak_mem_gb']:.1f} vs {hsdp['peak_mem_gb']:.1f} GB)")
    return {"nproc": nproc, "mesh": [replicate, nproc // replicate], "fsdp": fsdp,
            "hsdp": hsdp, "hsdp_vs_fsdp": rounded(ratio), "ok": hsdp["ok"] and fsdp["ok"]}


def part_tp(runner: Runner, args: argparse.Namespace, config: Path, data: Path,
            scaling: dict[str, Any] | None) -> dict[str, Any]:
    """FSDP with tensor-parallel groups against plain FSDP on the largest N."""
    nproc, tp = args.gpus[-1], args.tp
    if nproc < 2 or nproc % tp:
        reason = f"needs N >= 2 divisible by --tp {tp} (N = {nproc})"
        log(f"tp skipped: {reason}")
        return {"skipped": reason, "ok": True}
    values = sft_values(data, args, nproc)
    fsdp = plain_fsdp_result(runner, args, config, values, scaling, "tp")
    values["backend"]["fsdp"]["tp"] = tp
    split = sft_result(runner.run(f"tp-{tp}x{nproc // tp}", config, nproc, values), args,
                       args.per_gpu_batch * nproc)
    ratio = (split["tokens_per_s"] / fsdp["tokens_per_s"]
             if split.get("tokens_per_s") and fsdp.get("tokens_per_s") else None)
    differences = [abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(split.get("losses", []), fsdp.get("losses", []), strict=False)]
    if ratio is not None:
        log(f"N={nproc}: FSDP {fsdp['tokens_per_s']:.0f} tok/s, tp={tp} x dp={nproc // tp} "
            f"{split['tokens_per_s']:.0f} tok/s -> {ratio:.3f}x (peak {fsdp['peak_mem_gb']:.1f}"
            f" vs {split['peak_mem_gb']:.1f} GB); largest relative loss difference "
            f"{max(differences, default=math.inf):.2e}")
    return {"nproc": nproc, "tp": tp, "fsdp": fsdp, "tp_run": split,
            "tp_vs_fsdp": rounded(ratio),
            "max_loss_rel_diff": json_number(max(differences, default=math.inf)),
            "ok": split["ok"] and fsdp["ok"]}


def part_grpo(runner: Runner, args: argparse.Namespace, model_dir: str, root: Path
              ) -> dict[str, Any]:
    """GRPO step time on each N with the same global workload."""
    prompts = write_prompts(root / "data" / "grpo_prompts.jsonl",
                            args.prompts * args.grpo_steps, args.prompt_tokens)
    completions = args.prompts * args.group
    values = base_values(model_dir, args)
    values.update({
        "model": {**values["model"],
                  "max_length": max(4096, args.prompt_tokens + args.max_new_tokens)},
        "data": {"format": "jsonl", "jsonl": {"path": str(prompts)}},
        "algorithm": {"name": "grpo", "grpo": {
            "prompts_per_step": args.prompts, "loss_aggregation": "token-mean",
            "scale_rewards": "group", "kl_beta": 0.0}},
        "rollout": {"engine": "hf", "n": args.group, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "max_new_tokens": args.max_new_tokens,
                    "hf": {"max_batch_size": completions}},
        "rewards": {"components": [{"name": REWARD}]},
        "train": {**values["train"], "lr": args.grpo_lr, "max_steps": args.grpo_steps,
                  "micro_batch_size": args.grpo_micro_batch},
    })
    config = write_toml(root / "configs" / "grpo.toml", values)
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    keys = ("time/rollout_s", "time/reward_s", "time/logprob_s", "time/update_s")
    for nproc in args.gpus:
        if args.prompts % nproc:
            skipped[str(nproc)] = f"--prompts {args.prompts} is not a multiple of {nproc}"
            continue
        run = runner.run(f"grpo-fsdp-{nproc}", config, nproc, {})
        rows = run["rows"]
        r = run_record(run)
        r["ok"] = run["rc"] == 0 and len(rows) == args.grpo_steps
        if rows:
            timed = timed_rows(rows, args.grpo_warmup)
            step = statistics.fmean(x["step_time_s"] for x in timed)
            split = {k.split("/")[1]: rounded(mean_of(timed, k)) for k in keys}
            r.update(
                timed_steps=len(timed), step_s=round(step, 4), **split,
                other_s=round(step - sum(v or 0.0 for v in split.values()), 4),
                first_step_s=round(rows[0]["step_time_s"], 2),
                completions_per_s=round(completions / step, 2),
                rollout_tokens_per_s=rounded((mean_of(timed, "rollout/tokens_per_s") or 0)
                                             * nproc, 1),
                response_length=rounded(mean_of(timed, "response_length/mean"), 1),
                reward=rounded(mean_of(rows, "reward/mean")),
            )
        results[str(nproc)] = r
    measured = [n for n in args.gpus if "step_s" in results.get(str(n), {})]
    base = results[str(measured[0])]["step_s"] if measured else None
    log(f"{'N':>3}{'step s':>9}{'speedup':>9}{'rollout':>9}{'logprob':>9}{'update':>9}"
        f"{'other':>8}{'gen tok/s':>11}{'resp len':>10}")
    for nproc in measured:
        r = results[str(nproc)]
        r["speedup"] = round(base / r["step_s"], 3) if base else None
        log(f"{nproc:>3}{r['step_s']:>9.3f}{r['speedup']:>9.2f}{(r['rollout_s'] or 0):>9.3f}"
            f"{(r['logprob_s'] or 0):>9.3f}{(r['update_s'] or 0):>9.3f}{r['other_s']:>8.3f}"
            f"{r['rollout_tokens_per_s']:>11.0f}{(r['response_length'] or 0):>10.0f}")
    for nproc, reason in skipped.items():
        log(f"grpo N={nproc} skipped: {reason}")
    return {"baseline_nproc": measured[0] if measured else None, "prompts": args.prompts,
            "group": args.group, "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens, "config": str(config), "results": results,
            "skipped": skipped, "ok": all(r["ok"] for r in results.values())}


def part_resume(runner: Runner, args: argparse.Namespace, model_dir: str, root: Path
                ) -> dict[str, Any]:
    """Save at step S on N processes, resume to 2S on fewer, compare with an unbroken run."""
    nproc, s = args.gpus[-1], args.resume_steps
    procs, micro = args.resume_procs, args.micro_batch
    global_batch = args.per_gpu_batch * nproc
    data = write_sft_data(root / "data" / f"resume_{args.resume_seq}.jsonl",
                          global_batch * 2 * s, args.resume_seq, seed=2,
                          vocabulary=RESUME_VOCABULARY)
    values = base_values(model_dir, args)
    values.update({
        "model": {**values["model"], "dtype": "float32", "max_length": args.resume_seq},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "train": {**values["train"], "lr": args.resume_lr, "compile": False,
                  "global_batch_size": global_batch, "micro_batch_size": micro},
    })
    config = write_toml(root / "configs" / "resume.toml", values)
    full = runner.run(f"resume-unbroken-{nproc}", config, nproc,
                      {"train": {"max_steps": 2 * s}})
    first = runner.run(f"resume-first-{nproc}", config, nproc,
                       {"train": {"max_steps": s}, "checkpoint": {"every_steps": s, "keep": 1}})
    checkpoint = Path(first["output_dir"]) / "checkpoints" / f"step_{s}"
    out: dict[str, Any] = {
        "nproc": nproc, "save_step": s, "steps": 2 * s, "dtype": "float32",
        "loss_rtol": LOSS_RTOL, "grad_norm_rtol": GRAD_NORM_RTOL, "checkpoint": str(checkpoint),
        "unbroken": run_record(full), "first": run_record(first),
        "unbroken_losses": [round(r["loss"], 7) for r in full["rows"]],
    }
    before = relative_differences(first["rows"], full["rows"], "loss", range(1, s + 1))
    out["first"]["loss_max_rel_diff"] = json_number(worst(before))
    ok = full["rc"] == 0 and first["rc"] == 0 and (checkpoint / "manifest.json").is_file()
    if not (checkpoint / "manifest.json").is_file():
        log(f"resume: no complete checkpoint at {checkpoint}")
    out["resumed"] = {}
    log(f"{'resumed on':>11}{'max rel loss diff':>19}{'max rel grad-norm diff':>24}{'pass':>6}")
    for m in procs:
        run = runner.run(f"resume-{nproc}-to-{m}", config, m, {
            "train": {"max_steps": 2 * s}, "run": {"resume": str(checkpoint)}})
        steps = range(s + 1, 2 * s + 1)
        loss = relative_differences(run["rows"], full["rows"], "loss", steps)
        grad = relative_differences(run["rows"], full["rows"], "grad_norm", steps)
        passed = (run["rc"] == 0 and [r["step"] for r in run["rows"]] == list(steps)
                  and worst(loss) <= LOSS_RTOL and worst(grad) <= GRAD_NORM_RTOL)
        ok = ok and passed
        out["resumed"][str(m)] = {
            **run_record(run), "loss_max_rel_diff": json_number(worst(loss)),
            "grad_norm_max_rel_diff": json_number(worst(grad)),
            "loss_rel_diff": [json_number(v) for v in loss],
            "losses": [round(r["loss"], 7) for r in run["rows"]], "passed": passed,
        }
        log(f"{m:>11}{worst(loss):>19.2e}{worst(grad):>24.2e}{'yes' if passed else 'NO':>6}")
    log(f"steps 1..{s} of the stopped run vs the unbroken run: max rel loss diff "
        f"{worst(before):.2e}")
    out["ok"] = ok
    return out


# --- main ----------------------------------------------------------------------------------


def model_sizes(args: argparse.Namespace) -> dict[str, str]:
    """The model size of each part (scaling and hsdp share one)."""
    sft = args.size or "1.5b"
    return {
        "scaling": sft,
        "hsdp": sft,
        "tp": sft,
        "grpo": args.grpo_size or args.size or "0.5b",
        "resume": args.resume_size or args.size or "0.5b",
    }


def main() -> int:
    """Run the selected parts and print the summary; 1 when something failed."""
    args = parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sizes = model_sizes(args)
    info = prepare(args, {sizes[p] for p in args.parts})
    if args.compile is None:
        args.compile = args.device == "auto" and info["cuda_devices"] > 0
    if args.device == "auto" and info["cuda_devices"] and info["cuda_devices"] < args.gpus[-1]:
        log(f"--gpus asks for {args.gpus[-1]} processes but {info['cuda_devices']} GPU(s) "
            "are visible")
        return 2
    runner = Runner(args)
    summary: dict[str, Any] = {
        "bench": "multi_gpu", "parts": args.parts, "gpus": args.gpus, "device": args.device,
        "launcher": args.launcher, "sizes": {p: sizes[p] for p in args.parts},
        "cuda_devices": info["cuda_devices"], **info["env"],
        "prepare_command": info["command"],
        "env": {"NCCL_NVLS_ENABLE": "0"}, "extra_overrides": args.extra,
    }
    if {"scaling", "hsdp", "tp"} & set(args.parts):
        model_dir = info["models"][sizes["scaling"]]
        data = write_sft_data(root / "data" / f"sft_{args.seq}.jsonl",
                              args.per_gpu_batch * args.gpus[-1] * args.steps, args.seq, seed=1)
        config = write_toml(root / "configs" / "sft.toml", base_values(model_dir, args))
        if "scaling" in args.parts:
            log("=== scaling: FSDP2 SFT, weak scaling")
            summary["scaling"] = part_scaling(runner, args, config, data)
        if "hsdp" in args.parts:
            log("=== hsdp: replicate x shard against plain FSDP")
            summary["hsdp"] = part_hsdp(runner, args, config, data, summary.get("scaling"))
        if "tp" in args.parts:
            log("=== tp: tensor-parallel groups inside FSDP against plain FSDP")
            summary["tp"] = part_tp(runner, args, config, data, summary.get("scaling"))
    if "grpo" in args.parts:
        log("=== grpo: same global workload on each process count")
        summary["grpo"] = part_grpo(runner, args, info["models"][sizes["grpo"]], root)
    if "resume" in args.parts:
        log("=== resume: checkpoint on N processes, resume on fewer")
        summary["resume"] = part_resume(runner, args, info["models"][sizes["resume"]], root)
    summary["ok"] = all(summary[p]["ok"] for p in args.parts)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    log(f"total {summary['wall_s']:.0f} s; " + ", ".join(
        f"{p} {'ok' if summary[p]['ok'] else 'FAILED'}" for p in args.parts))
    (root / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    emit(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
