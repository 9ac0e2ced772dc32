"""SFT throughput: reasonctl's single-GPU backend against TRL's SFTTrainer and a plain loop.

Diagnosis micro-benchmark: it calls the backend's ``train_step`` with pre-collated
batches. The figure compared with TRL in ``bench/RESULTS.md`` comes from
:mod:`bench.cli_sft` (``reasonctl run``).

All implementations train the same random Qwen2.5-shaped model (identical bf16 initial
weights) on the same random-token rows in the same order: ``--batch`` rows of ``--seq``
tokens per optimizer step, next-token loss on every token, AdamW (fused), constant
learning rate, gradient clipping at 1.0, bf16 compute, no gradient checkpointing.

- ``torch``: the straightforward path, ``model(input_ids, labels=input_ids).loss`` with
  bf16 parameters (full float32 logits);
- ``trl``: ``trl.SFTTrainer`` on a pre-tokenized dataset (``input_ids``), bf16;
- ``reasonctl*``: the ``single`` backend's ``train_step`` with the SFT token-mean loss, in
  the variants given by ``--variants`` (parameter dtype, ``train.compile``).

Tokens/s counts every input token of the timed steps (the first ``--warmup`` steps, which
include compilation, are not timed); step time is wall time between step ends. Losses are
compared step by step with the plain loop; peak memory is ``max_memory_allocated``.

    python -m bench.sft --size 0.5b
    python -m bench.sft --size 1.5b --variants compute+compile

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    build_model_dir,
    emit,
    environment,
    free_memory,
    log,
    now,
    parameter_count,
    peak_memory_gb,
    random_rows,
    tokenizer_dir,
    training_mfu,
    trl_step_clock,
)

VARIANTS = {
    "float32+compile": {"param_dtype": "float32", "compile": True},
    "compute+compile": {"param_dtype": "compute", "compile": True},
    "float32": {"param_dtype": "float32", "compile": False},
    "compute": {"param_dtype": "compute", "compile": False},
}
"""reasonctl variants: ``float32`` = fp32 weights + bf16 autocast; ``compute`` = bf16 weights."""
LOSS_RTOL = 0.01


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=["0.5b", "1.5b", "7b", "tiny"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--impls", default="torch,trl,reasonctl")
    parser.add_argument("--variants", default="compute+compile,float32+compile,compute")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="Run TRL with gradient checkpointing (its config default).")
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def run_torch(model_dir: Path, data: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """The plain loop: HF loss on full logits, fused AdamW on bf16 parameters."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0,
                                  fused=device == "cuda")

    def step(rows: list[list[int]]) -> float:
        ids = torch.tensor(rows, device=device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    result = timed_loop(step, data, args)
    result["params"] = parameter_count(model)
    result["config"] = model.config
    return result


def run_reasonctl(model_dir: Path, data: list[list[int]], args: argparse.Namespace,
                  variant: str) -> dict[str, Any]:
    """reasonctl's single backend: one micro-batch of ``--batch`` rows per step."""
    from bench.common import reasonctl_backend
    from reasonctl.data.collate import collate
    from reasonctl.data.processing import EncodedSample

    options = VARIANTS[variant]
    backend, ctx = reasonctl_backend(model_dir, Path(args.out) / "run" / variant, values={
        "model": {"max_length": args.seq},
        "train": {"lr": args.lr, "compile": options["compile"],
                  "global_batch_size": args.batch, "micro_batch_size": args.batch},
        "backend": {"single": {"param_dtype": options["param_dtype"],
                               "logprob_chunk_tokens": args.chunk_tokens}},
    })
    ctx.total_steps = args.steps

    def step(rows: list[list[int]]) -> float:
        batch = collate([EncodedSample(r, [1] * len(r)) for r in rows], pad_id=0)
        return backend.train_step([batch], sft_token_loss(batch))["loss"]

    result = timed_loop(step, data, args)
    result["params"] = backend.parameter_counts.total
    result["config"] = backend.hf_model.config
    backend.close()
    return result


def sft_token_loss(batch: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """The SFT algorithm's ``token`` loss: target NLL summed, / target tokens of the step."""
    tokens = max(1, int(batch["loss_mask"][:, 1:].sum()))

    def loss_fn(outputs: Any, micro: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro["loss_mask"][:, 1:].to(outputs.logprobs.dtype)
        return -(outputs.logprobs * mask).sum() / tokens, {}

    return loss_fn


def run_trl(model_dir: Path, data: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """TRL's SFTTrainer on a pre-tokenized dataset, rows taken in order."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *_: Any, **__: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trl"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=device == "cuda", gradient_checkpointing=args.trl_gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", max_length=args.seq,
        disable_tqdm=True, seed=0, optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
        use_cpu=device == "cpu",
    )
    clock = trl_step_clock()
    trainer = InOrder(model=model, args=config,
                      train_dataset=Dataset.from_dict({"input_ids": data}),
                      processing_class=AutoTokenizer.from_pretrained(tokenizer_dir(model_dir)),
                      callbacks=[clock])
    trainer.train()
    times = clock.steps()
    result = summarise(times, clock.losses, args)
    result["params"] = parameter_count(model)
    result["config"] = model.config
    del trainer
    return result


def timed_loop(step: Callable[[list[list[int]]], float], data: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:
    """Run ``step`` over consecutive batches; time each from the previous step's end."""
    times, losses = [], []
    last = now()
    for index in range(args.steps):
        losses.append(step(data[index * args.batch : (index + 1) * args.batch]))
        end = now()
        times.append(end - last)
        last = end
    return summarise(times, losses, args)


def summarise(times: list[float], losses: list[float], args: argparse.Namespace
              ) -> dict[str, Any]:
    """Tokens/s over the timed steps, the losses and the peak memory."""
    timed = times[args.warmup :] or times
    tokens = args.batch * args.seq
    return {
        "tokens_per_s": tokens * len(timed) / sum(timed),
        "step_s": sum(timed) / len(timed),
        "first_step_s": times[0],
        "losses": losses,
        "peak_mem_gb": peak_memory_gb(),
    }


def main() -> None:
    """Run every implementation and print the comparison."""
    args = parse_args()
    out = Path(args.out)
    model_dir = build_model_dir(out / "models", args.size)
    data = random_rows(args.steps * args.batch, args.seq, seed=1)
    results: dict[str, dict[str, Any]] = {}
    for impl in args.impls.split(","):
        names = ([f"reasonctl:{v}" for v in args.variants.split(",")]
                 if impl == "reasonctl" else [impl])
        for name in names:
            free_memory()
            log(f"--- {name}")
            if name == "torch":
                results[name] = run_torch(model_dir, data, args)
            elif name == "trl":
                results[name] = run_trl(model_dir, data, args)
            else:
                results[name] = run_reasonctl(model_dir, data, args, name.split(":", 1)[1])
            free_memory()
            r = results[name]
            log(f"{name}: {r['tokens_per_s']:.0f} tok/s, step {r['step_s']:.3f} s, "
                f"peak {r['peak_mem_gb']:.1f} GB, losses {[round(x, 4) for x in r['losses']]}")
    reference = results.get("torch")
    summary: dict[str, Any] = {"bench": "sft", "size": args.size, "seq": args.seq,
                               "batch": args.batch, **environment(), "results": {}}
    log(f"{'impl':<26}{'tok/s':>10}{'MFU':>7}{'step s':>8}{'peak GB':>9}{'vs trl':>8}"
        f"{'loss rel diff':>15}")
    for name, r in results.items():
        mfu = training_mfu(r["tokens_per_s"], r["params"], r["config"], args.seq)
        rel = None
        if reference is not None:
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference["losses"],
                                                          strict=True))
        vs_trl = r["tokens_per_s"] / results["trl"]["tokens_per_s"] if "trl" in results else None
        summary["results"][name] = {
            "tokens_per_s": round(r["tokens_per_s"], 1), "mfu": round(mfu, 4),
            "step_s": round(r["step_s"], 4), "first_step_s": round(r["first_step_s"], 2),
            "peak_mem_gb": round(r["peak_mem_gb"], 2),
            "vs_trl": round(vs_trl, 3) if vs_trl else None,
            "loss_max_rel_diff_vs_torch": rel, "losses": [round(x, 5) for x in r["losses"]],
        }
        log(f"{name:<26}{r['tokens_per_s']:>10.0f}{mfu:>7.1%}{r['step_s']:>8.3f}"
            f"{r['peak_mem_gb']:>9.1f}{(vs_trl or 0):>8.2f}{(rel or 0):>15.2e}")
    summary["losses_match"] = all(
        (v["loss_max_rel_diff_vs_torch"] or 0) <= LOSS_RTOL for v in summary["results"].values()
    )
    emit(summary)


if __name__ == "__main__":
    main()
