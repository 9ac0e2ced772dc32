"""FlowGRPO iteration time on world-model-shaped random weights: reasonctl against a plain
diffusers loop (``bench/diffusion_reference.py``) in the same job.

Workload (both sides): Wan2.1-T2V-1.3B- or Cosmos-Predict2.5-2B-shaped transformer with
random weights (seed 0, saved once, loaded by both), the real Wan2.1 VAE shape (random),
one prompt of random precomputed text embeddings (UMT5 / Qwen2.5-VL widths, so no text
encoder is loaded), a group of ``--group`` samples at ``--height`` x ``--width`` x
``--frames``, ``--sample-steps`` SDE denoising steps of which the first
``--train-steps`` train, brightness of the decoded frames as the reward, group-normalised
advantages, the clipped loss (1e-4), one AdamW step per iteration; float32 parameters under
bfloat16 autocast on both sides unless ``--param-dtype compute``. The reference
checkpoints every block (``--reference-checkpointing``); reasonctl follows
``--checkpointing`` (``true``, ``false`` or ``auto``: only the blocks memory needs, measured
at the first update); ``--no-checkpointing`` turns both off. reasonctl decodes
``--vae-batch`` clips per VAE call (0, its default: all, halved on out-of-memory); the
reference decodes one at a time. reasonctl's attention prefers cuDNN's kernel on Hopper
(``--cudnn-attention``, its default ``auto``); the reference keeps PyTorch's SDPA order
(FlashAttention first), and ``logprob_max_abs_diff`` re-scores with PyTorch's order too,
so it compares the math on the same kernels.

reasonctl runs through the user path (``reasonctl.run`` with a config; ``--backend fsdp
--nproc N`` launches ``reasonctl run --nproc-per-node N``); the figure is its mean
``time/step_s`` (rollout, decode, rewards, update) after ``--warmup`` steps and its peak
memory. The reference runs the same iterations eagerly. ``logprob_max_abs_diff`` compares
the reference's recorded per-step log-probabilities with reasonctl's re-scoring of the same
transitions under the same weights.

    python -m bench.world_model --model wan1.3b
    python -m bench.world_model --model wan1.3b --checkpointing auto --compile
    python -m bench.world_model --model wan1.3b --compile --vae-batch 8 --param-dtype compute
    python -m bench.world_model --model cosmos2b --frames 13
    python -m bench.world_model --model cosmos2b --backend fsdp --nproc 4 --impls reasonctl
    python -m bench.world_model --model wan1.3b --size tiny        # CPU smoke run

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, environment, free_memory, log, now, peak_memory_gb

TRANSFORMERS: dict[str, dict[str, Any]] = {
    "wan1.3b": {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128,
                "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
                "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
                "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024},
    "cosmos2b": {"in_channels": 17, "out_channels": 16, "num_attention_heads": 16,
                 "attention_head_dim": 128, "num_layers": 28, "mlp_ratio": 4.0,
                 "text_embed_dim": 1024, "adaln_lora_dim": 256, "max_size": (128, 240, 240),
                 "patch_size": (1, 2, 2), "rope_scale": (1.0, 3.0, 3.0),
                 "concat_padding_mask": True, "extra_pos_embed_type": None,
                 "use_crossattn_projection": True, "crossattn_proj_in_channels": 100352,
                 "encoder_hidden_states_channels": 1024},
}
"""Transformer configs of Wan2.1-T2V-1.3B and Cosmos-Predict2.5-2B (diffusers' layout)."""
FAMILY = {"wan1.3b": "wan", "cosmos2b": "cosmos"}
TEXT_TOKENS = 512


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan1.3b", choices=sorted(TRANSFORMERS))
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--impls", default="reasonctl,reference")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=13, help="Pixel frames (4k + 1).")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--sample-steps", type=int, default=10)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3, help="Iterations, warm-up included.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="reasonctl transitions per forward/backward (0: the group).")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "compute"])
    parser.add_argument("--compile", action="store_true",
                        help="reasonctl train.compile (training and sampling passes).")
    parser.add_argument("--vae-batch", type=int, default=0,
                        help="reasonctl clips decoded per VAE call (vae_batch_size; 0: auto).")
    parser.add_argument("--checkpointing", default="true", choices=["true", "false", "auto"],
                        help="reasonctl's model.gradient_checkpointing.")
    parser.add_argument("--cudnn-attention", default="auto", choices=["auto", "true", "false"],
                        help="reasonctl's cudnn_attention (auto: cuDNN first on Hopper).")
    parser.add_argument("--reference-checkpointing", default="true", choices=["true", "false"])
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="Both sides without gradient checkpointing.")
    parser.add_argument("--backend", default="single", choices=["single", "fsdp"])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", default="/tmp/reasonctl-bench-world-model")
    args = parser.parse_args()
    if args.no_checkpointing:
        args.checkpointing = args.reference_checkpointing = "false"
    if args.size == "tiny":
        args.height = args.width = 32
        args.frames, args.group, args.sample_steps, args.train_steps = 5, 4, 4, 2
        args.iters, args.warmup = 2, 1
    return args


