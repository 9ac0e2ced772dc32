"""``reasonctl infer`` for diffusion models: one prompt to a PNG (images) or an mp4 (videos).

``--model`` is a diffusers pipeline directory (a trained export, a Hub snapshot, a tiny
alias) or a LoRA export of ``reasonctl run`` (its ``reasonctl_lora.json`` names the base
pipeline, whose transformer gets the adapters). Sampling is the deterministic sampler the
in-loop evaluation uses (Euler steps of the flow, optional classifier-free guidance),
with the model adapter's conventions, on the GPU when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reasonctl.diffusion.pipeline_dir import is_pipeline_dir

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The adapter file of a LoRA export (what the pipeline class's ``save_lora_weights`` writes)."""


@dataclass(frozen=True)
class InferOptions:
    """What to generate: resolution, length, steps, guidance, seed and the output path
    (its suffix is replaced by ``.png`` or ``.mp4``)."""

    height: int = 480
    width: int = 832
    frames: int | None = None
    steps: int = 30
    guidance_scale: float = 1.0
    negative_prompt: str = ""
    seed: int = 0
    output: Path = Path("sample")
    max_text_tokens: int | None = None


def is_diffusion_model(path: Path) -> bool:
    """True for a pipeline directory or a LoRA export of one."""
    from reasonctl.diffusion.export import read_lora_manifest

    return is_pipeline_dir(path) or read_lora_manifest(path) is not None


def generate(model_dir: Path, prompt: str, options: InferOptions) -> Path:
    """Write the sample for ``prompt`` and return the file written."""
    from reasonctl.core.errors import ConfigError
    from reasonctl.diffusion.adapters import adapter_for
    from reasonctl.diffusion.conditioning import TextConditioner
    from reasonctl.diffusion.export import read_lora_manifest
    from reasonctl.diffusion.media import write_media
    from reasonctl.diffusion.policy import load_transformer
    from reasonctl.diffusion.sampler import SamplingPlan, draw, generators, sample
    from reasonctl.diffusion.sde import flow_schedule

    manifest = read_lora_manifest(model_dir)
    base = Path(manifest["base_model"]) if manifest is not None else Path(model_dir)
    adapter = adapter_for(base)
    frames = options.frames or (1 if not adapter.video else 4 * 8 + 1)
    problems = adapter.resolution_problems(frames, options.height, options.width)
    if problems:
        raise ConfigError([f"--{p.split(':')[0]}:{p.split(':', 1)[1]}" for p in problems])
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_transformer(base, dtype=dtype, device=device)
    if manifest is not None:
        # Name the file: without it diffusers looks for the pickled ``.bin`` layout only.
        model.load_lora_adapter(str(model_dir), prefix="transformer",
                                weight_name=LORA_WEIGHTS, use_safetensors=True)
    model.eval()
    text = TextConditioner(adapter, device=device, dtype=dtype,
                           max_tokens=options.max_text_tokens)
    condition = text.for_prompts([prompt])
    negative = None
    if options.guidance_scale != 1.0:
        negative = text.for_prompts([options.negative_prompt])
    plan = SamplingPlan(flow_schedule(options.steps, adapter.shift()), 0.0,
                        options.guidance_scale)
    gens = generators([options.seed], device)
    noise = draw(gens, adapter.latent_shape(frames, options.height, options.width), device)
    with torch.no_grad():
        latents = sample(model, adapter, plan, text=condition, noise=noise, gens=gens,
                         negative=negative, dtype=dtype).latents
        clip = adapter.load_vae(device, dtype).decode(latents)[0].numpy()
    return write_media(options.output, clip)
