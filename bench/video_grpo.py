"""GRPO step time with video prompts: reasonctl's GRPO against TRL's GRPOTrainer (no vLLM).

Workload (both sides): a random Qwen2.5-VL-7B- or Qwen3-VL-8B-shaped model (same bf16
initial weights), 8 prompts x 8 completions = 64 completions per optimizer step, each
prompt a clip (8 frames of 448x448 at 2 fps) and a 64-word question, up to
``--max-new-tokens`` sampled tokens at temperature 1, a cheap rule reward (the fraction of
even word ids), group-normalised advantages, token-mean clipped loss (TRL
``loss_type="dapo"``), no KL term, one optimizer step per rollout, bf16 weights, gradient
checkpointing, ``--micro-batch`` completions per forward/backward pass.

reasonctl runs its ``grpo`` algorithm step by step on the run's composition (the data read
from a JSONL file by the ``jsonl`` format, the processor, the ``hf`` engine sharing the
policy weights: video prompts decode on the static path; the update runs the vision tower
once per prompt). ``--steps 20`` is the stability run: allocated GPU memory after every
step shows whether anything accumulates.

TRL 1.x's GRPOTrainer takes images but no video tensors in its forward pass, so its prompts
carry each clip as 4 images of 448x448 (the first frame of each pair of frames: one image
per temporal patch), the same number of vision tokens and the same vision-tower work as
the clip. Its step time is wall time between optimizer-step ends; it needs ``trl`` and
``torchvision`` (the Hugging Face image processor). If TRL fails, its error is recorded and
reasonctl's figures still print.

    python -m bench.video_grpo --model qwen2_5_vl
    python -m bench.video_grpo --model qwen3_vl
    python -m bench.video_grpo --model qwen2_5_vl --impls reasonctl --steps 20   # stability
    python -m bench.video_grpo --size tiny --max-new-tokens 8                     # CPU smoke

The last line printed is a JSON summary.
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
    emit,
    environment,
    free_memory,
    log,
    now,
    reasonctl_backend,
    tokenizer_dir,
    trl_even_word_reward,
)
from bench.video_common import (
    FRAME_SIDE,
    MODELS,
    build_vl_model_dir,
    data_values,
    video_rows,
    write_clips,
)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_vl", choices=MODELS)
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--impls", default="reasonctl,trl")
    parser.add_argument("--steps", type=int, default=3, help="reasonctl steps (incl. warm-up).")
    parser.add_argument("--trl-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="Completions per forward/backward pass (both sides).")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def prepare(args: argparse.Namespace) -> tuple[Path, list[Path], Path]:
    """The model directory, the clips and the JSONL rows (enough for every step)."""
    out = Path(args.out)
    model_dir = build_vl_model_dir(out / "models", args.model, args.size)
    clips = write_clips(out / "clips", args.prompts_per_step, args.size)
    data = out / "run" / "video_grpo" / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    rows = video_rows(clips, args.prompts_per_step * max(args.steps, args.trl_steps, 1))
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, clips, data


def run_reasonctl(model_dir: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """reasonctl's GRPO step by step; per-step metrics and memory."""
    from reasonctl.algorithms.grpo import GRPO
    from reasonctl.core.composition import compose
    from reasonctl.core.protocols import algorithm_needs

    out = data.parent
    backend, ctx = reasonctl_backend(model_dir, out, values={
        "model": {"max_length": 8192, "tokenizer": str(tokenizer_dir(model_dir)),
                  "gradient_checkpointing": not args.no_gradient_checkpointing},
        "data": {**data_values(data, args.size), "shuffle": False},
        "algorithm": {"name": "grpo", "grpo": {
            "prompts_per_step": args.prompts_per_step, "loss_aggregation": "token-mean",
            "kl_beta": 0.0, "scale_rewards": "group"}},
        "rollout": {"engine": "hf", "n": args.group, "temperature": 1.0,
                    "max_new_tokens": args.max_new_tokens},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": args.lr, "micro_batch_size": args.micro_batch, "max_steps": args.steps},
    })
    options = ctx.component_config("algorithm", "grpo")
    algorithm = GRPO(options)
    compose(ctx, algorithm_needs(algorithm, options))
    algorithm.setup(ctx)
    steps: list[dict[str, float]] = []
    for index in range(args.steps):
        started = now()
        metrics = dict(algorithm.step(ctx))
        metrics["wall_s"] = now() - started
        ctx.step += 1
        if torch.cuda.is_available():
            metrics["mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
            metrics["mem_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        steps.append(metrics)
        log(f"reasonctl step {index}: {metrics['wall_s']:.3f} s (rollout "
            f"{metrics['time/rollout_s']:.3f}, logprob {metrics['time/logprob_s']:.3f}, "
            f"update {metrics['time/update_s']:.3f}), reward {metrics['reward/mean']:.4f}, "
            f"len {metrics['response_length/mean']:.0f}, "
            f"rollout {metrics['rollout/tokens_per_s']:.0f} tok/s, "
            f"gap {metrics['rollout/logprob_gap']:.4f}, "
            f"mem {metrics.get('mem_allocated_gb', 0):.2f}/{metrics.get('mem_peak_gb', 0):.2f} GB")
    decode = getattr(getattr(ctx.engine, "last_stats", None), "decode", None)
    backend.close()
    timed = steps[args.warmup :] or steps
    keys = ("wall_s", "time/rollout_s", "time/reward_s", "time/logprob_s", "time/update_s")
    result: dict[str, Any] = {k: statistics.fmean(s[k] for s in timed) for k in keys}
    result["rollout_tokens_per_s"] = statistics.fmean(s["rollout/tokens_per_s"] for s in timed)
    result["rollout_decode"] = decode
    result["response_length"] = statistics.fmean(s["response_length/mean"] for s in timed)
    result["logprob_gap_max"] = max(s["rollout/logprob_gap"] for s in steps)
    if torch.cuda.is_available():
        allocated = [s["mem_allocated_gb"] for s in steps]
        result["memory_gb"] = {
            "allocated_first": allocated[0], "allocated_last": allocated[-1],
            "allocated_max": max(allocated), "peak": max(s["mem_peak_gb"] for s in steps),
            "allocated_growth_after_step_1": allocated[-1] - allocated[min(1, len(allocated) - 1)],
        }
    result["steps"] = len(steps)
    return result


def clip_images(clip: Path, size: str) -> list[Any]:
    """The first frame of each pair of the clip's 8 frames, as PIL images."""
    import av
    from PIL import Image

    with av.open(str(clip)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    side = FRAME_SIDE[size]
    return [Image.fromarray(frames[i]).resize((side, side)) for i in range(0, 8, 2)]


def run_trl(model_dir: Path, data: Path, clips: list[Path], args: argparse.Namespace
            ) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same workload (clips as 4 images each, see the module
    docstring); step time between optimizer-step ends."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends.append(now())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(now())
            log(f"trl step {len(self.ends) - 2}: {self.ends[-1] - self.ends[-2]:.3f} s")

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs:
                self.logs.append(dict(logs))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    processor = AutoProcessor.from_pretrained(tokenizer_dir(model_dir))
    images = {str(c): clip_images(c, args.size) for c in clips}
    prompts = []
    for line in data.read_text().splitlines()[: args.prompts_per_step * args.trl_steps]:
        video, question = json.loads(line)["prompt"]
        parts = [{"type": "image", "image": image} for image in images[video["video"]]]
        prompts.append([{"role": "user", "content": [*parts, {"type": "text",
                                                              "text": question}]}])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.to(device)
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
    )
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_even_word_reward], args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=processor, callbacks=[clock])
    trainer.train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    timed = times[args.warmup :] or times
    lengths = [entry["completions/mean_length"] for entry in clock.logs
               if "completions/mean_length" in entry]
    del trainer
    return {"wall_s": statistics.fmean(timed), "step_times": times,
            "response_length": statistics.fmean(lengths) if lengths else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0}


def main() -> None:
    """Run the implementations and print the comparison."""
    args = parse_args()
    model_dir, clips, data = prepare(args)
    summary: dict[str, Any] = {
        "bench": "video_grpo", "model": args.model, "size": args.size,
        "completions": args.prompts_per_step * args.group,
        "max_new_tokens": args.max_new_tokens, **environment(), "results": {},
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
            summary["results"][impl] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        log(f"{impl}: {summary['results'][impl]['wall_s']:.3f} s/step")
    results = summary["results"]
    if "wall_s" in results.get("reasonctl", {}) and "wall_s" in results.get("trl", {}):
        summary["speedup"] = results["trl"]["wall_s"] / results["reasonctl"]["wall_s"]
        log(f"reasonctl {results['reasonctl']['wall_s']:.3f} s/step vs TRL "
            f"{results['trl']['wall_s']:.3f} s/step: {summary['speedup']:.2f}x")
    emit(summary)


if __name__ == "__main__":
    main()
