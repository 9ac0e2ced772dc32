"""GRPO step time: reasonctl's GRPO on one GPU against TRL's GRPOTrainer (no vLLM).

Diagnosis micro-benchmark: it drives the algorithm in-process. The figure compared with
TRL in ``bench/RESULTS.md`` comes from :mod:`bench.cli_grpo` (``reasonctl run``).

Workload (both sides): a random Qwen2.5-shaped model (same bf16 initial weights), 8
prompts x 8 completions = 64 completions per optimizer step, prompts of 128 tokens
(chat template included), up to ``--max-new-tokens`` sampled tokens at temperature 1,
a cheap rule reward (the fraction of even word ids), group-normalised advantages,
token-mean clipped loss (TRL ``loss_type="dapo"``), no KL term, one optimizer step per
rollout, bf16 weights, no gradient checkpointing.

reasonctl runs its ``grpo`` algorithm step by step (rollout with the embedded ``hf``
engine sharing the policy weights, rewards, old log-probs, update) and reports the split.
TRL's step time is wall time between optimizer-step ends. The first ``--warmup`` steps are
not timed. With ``--impls reasonctl --steps 100`` it is a stability run: per-step memory
(allocated and peak) shows whether anything accumulates.

    python -m bench.grpo
    python -m bench.grpo --impls reasonctl --steps 100 --max-new-tokens 64

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
    CHAT_TEMPLATE,
    build_model_dir,
    build_rollout_engine,
    emit,
    environment,
    free_memory,
    log,
    now,
    random_rows,
    reasonctl_backend,
    tokenizer_dir,
    trl_even_word_reward,
    trl_step_clock,
    words,
)

PROMPT_WORDS = 123
"""Words per prompt: with the chat template's 5 tokens the encoded prompt is 128 tokens."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--impls", default="reasonctl,trl")
    parser.add_argument("--steps", type=int, default=3, help="reasonctl steps (incl. warm-up).")
    parser.add_argument("--trl-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="reasonctl completions per forward/backward pass.")
    parser.add_argument("--param-dtype", default="compute", choices=["compute", "float32"])
    parser.add_argument("--compile", action="store_true", help="reasonctl train.compile.")
    parser.add_argument("--rollout-compile", action="store_true",
                        help="Compile the rollout engine's decode step ([rollout.hf] compile).")
    parser.add_argument("--rollout-stock-kernels", action="store_true",
                        help="Stock torch attention, gate/up and sampling in the rollout engine "
                        "instead of the fused Triton kernels ([rollout.hf] fused_kernels "
                        "= false).")
    parser.add_argument("--rollout-stock-mlp", action="store_true",
                        help="The gate/up matmul and a separate activation instead of the "
                        "rollout's fused gate/up kernel.")
    parser.add_argument("--rollout-no-chain", action="store_true",
                        help="Library matmuls and the model's norms in the rollout's decode "
                        "step instead of the kernel chain.")
    parser.add_argument("--rollout-no-head-sampling", action="store_true",
                        help="Write logits and sample them instead of applying the output "
                        "head inside the rollout's sampler.")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def prompt_texts(count: int) -> list[str]:
    """User messages of random words (fixed seed)."""
    return [words(row) for row in random_rows(count, PROMPT_WORDS, seed=3)]


def decode_options(args: argparse.Namespace) -> Any:
    """The rollout engine's :class:`~reasonctl.rollout.DecodeOptions`: the fast path with
    the parts the command line switches off."""
    from reasonctl.rollout import DecodeOptions

    return DecodeOptions(fused_mlp=not args.rollout_stock_mlp,
                         kernel_chain=not args.rollout_no_chain,
                         head_sampling=not args.rollout_no_head_sampling)


def run_reasonctl(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """reasonctl's GRPO step by step; per-step metrics and memory."""
    from reasonctl.algorithms.grpo import GRPO
    from reasonctl.core.protocols import algorithm_needs
    from reasonctl.rollout import DecodeOptions
    from reasonctl.runtime.composition import compose

    out = Path(args.out) / "run" / "grpo"
    out.mkdir(parents=True, exist_ok=True)
    data = out / "prompts.jsonl"
    count = args.prompts_per_step * max(args.steps, 1)
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prompt_texts(count)))
    backend, ctx = reasonctl_backend(model_dir, out, values={
        "model": {"max_length": 4096},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {
            "prompts_per_step": args.prompts_per_step, "loss_aggregation": "token-mean",
            "kl_beta": 0.0, "scale_rewards": "group"}},
        "rollout": {"engine": "hf", "n": args.group, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "max_new_tokens": args.max_new_tokens,
                    "hf": {"compile": args.rollout_compile,
                           "fused_kernels": not args.rollout_stock_kernels}},
        "rewards": {"components": [{"name": "bench.common:even_word_reward"}]},
        "train": {"lr": args.lr, "micro_batch_size": args.micro_batch, "max_steps": args.steps,
                  "compile": args.compile},
        "backend": {"single": {"param_dtype": args.param_dtype}},
    })
    options = ctx.component_config("algorithm", "grpo")
    algorithm = GRPO(options)
    compose(ctx, algorithm_needs(algorithm, options))
    decode = decode_options(args)
    if decode != DecodeOptions():  # parts of the decode path switched off
        ctx.engine = build_rollout_engine(ctx, decode)
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
            f"{metrics['time/rollout_s']:.3f}, reward {metrics['time/reward_s']:.3f}, "
            f"logprob {metrics['time/logprob_s']:.3f}, update {metrics['time/update_s']:.3f}), "
            f"reward {metrics['reward/mean']:.4f}, len {metrics['response_length/mean']:.0f}, "
            f"gap {metrics['rollout/logprob_gap']:.4f}, "
            f"mem {metrics.get('mem_allocated_gb', 0):.2f}/{metrics.get('mem_peak_gb', 0):.2f} GB")
    backend.close()
    timed = steps[args.warmup :] or steps
    keys = ("wall_s", "time/rollout_s", "time/reward_s", "time/logprob_s", "time/update_s")
    result: dict[str, Any] = {k: statistics.fmean(s[k] for s in timed) for k in keys}
    result["rollout_tokens_per_s"] = statistics.fmean(s["rollout/tokens_per_s"] for s in timed)
    result["response_length"] = statistics.fmean(s["response_length/mean"] for s in timed)
    result["logprob_gap_max"] = max(s["rollout/logprob_gap"] for s in steps)
    result["reward_first_last"] = [steps[0]["reward/mean"], steps[-1]["reward/mean"]]
    if torch.cuda.is_available():
        allocated = [s["mem_allocated_gb"] for s in steps]
        result["memory_gb"] = {
            "allocated_first": allocated[0], "allocated_last": allocated[-1],
            "allocated_max": max(allocated), "peak": max(s["mem_peak_gb"] for s in steps),
        }
    result["steps"] = len(steps)
    return result


