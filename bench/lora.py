"""LoRA: reasonctl's SFT against TRL's SFTTrainer, and LoRA GRPO against full-weight GRPO.

SFT (``--size``, default a random Qwen2.5-7B-shaped model, bf16 base weights): the same
rows (``--batch`` chat rows of ``--seq`` tokens per optimizer step, word tokenizer of
:mod:`bench.common`), the same peft config (rank 16, alpha 32, no dropout, the attention
and MLP projections of every layer), AdamW, constant learning rate, clipping at 1.0,
gradient checkpointing on both sides unless ``--no-gradient-checkpointing``:

- ``reasonctl``: ``reasonctl run --algo sft --config lora_sft.toml`` (``[model.lora]``,
  ``single`` backend; float32 adapters under bf16 autocast), tokens/s from the run's
  ``metrics.jsonl`` (``tokens_per_s``) and peak memory from its ``peak_mem_gb``;
- ``trl``: ``trl.SFTTrainer`` with ``peft_config`` on the same token ids (``bf16=True``).

GRPO (``--grpo-size``, default 1.5B: full-weight GRPO of a 7B model does not fit one
GPU): ``reasonctl run --algo grpo`` with full weights and with ``[model.lora]``, both with
the engine holding its own copy (``rollout.hf.share_weights = false``, so each step syncs
weights: all tensors for full weights, only the merged adapted layers for LoRA); step time
and weight-sync time (``time/step_s``, ``time/weight_sync_s``, ``weight_sync/mb``) are
medians over the steps after ``--warmup``.

Each run is its own process (a fresh CUDA context: peak memory is that run's). On a CPU
``--size tiny --grpo-size tiny`` runs everything in a few minutes:

    python -m bench.lora                                   # 7B SFT vs TRL, 1.5B GRPO
    python -m bench.lora --size tiny --grpo-size tiny --seq 64 --batch 2 --steps 3 \\
        --warmup 1 --grpo-steps 3 --max-new-tokens 8 --prompts-per-step 2 --group 4

The last line printed is a JSON summary.
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

from bench.common import (
    build_model_dir,
    emit,
    environment,
    log,
    random_rows,
    tokenizer_dir,
    trl_step_clock,
    words,
)

LORA = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
"""The adapters of both sides (TRL gets the same as a peft ``LoraConfig``)."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""What ``target_modules = "all-linear"`` adapts in a Qwen2 model."""
USER_WORDS = 16
CHAT_OVERHEAD = 6
"""Tokens the chat template adds around a user and an assistant turn."""
REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="7b", choices=["7b", "1.5b", "0.5b", "tiny"])
    parser.add_argument("--grpo-size", default="1.5b", choices=["7b", "1.5b", "0.5b", "tiny"])
    parser.add_argument("--parts", default="sft,grpo")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="SFT: train.compile on reasonctl's side, torch_compile on TRL's.")
    parser.add_argument("--grpo-steps", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", default="/tmp/reasonctl-bench-lora")
    parser.add_argument("--worker", choices=["trl-sft"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    return parser.parse_args()


# --- SFT ------------------------------------------------------------------------------------


def write_sft_data(path: Path, args: argparse.Namespace) -> Path:
    """``steps x batch`` chat rows of exactly ``--seq`` tokens (random words)."""
    answer_words = args.seq - USER_WORDS - CHAT_OVERHEAD
    rows = random_rows(args.steps * args.batch, USER_WORDS + answer_words, seed=1)
    with path.open("w") as handle:
        for row in rows:
            messages = [{"role": "user", "content": words(row[:USER_WORDS])},
                        {"role": "assistant", "content": words(row[USER_WORDS:])}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def sft_reasonctl(model_dir: Path, data: Path, out: Path, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """``reasonctl run --algo sft`` with ``[model.lora]``; throughput from its metrics."""
    config = {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "dtype": "bfloat16", "max_length": args.seq,
                  "gradient_checkpointing": not args.no_gradient_checkpointing,
                  "lora": LORA},
        "data": {"format": "jsonl", "shuffle": False, "jsonl": {"path": str(data)}},
        "train": {"lr": args.lr, "max_steps": args.steps, "global_batch_size": args.batch,
                  "micro_batch_size": args.batch, "weight_decay": 0.0, "max_grad_norm": 1.0,
                  "compile": args.compile},
        "algorithm": {"name": "sft"},
        "backend": {"name": "single"},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    rows = run_reasonctl(config, out)
    if "error" in rows:
        return rows
    timed = rows["rows"][args.warmup:] or rows["rows"]
    return {
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in timed),
        "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in rows["rows"]),
        "losses": [round(r["loss"], 4) for r in rows["rows"]],
        "wall_s": rows["wall_s"],
    }


def sft_trl_worker(args: argparse.Namespace) -> None:
    """(In its own process.) TRL's SFTTrainer with peft on the rows reasonctl trained on."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from reasonctl import ChatProcessor, ContentPart, Message, Sample

    model_dir = Path(args.model)
    processor = ChatProcessor.from_pretrained(tokenizer_dir(model_dir), max_length=args.seq)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    samples = [Sample([Message(m["role"], [ContentPart("text", text=m["content"])])
                       for m in row["messages"]]) for row in rows]
    ids = [list(processor.encode_sft(sample).input_ids) for sample in samples]

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *_: Any, **__: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.to("cuda" if cuda else "cpu")
    peft_config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                             lora_dropout=LORA["dropout"], target_modules=TARGETS,
                             bias="none", task_type="CAUSAL_LM")
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, gradient_checkpointing=not args.no_gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", max_length=args.seq,
        disable_tqdm=True, seed=0, optim="adamw_torch_fused" if cuda else "adamw_torch",
        use_cpu=not cuda, torch_compile=args.compile,
    )
    clock = trl_step_clock()
    trainer = InOrder(model=model, args=config, peft_config=peft_config,
                      train_dataset=Dataset.from_dict({"input_ids": ids}),
                      processing_class=AutoTokenizer.from_pretrained(tokenizer_dir(model_dir)),
                      callbacks=[clock])
    trainer.train()
    times = clock.steps()
    timed = times[args.warmup:] or times
    tokens = [sum(len(r) for r in ids[i * args.batch:(i + 1) * args.batch])
              for i in range(args.steps)]
    print(json.dumps({
        "tokens_per_s": sum(tokens[args.warmup:] or tokens) / sum(timed),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        "losses": [round(x, 4) for x in clock.losses],
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }))


def sft_trl(model_dir: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`sft_trl_worker` in a fresh process."""
    command = [sys.executable, "-m", "bench.lora", "--worker", "trl-sft", "--model",
               str(model_dir), "--data", str(data), "--out", args.out,
               "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--lr", str(args.lr)]
    if args.no_gradient_checkpointing:
        command.append("--no-gradient-checkpointing")
    if args.compile:
        command.append("--compile")
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- GRPO -----------------------------------------------------------------------------------


def grpo_run(model_dir: Path, prompts: Path, out: Path, args: argparse.Namespace, *,
             lora: bool) -> dict[str, Any]:
    """``reasonctl run --algo grpo`` with full weights or LoRA; step and sync medians."""
    model: dict[str, Any] = {"name_or_path": str(model_dir),
                             "tokenizer": str(tokenizer_dir(model_dir)), "dtype": "bfloat16",
                             "max_length": 2 * args.max_new_tokens + 256}
    if lora:
        model["lora"] = LORA
    config = {
        "run": {"output_dir": str(out), "seed": 0},
        "model": model,
        "data": {"format": "jsonl", "jsonl": {"path": str(prompts)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": args.prompts_per_step,
                                               "loss_aggregation": "token-mean"}},
        "rollout": {"n": args.group, "max_new_tokens": args.max_new_tokens,
                    "temperature": 1.0, "hf": {"share_weights": False}},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": 1e-5 if not lora else 1e-4, "max_steps": args.grpo_steps,
                  "micro_batch_size": args.group * 2},
        "backend": {"name": "single", "single": {"param_dtype": "compute"}},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    rows = run_reasonctl(config, out)
    if "error" in rows:
        return rows
    timed = rows["rows"][args.warmup:] or rows["rows"]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    return {"step_s": median("time/step_s"), "weight_sync_s": median("time/weight_sync_s"),
            "weight_sync_mb": median("weight_sync/mb"),
            "weight_sync_tensors": median("weight_sync/tensors"),
            "rollout_s": median("time/rollout_s"), "update_s": median("time/update_s"),
            "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in rows["rows"]),
            "reward": [round(r["reward/mean"], 4) for r in rows["rows"]]}


# --- running ----------------------------------------------------------------------------------


def run_reasonctl(config: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write ``config`` as TOML and run ``reasonctl run`` on it; the metrics rows."""
    import time

    import tomli_w

    out.mkdir(parents=True, exist_ok=True)
    config_file = out.with_suffix(".toml")
    config_file.write_text(tomli_w.dumps(config))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--config",
                           str(config_file)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rows": [r for r in rows if "loss" in r], "wall_s": wall}


def main() -> None:
    """Run the parts asked for and print the comparison."""
    args = parse_args()
    if args.worker == "trl-sft":
        sft_trl_worker(args)
        return
    out = Path(args.out)
    summary: dict[str, Any] = {"bench": "lora", **environment(), "lora": LORA}
    parts = args.parts.split(",")
    if "sft" in parts:
        model_dir = build_model_dir(out / "models", args.size)
        data = write_sft_data(out / f"sft-{args.size}-{args.seq}.jsonl", args)
        log(f"--- sft {args.size}: reasonctl")
        mine = sft_reasonctl(model_dir, data, out / f"sft-reasonctl-{args.size}", args)
        log(f"reasonctl: {mine}")
        log(f"--- sft {args.size}: trl")
        theirs = sft_trl(model_dir, data, args)
        log(f"trl: {theirs}")
        ratio = None
        if "error" not in mine and "error" not in theirs:
            ratio = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3)
        summary["sft"] = {"size": args.size, "seq": args.seq, "batch": args.batch,
                          "gradient_checkpointing": not args.no_gradient_checkpointing,
                          "reasonctl": mine, "trl": theirs, "speedup_vs_trl": ratio}
    if "grpo" in parts:
        model_dir = build_model_dir(out / "models", args.grpo_size)
        prompts = out / f"grpo-prompts-{args.grpo_size}.jsonl"
        rows = random_rows(256, 120, seed=2)
        prompts.write_text("".join(json.dumps({"prompt": words(r)}) + "\n" for r in rows))
        results = {}
        for name, lora in (("full", False), ("lora", True)):
            log(f"--- grpo {args.grpo_size}: {name}")
            results[name] = grpo_run(model_dir, prompts, out / f"grpo-{name}-{args.grpo_size}",
                                     args, lora=lora)
            log(f"{name}: {results[name]}")
        summary["grpo"] = {"size": args.grpo_size, "prompts_per_step": args.prompts_per_step,
                           "group": args.group, "max_new_tokens": args.max_new_tokens,
                           **results}
    emit(summary)


if __name__ == "__main__":
    main()
