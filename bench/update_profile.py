"""Where a video GRPO update's time goes: padded rows against shared-prompt micro-batches.

One job, one model (the random Qwen2.5-VL-7B- or Qwen3-VL-8B-shaped VLM of
:mod:`bench.video_common`, bf16 weights and optimizer state as in ``bench.video_grpo``,
gradient checkpointing), ``--groups`` video prompts (8 frames of 448x448 at 2 fps and a
64-word question, encoded by a run's processor) x ``--n`` completions of ``--new-tokens``
random word tokens. For each layout the backend's ``train_step`` runs the GRPO loss over
all rows (the update of one step), ``--repeats`` times after a warm-up:

- ``padded``: ``--micro-batch`` rows per micro-batch, each row repeating its prompt (the
  update as it ran before shared-prompt rows);
- ``shared_prompt``: micro-batches of whole prompts, each prompt once followed by its
  completions, under a budget of ``--micro-batch`` x the longest row (the GRPO default).

Reported per layout: seconds per update, tokens the model processed, micro-batches, peak
memory, model FLOPs utilisation of the work each layout does (the language model's ``6N``
per processed token and ``12 x layers x hidden`` per attended query-key pair, the vision
tower's ``6 x params`` per patch it encodes; recompute not counted), and the padded
layout's work over the same time (``padded_equivalent_mfu``). With ``--profile`` one
micro-batch of each layout runs under ``torch.profiler`` and the table of its most
expensive operators is written under ``--out`` and summarised (the top operators' share of
device time).

    python -m bench.update_profile --model qwen2_5_vl --groups 2 --profile
    python -m bench.update_profile --size tiny --groups 2 --new-tokens 8       # CPU smoke

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    PEAK_FLOPS,
    emit,
    environment,
    free_memory,
    log,
    now,
    peak_memory_gb,
    reasonctl_backend,
    sync,
    tokenizer_dir,
    word_count,
)
from bench.video_common import MODELS, build_vl_model_dir, data_values, video_rows, write_clips


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_vl", choices=MODELS)
    parser.add_argument("--size", default="full", choices=["full", "small", "tiny"])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--layouts", default="padded,shared_prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def build(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """The backend (bf16 weights and optimizer state, checkpointing) and the training rows."""
    from reasonctl.algorithms.policy_batch import policy_rows
    from reasonctl.core.types import Completion, RolloutGroup
    from reasonctl.runtime.composition import build_dataset, build_processor

    out = Path(args.out)
    model_dir = build_vl_model_dir(out / "models", args.model, args.size)
    clips = write_clips(out / "clips", args.groups, args.size)
    data = out / "update_profile" / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in video_rows(clips, args.groups)))
    backend, ctx = reasonctl_backend(model_dir, data.parent, values={
        "model": {"max_length": 8192, "tokenizer": str(tokenizer_dir(model_dir)),
                  "gradient_checkpointing": True},
        "data": data_values(data, args.size),
        "train": {"lr": 1e-6, "schedule": "constant", "micro_batch_size": args.micro_batch},
        "backend": {"name": "single", "single": {"param_dtype": "compute"}},
    })
    ctx.processor = build_processor(ctx)
    dataset = build_dataset(ctx)
    generator = torch.Generator().manual_seed(0)
    groups = []
    for index in range(len(dataset)):
        sample = dataset[index]
        prompt = ctx.processor.encode_prompt(sample)
        completions = []
        for _ in range(args.n):
            ids = torch.randint(0, word_count(), (args.new_tokens,), generator=generator)
            completions.append(Completion(text="", token_ids=ids.tolist(),
                                          logprobs=[-1.0] * args.new_tokens,
                                          finish_reason="length"))
        groups.append(RolloutGroup(sample=sample, prompt_ids=prompt.input_ids,
                                   completions=completions, prompt=prompt))
    advantages = torch.randn(args.groups * args.n, generator=generator).tolist()
    return backend, ctx, policy_rows(groups, advantages)


def micro_batches(layout: str, rows: list[Any], pad_id: int, size: int) -> list[Any]:
    """The update's micro-batches in ``layout``."""
    from reasonctl.algorithms.policy_batch import (
        chunked,
        collate_policy_rows,
        shared_prompt_micro_batches,
    )

    if layout == "padded":
        return [collate_policy_rows(chunk, pad_id) for chunk in chunked(rows, size)]
    budget = size * max(len(r.encoded.input_ids) for r in rows)
    return [batch for _, batch in shared_prompt_micro_batches(rows, pad_id, budget=budget)]


def loss_fn(tokens: float) -> Any:
    """GRPO's token-mean clipped loss against detached log-probs (one update per rollout)."""
    from reasonctl.algorithms.grpo_loss import PolicyLossSettings, policy_loss

    settings = PolicyLossSettings()

    def compute(outputs: Any, batch: dict[str, Any]) -> Any:
        logprobs = outputs.logprobs
        device = logprobs.device
        return policy_loss(logprobs, logprobs.detach(), batch["advantages"].to(device),
                           batch["loss_mask"][:, 1:].to(device), settings,
                           num_tokens=tokens, num_sequences=float(batch["advantages"].numel()))

    return compute