def run_trl(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer with the same workload; step time between optimizer-step ends."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                      add_generation_prompt=True, chat_template=CHAT_TEMPLATE)
        for t in prompt_texts(args.prompts_per_step * args.trl_steps)
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    per_device = min(16, args.prompts_per_step * args.group)
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trl-grpo"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=args.prompts_per_step * args.group // per_device,
        num_generations=args.group, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo",
        scale_rewards="group", learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=device == "cuda",
        gradient_checkpointing=False, logging_steps=1, max_steps=args.trl_steps,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_vllm=False,
        use_cpu=device == "cpu", optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
    )
    clock = trl_step_clock(label="trl")
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_even_word_reward], args=config,
                          train_dataset=Dataset.from_dict({"prompt": rendered}),
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    times = clock.steps()
    timed = times[args.warmup :] or times
    lengths = [log_["completions/mean_length"] for log_ in clock.logs
               if "completions/mean_length" in log_]
    del trainer
    return {"wall_s": statistics.fmean(timed), "step_times": times,
            "response_length": statistics.fmean(lengths) if lengths else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0}


def main() -> None:
    """Run the implementations and print the comparison."""
    args = parse_args()
    out = Path(args.out)
    model_dir = build_model_dir(out / "models", args.size)
    summary: dict[str, Any] = {
        "bench": "grpo", "size": args.size, "completions": args.prompts_per_step * args.group,
        "prompt_tokens": PROMPT_WORDS + 5, "max_new_tokens": args.max_new_tokens,
        **environment(), "results": {},
    }
    for impl in args.impls.split(","):
        free_memory()
        log(f"--- {impl}")
        runner = run_reasonctl if impl == "reasonctl" else run_trl
        summary["results"][impl] = runner(model_dir, args)
        log(f"{impl}: {summary['results'][impl]['wall_s']:.3f} s/step")
    results = summary["results"]
    if "reasonctl" in results and "trl" in results:
        summary["speedup"] = results["trl"]["wall_s"] / results["reasonctl"]["wall_s"]
        log(f"reasonctl {results['reasonctl']['wall_s']:.3f} s/step vs TRL "
            f"{results['trl']['wall_s']:.3f} s/step: {summary['speedup']:.2f}x")
    emit(summary)


if __name__ == "__main__":
    main()
