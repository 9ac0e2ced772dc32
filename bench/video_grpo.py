"""GRPO step time with video prompts as users run it: ``reasonctl run --algo grpo`` against
TRL's GRPOTrainer (no vLLM), in the same job.

Workload (both sides): a random Qwen2.5-VL-7B- or Qwen3-VL-8B-shaped model (same bf16
initial weights, saved as a model directory), 8 prompts x 8 completions = 64 completions
per optimizer step, each prompt a clip (8 frames of 448x448 at 2 fps) and a 64-word
question, up to ``--max-new-tokens`` sampled tokens at temperature 1, a cheap rule reward
(the fraction of even word ids), group-normalised advantages, token-mean clipped loss (TRL
``loss_type="dapo"``), no KL term, one optimizer step per rollout, bf16 weights, gradient
checkpointing, ``--micro-batch`` completions per forward/backward pass.

reasonctl's side is a real ``python -m reasonctl run --algo grpo --config <file>`` in its
own process (the clips and JSONL rows written here, read by the ``jsonl`` format; the
``hf`` engine shares the policy weights, video prompts decode on the static path, the
update runs the vision tower once per prompt). Its step time is the mean ``step_time_s`` of
the steps after ``--warmup`` in the run's ``metrics.jsonl``; its memory is the run's
``peak_mem_gb`` (most CUDA memory allocated so far) and ``mem_allocated_gb`` (allocated at
the step's end) of every step. ``--steps 20`` is the stability run: the summary's
``memory`` reports the growth of both between step 5 and the last step.

TRL 1.16's GRPOTrainer takes images (an ``images`` column) but no video, so its prompts
carry each clip as 4 images of 448x448 (the first frame of each pair of frames: one image
per temporal patch), the same number of vision tokens and the same vision-tower work as
the clip. ``--input images`` gives reasonctl's prompts those same 4 images (PNG files,
read with PIL) instead of the clip: both sides then take identical inputs and neither
needs a video decoder. TRL's step time is the wall time between optimizer-step ends (after
``--warmup``); it needs ``trl`` and ``torchvision`` (the Hugging Face image processor). If
TRL fails, its error is recorded and reasonctl's figures still print.

    python -m bench.video_grpo --model qwen2_5_vl --steps 4 --trl-steps 2
    python -m bench.video_grpo --model qwen2_5_vl --impls reasonctl --steps 20   # memory
    python -m bench.video_grpo --size tiny --max-new-tokens 8 --steps 3          # CPU smoke

The last line printed is a JSON summary: both step times, ``speedup`` (TRL's step time over
reasonctl's; target >= 10), peak memory of both and reasonctl's memory per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    CliRun,
    emit,
    environment,
    free_memory,
    log,
    tokenizer_dir,
    trl_even_word_reward,
    trl_step_clock,
)
from bench.video_common import (
    FRAME_SIDE,
    MODELS,
    VISION_TOKENS,
    build_vl_model_dir,
    data_values,
    image_rows,
    video_rows,
    write_clips,
    write_frames,
)

MEMORY_FROM_STEP = 5


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_vl", choices=MODELS)
    parser.add_argument("--size", default="full", choices=["full", "small", "tiny"],
                        help="full: 7B/8B shapes; small: 3B/4B; tiny: CPU smoke.")
    parser.add_argument("--impls", default="reasonctl,trl")
    parser.add_argument("--steps", type=int, default=4, help="reasonctl steps (incl. warm-up).")
    parser.add_argument("--trl-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="Completions per forward/backward pass (both sides).")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--input", default="video", choices=["video", "images"],
                        help="reasonctl's prompts: the clip, or its 4 frames as images "
                        "(TRL always takes the 4 images).")
    parser.add_argument("--update-layout", default="auto",
                        choices=["auto", "shared_prompt", "padded"],
                        help="reasonctl's algorithm.grpo.update_layout.")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="reasonctl's algorithm.grpo.micro_batch_tokens.")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def prepare(args: argparse.Namespace) -> tuple[Path, list[Path], Path]:
    """The model directory, the clips and the JSONL rows (enough for every step)."""
    out = Path(args.out)
    model_dir = build_vl_model_dir(out / "models", args.model, args.size)
    count = args.prompts_per_step * max(args.steps, args.trl_steps, 1)
    data = out / "video_grpo" / f"prompts_{args.input}.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    if args.input == "images":
        clips = write_frames(out / "frames", args.prompts_per_step, args.size)
        rows = image_rows(clips, count)
    else:
        clips = write_clips(out / "clips", args.prompts_per_step, args.size)
        rows = video_rows(clips, count)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, clips, data


def run_config(model_dir: Path, data: Path, run_dir: Path, args: argparse.Namespace
               ) -> dict[str, Any]:
    """The config file of reasonctl's run."""
    return {
        "run": {"name": "bench_video_grpo", "output_dir": str(run_dir), "seed": 0},
        "model": {"name_or_path": str(model_dir), "tokenizer": str(tokenizer_dir(model_dir)),
                  "dtype": "bfloat16", "max_length": 8192,
                  "gradient_checkpointing": not args.no_gradient_checkpointing},
        "data": {**data_values(data, args.size), "shuffle": False},
        "algorithm": {"name": "grpo", "grpo": {
            "prompts_per_step": args.prompts_per_step, "loss_aggregation": "token-mean",
            "kl_beta": 0.0, "scale_rewards": "group", "update_layout": args.update_layout,
            **({"micro_batch_tokens": args.micro_batch_tokens}
               if args.micro_batch_tokens else {})}},
        "rollout": {"engine": "hf", "n": args.group, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "max_new_tokens": args.max_new_tokens},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": args.lr, "max_steps": args.steps, "micro_batch_size": args.micro_batch,
                  "schedule": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0},
        # bf16 weights and optimizer state, as TRL trains the bf16 model it is given (float32
        # master weights and AdamW state of an 8B model do not fit one 141 GB GPU)
        "backend": {"name": "single", "single": {"param_dtype": "compute"}},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }


def memory_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Memory of every step and its growth from step ``MEMORY_FROM_STEP`` (or the first
    step, in shorter runs) to the last; None where the run recorded none (CPU)."""
    if not any("peak_mem_gb" in r for r in rows):
        return None
    peak = [round(r.get("peak_mem_gb", 0.0), 3) for r in rows]
    allocated = [round(r.get("mem_allocated_gb", 0.0), 3) for r in rows]
    start = min(MEMORY_FROM_STEP, len(rows)) - 1
    return {"peak_gb": max(peak), "from_step": start + 1, "to_step": len(rows),
            "peak_growth_gb": round(peak[-1] - peak[start], 3),
            "allocated_growth_gb": round(allocated[-1] - allocated[start], 3),
            "peak_per_step": peak, "allocated_per_step": allocated}


def run_reasonctl(model_dir: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``reasonctl run --algo grpo --config <file>`` in its own process; step time and
    memory from its ``metrics.jsonl``."""
    out = data.parent
    run_dir = out / "reasonctl"
    run = CliRun("grpo", run_config(model_dir, data, run_dir, args), out / "reasonctl.toml",
                 run_dir)
    if not run.ok:
        return run.failure()
    rows = run.rows

    def mean(key: str) -> float | None:
        return run.mean(key, args.warmup)

    for row in rows:
        log(f"reasonctl step {row['step']}: {row['step_time_s']:.3f} s (rollout "
            f"{row.get('time/rollout_s', 0):.3f}, update {row.get('time/update_s', 0):.3f}), "
            f"reward {row['reward/mean']:.4f}, len {row['response_length/mean']:.0f}, "
            f"peak {row.get('peak_mem_gb', 0):.2f} GB")
    return {"ok": True, "command": " ".join(run.command), "run_wall_s": run.wall_s,
            "step_s": mean("step_time_s"), "rollout_s": mean("time/rollout_s"),
            "logprob_s": mean("time/logprob_s"), "update_s": mean("time/update_s"),
            "rollout_tokens_per_s": mean("rollout/tokens_per_s"),
            "response_length": mean("response_length/mean"),
            "logprob_gap_max": max((r.get("rollout/logprob_gap", 0.0) for r in rows),
                                   default=None),
            "steps": len(rows), "memory": memory_summary(rows)}


