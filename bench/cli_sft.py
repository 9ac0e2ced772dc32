"""SFT throughput as users run it: ``reasonctl run`` with a config file against TRL's SFTTrainer.

Both train the same random Qwen2.5-shaped model (identical bf16 weights, :mod:`bench.common`)
on the same chat rows in the same order: ``--batch`` rows of exactly ``--seq`` tokens per
optimizer step (a user turn of random words and an answer; loss on the answer and its
end-of-turn token), AdamW (fused), constant learning rate, clipping at 1.0, bf16.

- ``reasonctl``: ``python -m reasonctl run --algo sft --config <file>`` in its own process,
  reading the data file (JSON Lines), with ``backend.single.param_dtype = "compute"`` and
  ``train.compile = true`` (``--no-compile`` to turn it off); tokens/s from the run's
  ``metrics.jsonl`` (the steps after ``--warmup``: input tokens / summed ``step_time_s``).
- ``trl``: ``SFTTrainer`` on the same rows as a conversational prompt/completion dataset
  (TRL applies the chat template and masks the prompt), in this process; step times from a
  callback.

    python -m bench.cli_sft --size 0.5b
    python -m bench.cli_sft --size 1.5b --steps 24
    python -m bench.cli_sft --size tiny --seq 256 --batch 2 --steps 4 --warmup 1 --impls reasonctl

The last line printed is a JSON summary (tokens/s of each, their ratio, losses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import build_model_dir, emit, environment, log, now, tokenizer_dir, trl_step_clock
from bench.multi_gpu import SFT_PROMPT_WORDS, write_sft_data


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--impls", default="reasonctl,trl")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--out", default="outputs/bench_cli_sft")
    return parser.parse_args()


def rows_file(out: Path, args: argparse.Namespace) -> Path:
    """The chat rows both implementations train on."""
    return write_sft_data(out / "data" / f"sft-{args.seq}.jsonl", args.batch * args.steps,
                          args.seq, seed=11)


def run_reasonctl(model_dir: Path, data: Path, args: argparse.Namespace, out: Path
                  ) -> dict[str, Any]:
    """``reasonctl run`` with a config file; throughput from its metrics."""
    import tomli_w

    run_dir = out / "reasonctl"
    config = {
        "run": {"name": "bench_cli_sft", "output_dir": str(run_dir), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "dtype": "bfloat16", "max_length": args.seq, "attention": args.attention},
        "data": {"format": "jsonl", "shuffle": False, "jsonl": {"path": str(data)}},
        "train": {"lr": args.lr, "max_steps": args.steps, "global_batch_size": args.batch,
                  "micro_batch_size": args.micro_batch, "schedule": "constant",
                  "weight_decay": 0.0, "max_grad_norm": 1.0, "compile": not args.no_compile},
        "backend": {"name": "single", "single": {"param_dtype": "compute"}},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    path = out / "reasonctl.toml"
    path.write_text(tomli_w.dumps(config))
    command = [sys.executable, "-m", "reasonctl", "run", "--algo", "sft", "--config", str(path)]
    started = now()
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    wall = now() - started
    if done.returncode != 0:
        log(done.stderr[-3000:])
        return {"ok": False, "rc": done.returncode, "command": " ".join(command)}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > args.warmup]
    tokens = args.batch * args.seq
    seconds = sum(r["step_time_s"] for r in timed)
    return {
        "ok": True, "command": " ".join(command), "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens * len(timed) / seconds, 1),
        "step_s": round(seconds / len(timed), 4),
        "data_wait_s": round(statistics.fmean(r.get("data_s", 0.0) for r in timed), 5),
        "mfu": round(statistics.fmean(r["mfu"] for r in timed), 4) if "mfu" in timed[0] else None,
        "peak_mem_gb": max((r.get("peak_mem_gb", 0.0) for r in rows), default=0.0),
        "losses": [round(r["loss"], 4) for r in rows],
    }


def run_trl(model_dir: Path, data: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """TRL's SFTTrainer on the same rows (conversational prompt/completion), in order."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *_: Any, **__: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    records = [json.loads(line) for line in data.read_text().splitlines()]
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": r["prompt"]}] for r in records],
        "completion": [[{"role": "assistant", "content": r["response"]}] for r in records],
    })
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=args.attention).to(device)
    config = SFTConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=device == "cuda", logging_steps=1, save_strategy="no", report_to="none",
        max_length=args.seq, disable_tqdm=True, seed=0, use_cpu=device == "cpu",
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
    )
    clock = trl_step_clock(synchronize=True)
    trainer = InOrder(model=model, args=config, train_dataset=dataset,
                      processing_class=AutoTokenizer.from_pretrained(tokenizer_dir(model_dir)),
                      callbacks=[clock])
    trainer.train()
    times = clock.steps()[args.warmup:]
    tokens = args.batch * args.seq
    return {"ok": True, "tokens_per_s": round(tokens * len(times) / sum(times), 1),
            "step_s": round(statistics.fmean(times), 4),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)
            if device == "cuda" else 0.0,
            "losses": [round(x, 4) for x in clock.losses]}


def main() -> None:
    """Run the selected implementations and print the JSON summary."""
    args = parse_args()
    if args.seq <= SFT_PROMPT_WORDS + 8:
        raise SystemExit(f"--seq must exceed {SFT_PROMPT_WORDS + 8}")
    out = Path(args.out)
    model_dir = build_model_dir(out / "models", args.size)
    data = rows_file(out, args)
    results: dict[str, Any] = {}
    for impl in args.impls.split(","):
        log(f"--- {impl}")
        results[impl] = (run_reasonctl if impl == "reasonctl" else run_trl)(
            model_dir, data, args, out)
    summary: dict[str, Any] = {"bench": "cli_sft", "size": args.size, "seq": args.seq,
                               "batch": args.batch, **environment(), "results": results}
    mine, theirs = results.get("reasonctl", {}), results.get("trl", {})
    if mine.get("ok") and theirs.get("ok"):
        summary["ratio"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3)
    emit(summary)


if __name__ == "__main__":
    main()