def build_model_dir(root: Path, args: argparse.Namespace) -> Path:
    """The random-weight pipeline directory (built once, reused by every run)."""
    target = root / f"{args.model}-{args.size}"
    if (target / "model_index.json").is_file():
        return target
    if args.no_checkpointing:
        args.checkpointing = args.reference_checkpointing = "false"
    if args.size == "tiny":
        from reasonctl.diffusion.tiny import make_tiny_pipeline_dir

        return make_tiny_pipeline_dir(target, FAMILY[args.model])
    import diffusers
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    log(f"building random {args.model} weights in {target}")
    torch.manual_seed(0)
    cls = diffusers.CosmosTransformer3DModel if args.model == "cosmos2b" \
        else diffusers.WanTransformer3DModel
    components = {
        "transformer": cls(**TRANSFORMERS[args.model]).to(torch.bfloat16),
        "vae": AutoencoderKLWan().to(torch.bfloat16),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0 if args.model == "wan1.3b"
                                                     else 5.0),
    }
    target.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": "WanPipeline" if args.model == "wan1.3b"
                             else "Cosmos2_5_PredictBasePipeline",
                             "_diffusers_version": diffusers.__version__,
                             "text_encoder": [None, None], "tokenizer": [None, None]}
    for name, component in components.items():
        index[name] = ["diffusers", type(component).__name__]
        component.save_pretrained(target / name)
    (target / "model_index.json").write_text(json.dumps(index, indent=2))
    return target


def text_embedding(root: Path, model_dir: Path) -> tuple[Path, torch.Tensor]:
    """One prompt's random embeddings, as a precomputed-embedding file."""
    from safetensors.torch import save_file

    from reasonctl.diffusion.adapters import adapter_for

    width, _ = adapter_for(model_dir).text_dims()
    tokens = 16 if "tiny" in model_dir.name else TEXT_TOKENS
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(tokens, width, generator=generator).to(torch.bfloat16)
    path = root / f"{model_dir.name}-embeds.safetensors"
    if not path.is_file():
        save_file({"prompt_embeds": embeds}, str(path))
    return path, embeds.float()


def reasonctl_config(out: Path, model_dir: Path, embedding: Path,
                     args: argparse.Namespace) -> dict[str, Any]:
    """The run config of the reasonctl side."""
    prompts = out / "prompts.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    row = {"prompt": "bench", "meta": {"text_embedding": str(embedding)}}
    prompts.write_text(json.dumps(row) + "\n")
    cuda = torch.cuda.is_available()
    return {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16" if cuda else "float32",
                  "gradient_checkpointing": {"true": True, "false": False,
                                             "auto": "auto"}[args.checkpointing]},
        "data": {"format": "jsonl", "jsonl": {"path": str(prompts)}},
        "algorithm": {"name": "flow_grpo", "flow_grpo": {
            "prompts_per_step": args.nproc, "height": args.height, "width": args.width,
            "frames": args.frames, "sample_steps": args.sample_steps,
            "train_steps": list(range(args.train_steps)), "noise_level": 0.7,
            "vae_batch_size": args.vae_batch,
            "cudnn_attention": {"true": True, "false": False,
                                "auto": "auto"}[args.cudnn_attention]}},
        "rollout": {"n": args.group},
        "train": {"lr": args.lr, "max_steps": args.iters,
                  "micro_batch_size": args.micro_batch or args.group, "compile": args.compile},
        "backend": {"name": args.backend, "device": "auto",
                    "single": {"param_dtype": args.param_dtype}},
        "rewards": {"components": [{"name": "brightness"}]},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }


def run_reasonctl(root: Path, model_dir: Path, embedding: Path,
                  args: argparse.Namespace) -> dict[str, Any]:
    """reasonctl through its user path; per-step times and peak memory."""
    import tomli_w

    import reasonctl

    out = root / "run" / args.model
    config = reasonctl_config(out, model_dir, embedding, args)
    free_memory()
    if args.backend == "single":
        reasonctl.run(config)
    else:
        path = out / "config.bench.toml"
        path.write_text(tomli_w.dumps(config))
        proc = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--nproc-per-node",
                               str(args.nproc), "--config", str(path)], check=False)
        if proc.returncode:
            raise SystemExit(f"reasonctl run failed ({proc.returncode})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup:] or rows
    return {
        "s_per_iter": statistics.fmean(r["time/step_s"] for r in timed),
        "rollout_s": statistics.fmean(r["time/rollout_s"] for r in timed),
        "reward_s": statistics.fmean(r["time/reward_s"] for r in timed),
        "update_s": statistics.fmean(r["time/update_s"] for r in timed),
        "peak_gb": max(r.get("peak_mem_gb", 0.0) for r in rows),
        "ratio_dev_first": max(r["ratio_dev_first"] for r in rows),
        "checkpointed_blocks": rows[-1].get("update/checkpointed_blocks"),
        "reward_mean": [r["reward/mean"] for r in rows],
    }


def run_reference(model_dir: Path, embeds: torch.Tensor, args: argparse.Namespace
                  ) -> tuple[dict[str, Any], float]:
    """The plain diffusers loop's iterations, and the log-prob check against reasonctl."""
    from bench.diffusion_reference import ReferenceLoop
    from reasonctl.diffusion.adapters import adapter_for

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    free_memory()
    loop = ReferenceLoop(model_dir, device=device, lr=args.lr,
                         checkpointing=args.reference_checkpointing == "true")
    shape = adapter_for(model_dir).latent_shape(args.frames, args.height, args.width)
    group = embeds[None].expand(args.group, -1, -1).to(device)
    train = list(range(args.train_steps))
    times = []
    for index in range(args.iters):
        started = now()
        loop.iterate(group, shape, steps=args.sample_steps, train=train, seed=index)
        times.append(now() - started)
    peak = peak_memory_gb()
    rollout = loop.rollout(group, shape, steps=args.sample_steps, train=train, seed=99)
    diff = logprob_difference(loop, rollout, group, model_dir)
    timed = times[args.warmup:] or times
    return {"s_per_iter": statistics.fmean(timed), "peak_gb": peak}, diff


def logprob_difference(loop: Any, rollout: Any, embeds: torch.Tensor, model_dir: Path
                       ) -> float:
    """Largest |reference log-prob - reasonctl's re-scoring| over the recorded transitions."""
    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.batches import make_forward

    adapter = adapter_for(model_dir)
    dtype = torch.bfloat16 if loop.autocast else torch.float32
    forward = make_forward(adapter, guidance_scale=1.0, dtype=dtype)
    loop.transformer.eval()
    worst = 0.0
    for k, (sigma, sigma_next, std_dev) in enumerate(rollout.sigmas):
        batch_size = rollout.states[k].shape[0]
        batch = {"latents": rollout.states[k], "next_latents": rollout.next_states[k],
                 "sigma": torch.full((batch_size,), sigma, device=loop.device),
                 "sigma_next": torch.full((batch_size,), sigma_next, device=loop.device),
                 "std_dev": torch.full((batch_size,), std_dev, device=loop.device),
                 "text_embeds": embeds}
        with torch.no_grad(), torch.autocast(loop.device.type, dtype=torch.bfloat16,
                                             enabled=loop.autocast):
            ours = forward(loop.transformer, batch).log_prob
        worst = max(worst, float((ours - rollout.log_probs[k]).abs().max()))
    return worst


def main() -> None:
    """Build the weights, run the selected implementations, print the JSON summary."""
    args = parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(root, args)
    embedding, embeds = text_embedding(root, model_dir)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    summary: dict[str, Any] = {
        "bench": "world_model", "model": args.model, "size": args.size,
        "shape": {"height": args.height, "width": args.width, "frames": args.frames,
                  "group": args.group, "sample_steps": args.sample_steps,
                  "train_steps": args.train_steps},
        "backend": args.backend, "nproc": args.nproc, "param_dtype": args.param_dtype,
        "compile": args.compile, "vae_batch": args.vae_batch,
        "checkpointing": args.checkpointing, "cudnn_attention": args.cudnn_attention,
        "reference_checkpointing": args.reference_checkpointing == "true",
        **environment(),
    }
    if "reasonctl" in impls:
        summary["reasonctl"] = run_reasonctl(root, model_dir, embedding, args)
        log(f"reasonctl: {summary['reasonctl']}")
    if "reference" in impls:
        summary["reference"], summary["logprob_max_abs_diff"] = run_reference(
            model_dir, embeds, args)
        log(f"reference: {summary['reference']}")
    if "reasonctl" in summary and "reference" in summary:
        summary["speedup"] = summary["reference"]["s_per_iter"] / \
            summary["reasonctl"]["s_per_iter"]
    emit(summary)


if __name__ == "__main__":
    main()