def clip_images(clip: Path, size: str) -> list[Any]:
    """The first frame of each pair of the clip's 8 frames, as PIL images."""
    import av
    from PIL import Image

    with av.open(str(clip)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    side = FRAME_SIDE[size]
    return [Image.fromarray(frames[i]).resize((side, side)) for i in range(0, 8, 2)]


def trl_dataset(data: Path, clips: list[Path], args: argparse.Namespace) -> Any:
    """TRL's rows: the question as a user turn and the clip's 4 frames in ``images`` (TRL
    puts the image placeholders before the text)."""
    from datasets import Dataset
    from PIL import Image

    prompts, frames = [], []
    if args.input == "images":
        images = {str(c): [Image.open(c / f"{k}.png").convert("RGB") for k in range(4)]
                  for c in clips}
    else:
        images = {str(c): clip_images(c, args.size) for c in clips}
    for line in data.read_text().splitlines()[: args.prompts_per_step * args.trl_steps]:
        *media, question = json.loads(line)["prompt"]
        source = media[0].get("video") or str(Path(media[0]["image"]).parent)
        prompts.append([{"role": "user", "content": question}])
        frames.append(images[source])
    return Dataset.from_dict({"prompt": prompts, "images": frames})


def run_trl(model_dir: Path, data: Path, clips: list[Path], args: argparse.Namespace
            ) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same workload (clips as 4 images each, see the module
    docstring); step time between optimizer-step ends."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    processor = AutoProcessor.from_pretrained(tokenizer_dir(model_dir))
    dataset = trl_dataset(data, clips, args)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.to(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    total = args.prompts_per_step * args.group
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trl-video-grpo"),
        per_device_train_batch_size=min(args.micro_batch, total),
        gradient_accumulation_steps=max(1, total // min(args.micro_batch, total)),
        num_generations=args.group, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo",
        scale_rewards="group", learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=device == "cuda",
        gradient_checkpointing=not args.no_gradient_checkpointing, logging_steps=1,
        max_steps=args.trl_steps, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=0, use_vllm=False, use_cpu=device == "cpu",
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
        # as reasonctl's rollouts: never sample a vision token (TRL suppresses only the
        # image placeholder; a sampled video placeholder would break its update)
        generation_kwargs={"suppress_tokens": processor.tokenizer.convert_tokens_to_ids(
            VISION_TOKENS)},
    )
    clock = trl_step_clock(label="trl")
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_even_word_reward], args=config,
                          train_dataset=dataset, processing_class=processor,
                          callbacks=[clock])
    trainer.train()
    times = clock.steps()
    timed = times[args.warmup :] or times
    lengths = [entry["completions/mean_length"] for entry in clock.logs
               if "completions/mean_length" in entry]
    del trainer
    return {"ok": True, "step_s": round(statistics.fmean(timed), 4),
            "step_times": [round(t, 3) for t in times],
            "response_length": statistics.fmean(lengths) if lengths else None,
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3)
            if device == "cuda" else None}


def main() -> None:
    """Run the implementations and print the comparison."""
    args = parse_args()
    model_dir, clips, data = prepare(args)
    free_memory()
    summary: dict[str, Any] = {
        "bench": "video_grpo", "model": args.model, "size": args.size,
        "reasonctl_input": args.input, "update_layout": args.update_layout,
        "completions": args.prompts_per_step * args.group,
        "max_new_tokens": args.max_new_tokens, "trl_input": "each clip as 4 images",
        **environment(), "results": {},
    }
    for impl in args.impls.split(","):
        free_memory()
        log(f"--- {impl}")
        try:
            if impl == "reasonctl":
                summary["results"][impl] = run_reasonctl(model_dir, data, args)
            else:
                summary["results"][impl] = run_trl(model_dir, data, clips, args)
        except Exception as exc:  # a failing baseline must not hide the other figures
            log(traceback.format_exc())
            summary["results"][impl] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    mine = summary["results"].get("reasonctl", {})
    theirs = summary["results"].get("trl", {})
    if mine.get("ok") and theirs.get("ok"):
        summary["speedup"] = round(theirs["step_s"] / mine["step_s"], 2)
        summary["target_met"] = summary["speedup"] >= 10
        log(f"reasonctl {mine['step_s']:.3f} s/step vs TRL {theirs['step_s']:.3f} s/step: "
            f"{summary['speedup']:.2f}x")
    summary["peak_mem_gb"] = {
        "reasonctl": (mine.get("memory") or {}).get("peak_gb"),
        "trl": theirs.get("peak_mem_gb")}
    emit(summary)


if __name__ == "__main__":
    main()
