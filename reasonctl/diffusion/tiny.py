"""Tiny random diffusers pipelines, built offline for tests, the quickstart and benchmarks.

``tiny-random-wan`` (text-to-video), ``tiny-random-sd3`` (text-to-image) and
``tiny-random-cosmos`` (Cosmos-Predict2.5-shaped, without the torchvision-only padding
mask) are pipeline directories of a few hundred thousand parameters: a 2-block
transformer, a small VAE with the real strides (8 in space, 4 in time), a small text
encoder with the byte-level tokenizer of :mod:`reasonctl.models.tiny`, and a
flow-matching Euler scheduler.

A randomly initialised VAE decodes every latent to nearly the same grey (its last
normalisation erases what would make one sample brighter than another), so no pixel reward
could be learned through it. The SD3 pipeline's ``AutoencoderKL`` is therefore *legible*
instead of random: its blocks pass features through unchanged (zero residual branches,
identity up/down-sampling) and latent channels 0-2 carry red, green and blue, so the
quickstart's brightness reward has a direction to learn.

``model.name_or_path`` may name them; they are created in the reasonctl cache on first
use. Wan and SD3 are written by their pipeline classes' ``save_pretrained``, so
``DiffusionPipeline.from_pretrained`` loads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_PIPELINES = {"tiny-random-wan": "wan", "tiny-random-sd3": "sd3",
                  "tiny-random-cosmos": "cosmos"}
TINY_VERSION = "v1"
TEXT_TOKENS = 16
"""A short text length suits the tiny encoders (``max_text_tokens``)."""


def resolve_tiny_pipeline(alias: str) -> str:
    """The cached directory of a tiny pipeline alias, created on first use."""
    from reasonctl.models.tiny import cache_root

    family = TINY_PIPELINES[alias]
    target = cache_root() / f"{alias}-{TINY_VERSION}"
    if not (target / "model_index.json").is_file():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        make_tiny_pipeline_dir(tmp, family)
        if not target.exists():
            tmp.replace(target)
    return str(target)


def make_tiny_pipeline_dir(path: str | Path, family: str = "wan", *, seed: int = 0,
                           **transformer_overrides: Any) -> Path:
    """Write a tiny random pipeline of ``family`` (``wan``, ``sd3`` or ``cosmos``) to
    ``path``; ``transformer_overrides`` change the transformer's config."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    from reasonctl.models.quiet import quiet_transformers

    builders = {"wan": _wan, "sd3": _sd3, "cosmos": _cosmos}
    if family not in builders:
        raise ValueError(f"unknown tiny pipeline family {family!r}; use {', '.join(builders)}")
    quiet_transformers()
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()
    path = Path(path)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        builders[family](path, transformer_overrides)
    finally:
        torch.random.set_rng_state(state)
    return path


def _tokenizer(max_length: int) -> Any:
    from reasonctl.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.model_max_length = max_length
    return tokenizer


def _wan_vae(z_dim: int) -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)


def _wan(path: Path, overrides: dict[str, Any]) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _tokenizer(TEXT_TOKENS)
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                  in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  rope_max_seq_len=32)
    config.update(overrides)
    transformer = WanTransformer3DModel(**config)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=_wan_vae(4),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=transformer)
    pipe.save_pretrained(path)


def _sd3(path: Path, overrides: dict[str, Any]) -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizers, encoders = [], []
    for _ in range(2):
        tokenizer = _tokenizer(77)
        tokenizers.append(tokenizer)
        encoders.append(CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37,
            num_attention_heads=4, num_hidden_layers=2, projection_dim=32,
            max_position_embeddings=77, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id,
            hidden_act="gelu")))
    config = dict(sample_size=32, patch_size=2, in_channels=4, num_layers=2,
                  attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                  joint_attention_dim=64, pooled_projection_dim=64, out_channels=4,
                  pos_embed_max_size=32)
    config.update(overrides)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=1,
                        down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4,
                        shift_factor=0.0, scaling_factor=1.0, sample_size=32)
    t5_tokenizer = _tokenizer(TEXT_TOKENS)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=int(config["joint_attention_dim"]), d_kv=8,
        d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8,
        pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
        decoder_start_token_id=t5_tokenizer.pad_token_id))
    _make_legible(vae)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**config),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
        tokenizer_2=tokenizers[1], text_encoder_3=t5, tokenizer_3=t5_tokenizer)
    pipe.save_pretrained(path)


def _make_legible(vae: Any) -> None:
    """Rewire an ``AutoencoderKL`` (one norm group) so that colour survives the round trip:
    RGB -> latent channels 0-2 -> RGB (see the module docstring)."""
    import torch

    def center(conv: Any, pairs: dict[int, int], gain: float = 1.0) -> None:
        conv.weight.zero_()
        conv.bias.zero_()
        middle = conv.weight.shape[-1] // 2
        for out, inp in pairs.items():
            conv.weight[out, inp, middle, middle] = gain

    with torch.no_grad():
        for coder in (vae.encoder, vae.decoder):
            for name, module in coder.named_modules():
                if name.endswith("conv2") or name.endswith("to_out.0"):
                    module.weight.zero_()
                    module.bias.zero_()
                elif name.endswith("downsamplers.0.conv") or name.endswith("upsamplers.0.conv"):
                    center(module, {c: c for c in range(module.weight.shape[0])})
        center(vae.encoder.conv_in, {c: c for c in range(3)})
        center(vae.encoder.conv_out, {c: c for c in range(3)}, gain=1.0)
        vae.encoder.conv_out.bias[4:].fill_(-8.0)  # log-variances: a near-deterministic posterior
        for conv in (vae.quant_conv, vae.post_quant_conv):
            center(conv, {c: c for c in range(conv.weight.shape[0])})
        center(vae.decoder.conv_in, {c: c for c in range(4)})
        center(vae.decoder.conv_out, {c: c for c in range(3)}, gain=0.8)


def _cosmos(path: Path, overrides: dict[str, Any]) -> None:
    import diffusers
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2ForCausalLM

    from reasonctl.models.tiny import tiny_qwen2_config

    tokenizer = _tokenizer(TEXT_TOKENS)
    encoder = Qwen2ForCausalLM(tiny_qwen2_config(len(tokenizer), hidden_size=32,
                                                 intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, num_key_value_heads=1))
    config = dict(in_channels=5, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                  num_layers=2, mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=4,
                  max_size=(8, 16, 16), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
                  concat_padding_mask=False, extra_pos_embed_type="learnable",
                  use_crossattn_projection=True, crossattn_proj_in_channels=64,
                  encoder_hidden_states_channels=32)
    config.update(overrides)
    components = {
        "transformer": CosmosTransformer3DModel(**config),
        "vae": _wan_vae(4),
        "text_encoder": encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": "Cosmos2_5_PredictBasePipeline",
                             "_diffusers_version": diffusers.__version__,
                             "safety_checker": [None, None]}
    for name, component in components.items():
        library = "diffusers" if type(component).__module__.startswith("diffusers") \
            else "transformers"
        index[name] = [library, type(component).__name__]
        component.save_pretrained(path / name)
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