def processed_tokens(layout: str, batches: list[Any]) -> int:
    """Tokens the model runs: padded rows' width x rows, or the packed rows' lengths."""
    if layout == "padded":
        return sum(int(b["input_ids"].numel()) for b in batches)
    return sum(b["shared_prompt"].layout.length for b in batches)


def attention_pairs(layout: str, rows: list[Any]) -> int:
    """Query-key pairs causal attention computes: each padded row's own triangle, or per
    prompt its triangle plus each completion's keys (the prompt's and its own)."""
    if layout == "padded":
        return sum(len(r.encoded.input_ids) * (len(r.encoded.input_ids) + 1) // 2 for r in rows)
    total = 0
    for index, row in enumerate(rows):
        prompt, length = row.prompt_len, row.completion_len
        if index == 0 or rows[index - 1].group != row.group:
            total += prompt * (prompt + 1) // 2
        total += length * prompt + length * (length + 1) // 2
    return total


def update_flops(backend: Any, tokens: int, pairs: int, patches: int) -> float:
    """Model FLOPs of an update: ``6 x params`` per language token (embeddings left out)
    and per vision patch, ``12 x layers x hidden`` per attended query-key pair; recompute
    not counted."""
    model = backend.hf_model
    text = model.config.text_config
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    language = backend.parameter_counts.total - vision - text.vocab_size * text.hidden_size
    attention = 12.0 * text.num_hidden_layers * text.hidden_size * pairs
    return 6.0 * language * tokens + attention + 6.0 * vision * patches


def profile_table(backend: Any, batch: Any, tokens: float, path: Path) -> dict[str, Any]:
    """One micro-batch under ``torch.profiler``: the operator table (``path``) and the top
    operators' share of device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        backend.train_step([batch], loss_fn(tokens))
        sync()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by=sort, row_limit=40))
    attribute = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    rows = sorted(averages, key=lambda e: getattr(e, attribute, 0.0), reverse=True)
    total = sum(getattr(e, attribute, 0.0) for e in averages) or 1.0
    return {"table": str(path), "device_ms": round(total / 1e3, 1),
            "top": [{"op": e.key[:60], "share": round(getattr(e, attribute, 0.0) / total, 3),
                     "calls": e.count} for e in rows[:12]]}


def main() -> None:
    """Time (and profile) each layout's update."""
    args = parse_args()
    backend, ctx, rows = build(args)
    pad_id = ctx.processor.pad_id
    tokens = float(sum(r.completion_len for r in rows))
    patches = sum(int(r.encoded.extras["video_grid_thw"].prod(-1).sum())
                  for r in rows[:: args.n] if "video_grid_thw" in r.encoded.extras)
    padded_tokens = sum(len(r.encoded.input_ids) for r in rows)
    summary: dict[str, Any] = {"bench": "update_profile", "model": args.model,
                               "size": args.size, "groups": args.groups, "n": args.n,
                               "new_tokens": args.new_tokens,
                               "prompt_tokens": rows[0].prompt_len,
                               "vision_patches_per_step": patches, **environment(),
                               "results": {}}
    for layout in args.layouts.split(","):
        free_memory()
        batches = micro_batches(layout, rows, pad_id, args.micro_batch)
        backend.train_step(batches, loss_fn(tokens))  # warm-up: kernels, allocator
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            start = now()
            backend.train_step(batches, loss_fn(tokens))
            sync()
            times.append(now() - start)
        seconds = statistics.median(times)
        processed = processed_tokens(layout, batches)
        flops = update_flops(backend, processed, attention_pairs(layout, rows),
                             patches * (args.n if layout == "padded" else 1))
        padded_flops = update_flops(backend, padded_tokens, attention_pairs("padded", rows),
                                    patches * args.n)
        result = {"update_s": round(seconds, 3), "times": [round(t, 3) for t in times],
                  "micro_batches": len(batches), "processed_tokens": processed,
                  "mfu": round(flops / seconds / PEAK_FLOPS, 3),
                  "padded_equivalent_mfu": round(padded_flops / seconds / PEAK_FLOPS, 3),
                  "peak_mem_gb": round(peak_memory_gb(), 2)}
        if args.profile:
            path = Path(args.out) / f"profile_{args.model}_{layout}.txt"
            result["profile"] = profile_table(backend, batches[0], tokens, path)
        log(f"{layout}: {seconds:.3f} s/update over {processed} tokens in {len(batches)} "
            f"micro-batches, MFU {result['mfu']:.3f}, peak {result['peak_mem_gb']} GB")
        summary["results"][layout] = result
    both = summary["results"]
    if "padded" in both and "shared_prompt" in both:
        summary["speedup"] = round(both["padded"]["update_s"] / both["shared_prompt"]["update_s"],
                                   2)
    emit(summary)


if __name__ == "__main__":
    main()
