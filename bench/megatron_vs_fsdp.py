"""The megatron backend against the fsdp backend on the same model and batch (CUDA).

Builds a random Qwen2.5-shaped model (default: the 0.5B shape), then with each backend
runs ``--steps`` SFT steps (token-mean NLL, normalised by the global token count) on one
fixed random-token batch and records the losses and tokens/s. Then, for megatron:

- exports the model and checks that the export holds exactly the weights the backend
  streams (``full_state_dict``) and has the fsdp export's layout (files, config, tensor
  names/shapes/dtypes);
- loads the export with transformers and compares its token log-probs with megatron's;
- saves a checkpoint, takes one more step, restores the checkpoint and takes the same
  step again: both losses must be equal.

One GPU::

    python bench/megatron_vs_fsdp.py --steps 8

Several GPUs (megatron with tensor/pipeline parallelism, fsdp over the same GPUs)::

    torchrun --nproc-per-node 2 bench/megatron_vs_fsdp.py --tp 2

The last line printed (rank 0) is a JSON summary; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

LOSS_RTOL = 2e-2
"""Largest relative loss difference between the backends accepted as bf16 noise."""
EXPORT_LOGPROB_ATOL = 5e-2
"""Largest mean absolute log-prob gap between megatron and its transformers export."""


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_megatron_vs_fsdp")
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="Global batch (rows).")
    parser.add_argument("--micro", type=int, default=2, help="Rows per micro-batch.")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--backends", default="fsdp,megatron")
    return parser.parse_args()


def global_rank() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    return int(os.environ.get("RANK", "0"))


def build_model_dir(path: Path, args: argparse.Namespace) -> Path:
    """A random Qwen2.5-shaped model (bf16 safetensors) with the tiny byte tokenizer."""
    from transformers import AutoModelForCausalLM

    from reasonctl.models.tiny import build_tiny_tokenizer, tiny_qwen2_config

    done = path / "config.json"
    if global_rank() != 0:
        while not done.is_file():
            time.sleep(1)
        return path
    if done.is_file():
        return path
    tokenizer = build_tiny_tokenizer()
    config = tiny_qwen2_config(
        args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    torch.cuda.empty_cache()
    tmp.rename(path)
    return path


def random_batch(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded random token rows of random length (between half and all of --seq)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=generator)
    attention = (torch.arange(args.seq)[None] < lengths[:, None]).long()
    return {"input_ids": ids * attention, "attention_mask": attention,
            "loss_mask": attention.clone()}


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows ``start:stop`` of every tensor."""
    return {k: v[start:stop] for k, v in batch.items()}


def rank_micro_batches(batch: dict[str, torch.Tensor], backend: Any, micro: int
                       ) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the global batch, cut into micro-batches."""
    per_rank = batch["input_ids"].shape[0] // backend.world_size
    mine = rows(batch, backend.rank * per_rank, (backend.rank + 1) * per_rank)
    return [rows(mine, i, i + micro) for i in range(0, per_rank, micro)]


def nll_loss(total_tokens: int) -> Any:
    """Token-sum NLL over a micro-batch divided by the global number of target tokens."""

    def loss_fn(outputs: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["loss_mask"][:, 1:].to(outputs.logprobs.dtype)
        return -(outputs.logprobs * mask).sum() / total_tokens, {}

    return loss_fn


def run_backend(name: str, model_dir: Path, args: argparse.Namespace,
                batch: dict[str, torch.Tensor], out: Path) -> dict[str, Any]:
    """Train with one backend and collect what the comparison needs."""
    from reasonctl.core.config import load_config
    from reasonctl.core.plugins import PluginHost
    from reasonctl.core.protocols import RunContext

    host = PluginHost.load()
    values = {
        "run": {"output_dir": str(out / "run" / name), "seed": 0},
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16", "max_length": args.seq},
        "train": {"lr": args.lr, "max_grad_norm": 1.0, "weight_decay": 0.0},
        "backend": {"name": name},
        "logging": {"loggers": []},
    }
    if name == "megatron":
        values["backend"]["megatron"] = {"tp": args.tp, "pp": args.pp}
    else:  # keep gathered weights between forward and backward: the fastest fsdp setting
        values["backend"]["fsdp"] = {"reshard_after_forward": "never"}
    config = load_config(values=values, registry=host.registry)
    ctx = RunContext(config=config, registry=host.registry, hooks=host.hooks,
                     output_dir=out / "run" / name)
    backend = host.registry.get("backend", name).build(config.component_config("backend", name))
    backend.setup(ctx)
    ctx.total_steps = args.steps + 1
    eval_batch = rows(batch, 0, args.micro)
    result: dict[str, Any] = {"initial_logprobs": backend.token_outputs(eval_batch).logprobs
                              .float().cpu()}
    total_tokens = int(batch["loss_mask"][:, 1:].sum())
    loss_fn = nll_loss(total_tokens)
    micro_batches = rank_micro_batches(batch, backend, args.micro)
    input_tokens = int(batch["attention_mask"].sum())
    losses, grad_norms, times = [], [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = backend.train_step(micro_batches, loss_fn)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(metrics["loss"])
        grad_norms.append(metrics["grad_norm"])
    timed = times[1:] or times
    result.update(
        losses=losses, grad_norms=grad_norms,
        tokens_per_s=input_tokens * len(timed) / sum(timed),
        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
        logprobs=backend.token_outputs(eval_batch).logprobs.float().cpu(),
    )
    export_dir = out / "export" / name
    backend.export(export_dir)
    result["export_dir"] = export_dir
    if name == "megatron":
        streamed = {k: v.detach().cpu() for k, v in backend.full_state_dict()}
        result["export_matches_stream"] = export_equals(export_dir, streamed) \
            if global_rank() == 0 else True
        del streamed
        try:
            result.update(resume_check(backend, ctx, micro_batches, loss_fn, out / "ckpt"))
        except Exception:  # report it with the other results
            result["resume"] = {"error": traceback.format_exc()[-3000:]}
    backend.close()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def resume_check(backend: Any, ctx: Any, micro_batches: list[dict[str, torch.Tensor]],
                 loss_fn: Any, directory: Path) -> dict[str, Any]:
    """Save, step, restore, step again: the two steps must agree."""
    state = directory / "state"
    if global_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    backend.barrier()
    backend.save_checkpoint(state)
    first = backend.train_step(micro_batches, loss_fn)
    after_first = backend.train_step(micro_batches, loss_fn)
    backend.load_checkpoint(state)
    second = backend.train_step(micro_batches, loss_fn)
    after_second = backend.train_step(micro_batches, loss_fn)
    return {"resume": {
        "loss_before": first["loss"], "loss_after_restore": second["loss"],
        "next_loss_before": after_first["loss"], "next_loss_after_restore": after_second["loss"],
        "grad_norm_before": first["grad_norm"], "grad_norm_after_restore": second["grad_norm"],
    }}


def export_equals(directory: Path, streamed: dict[str, torch.Tensor]) -> bool:
    """Whether the exported safetensors hold exactly the streamed weights."""
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        exported.update(load_file(file))
    exported.pop("lm_head.weight", None)  # tied: stored once as the embedding
    return sorted(exported) == sorted(streamed) and all(
        torch.equal(exported[k], streamed[k].to(exported[k].dtype)) for k in streamed
    )


def export_layout(directory: Path) -> dict[str, Any]:
    """Files, config and tensor names/shapes/dtypes of an export."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                tensors[key] = (tuple(piece.get_shape()), piece.get_dtype())
    config = json.loads((directory / "config.json").read_text())
    return {"files": sorted(p.name for p in directory.iterdir()), "config": config,
            "tensors": tensors}


def export_logprob_gap(export_dir: Path, eval_batch: dict[str, torch.Tensor],
                       reference: torch.Tensor) -> dict[str, float]:
    """Token log-probs of the export under transformers (bf16, sdpa) against ``reference``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16).cuda().eval()
    batch = {k: v.cuda() for k, v in eval_batch.items()}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(
        -1, batch["input_ids"][:, 1:, None]).squeeze(-1).cpu()
    mask = eval_batch["loss_mask"][:, 1:].bool()
    gap = (logprobs - reference).abs()[mask]
    del model
    torch.cuda.empty_cache()
    return {"max_abs": float(gap.max()), "mean_abs": float(gap.mean())}


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Max and mean absolute difference where ``mask`` is set."""
    gap = (a - b).abs()[mask.bool()]
    return {"max_abs": float(gap.max()), "mean_abs": float(gap.mean())}


def main() -> int:
    """Run the comparison and print the JSON summary on rank 0."""
    args = parse_args()
    out = Path(args.out)
    if global_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(out / "model", args)
    batch = random_batch(args, seed=1)
    results = {name: run_backend(name, model_dir, args, batch, out)
               for name in args.backends.split(",")}
    if global_rank() != 0:
        return 0
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn",
                                                "vocab", "seq", "batch", "micro", "tp", "pp")},
    }
    checks: dict[str, bool] = {}
    for name, result in results.items():
        summary[name] = {"losses": [round(x, 5) for x in result["losses"]],
                         "grad_norms": [round(x, 4) for x in result["grad_norms"]],
                         "tokens_per_s": round(result["tokens_per_s"], 1),
                         "peak_mem_gb": round(result["peak_mem_gb"], 2)}
    eval_mask = rows(batch, 0, args.micro)["loss_mask"][:, 1:]
    if "fsdp" in results and "megatron" in results:
        fsdp, mega = results["fsdp"], results["megatron"]
        rel = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(fsdp["losses"], mega["losses"],
                                                                strict=True)]
        print(f"{'step':>4} {'fsdp loss':>12} {'megatron loss':>14} {'rel diff':>9}",
              file=sys.stderr)
        for step, (a, b, r) in enumerate(zip(fsdp["losses"], mega["losses"], rel, strict=True)):
            print(f"{step:>4} {a:>12.5f} {b:>14.5f} {r:>9.2e}", file=sys.stderr)
        summary["loss_max_rel_diff"] = max(rel)
        checks["losses_match"] = max(rel) <= LOSS_RTOL
        summary["initial_logprob_gap"] = masked_gap(fsdp["initial_logprobs"],
                                                    mega["initial_logprobs"], eval_mask)
        fsdp_layout = export_layout(fsdp["export_dir"])
        mega_layout = export_layout(mega["export_dir"])
        checks["export_layout_matches_fsdp"] = fsdp_layout == mega_layout
        if fsdp_layout != mega_layout:
            summary["layout_diff"] = {
                k: [str(fsdp_layout[k])[:300], str(mega_layout[k])[:300]]
                for k in fsdp_layout if fsdp_layout[k] != mega_layout[k]
            }
    if "megatron" in results:
        mega = results["megatron"]
        checks["export_matches_stream"] = bool(mega["export_matches_stream"])
        gap = export_logprob_gap(mega["export_dir"], rows(batch, 0, args.micro),
                                 mega["logprobs"])
        summary["export_logprob_gap"] = gap
        checks["export_logprobs_match"] = gap["mean_abs"] <= EXPORT_LOGPROB_ATOL
        resume = mega["resume"]
        summary["resume"] = resume
        checks["resume_exact"] = "error" not in resume and all(
            math.isclose(resume[a], resume[b], rel_tol=1e-6)
            for a, b in (("loss_before", "loss_after_restore"),
                         ("next_loss_before", "next_loss_after_restore"),
                         ("grad_norm_before", "grad_norm_after_restore"))
        )
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
