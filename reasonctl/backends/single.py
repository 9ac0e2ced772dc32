"""The one-device backend: a whole model on one CPU or CUDA device, no process group."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

from reasonctl.backends.base import TorchBackend
from reasonctl.backends.compile import compile_blocks
from reasonctl.backends.distributed import run_device
from reasonctl.backends.export import tied_parameter_groups
from reasonctl.backends.lora import LoraState
from reasonctl.backends.optim import build_optimizer, build_scheduler
from reasonctl.backends.token_logprobs import TokenLogprobModel
from reasonctl.core.errors import ReasonctlError
from reasonctl.core.protocols import RunContext
from reasonctl.diffusion.pipeline_dir import is_pipeline_dir
from reasonctl.models.loading import (
    apply_trainable_patterns,
    compute_dtype,
    count_parameters,
    enable_gradient_checkpointing,
    ensure_model_source,
    load_pretrained,
)


class SingleDeviceBackend(TorchBackend):
    """Trains the whole model on one device.

    Parameters are kept in float32 and matmuls run in ``model.dtype`` under autocast
    (``param_dtype = "float32"``, the default), or parameters and optimizer state are kept
    in ``model.dtype`` itself (``param_dtype = "compute"``: half the memory, faster, but
    small updates can round away in bfloat16). With ``[model.lora]`` the frozen base
    weights are kept in ``model.dtype`` and the adapters in the parameter dtype; the
    rollout engine then keeps its own merged copy (``generation_model`` is ``None``).
    A diffusers pipeline directory trains its transformer (see
    :mod:`reasonctl.backends.base`).
    """

    def __init__(self, *, param_dtype: Literal["float32", "compute"] = "float32",
                 chunk_tokens: int, export_shard_size: str) -> None:
        super().__init__(chunk_tokens=chunk_tokens, export_shard_size=export_shard_size)
        self.param_dtype_mode = param_dtype
        self.compute_dtype = torch.float32
        self._autocast = False

    def build(self, ctx: RunContext) -> None:
        """Load the model onto the device and create AdamW and the schedule."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ReasonctlError(
                f"backend 'single' trains in one process but {world} were launched; use "
                "--backend fsdp with --nproc-per-node, or launch one process"
            )
        config = ctx.config
        self.device = run_device(config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.compute_dtype = compute_dtype(config.model.dtype, self.device)
        param_dtype = torch.float32 if self.param_dtype_mode == "float32" else self.compute_dtype
        self.source = ensure_model_source(ctx)
        if is_pipeline_dir(self.source.model_dir):
            self._build_diffusion(ctx, param_dtype)
            return
        lora = config.model.lora
        if lora is None:
            hf_model = load_pretrained(self.source.model_dir, config.model,
                                       param_dtype=param_dtype, device=self.device)
            self.tied_groups = tied_parameter_groups(hf_model)
            self.parameter_counts = apply_trainable_patterns(
                hf_model, freeze=config.model.freeze, trainable=config.model.trainable
            )
        else:  # adapters are created on the CPU, so every device starts from the same ones
            hf_model = load_pretrained(self.source.model_dir, config.model,
                                       param_dtype=self.compute_dtype, device="cpu")
            self.tied_groups = tied_parameter_groups(hf_model)
            self.lora = LoraState.attach(hf_model, lora, seed=config.run.seed,
                                         trainable_dtype=param_dtype)
            hf_model.to(self.device)
            self.parameter_counts = count_parameters(hf_model)
        if config.model.gradient_checkpointing:
            enable_gradient_checkpointing(hf_model)
        if config.train.compile:
            compile_blocks(hf_model)
        self.hf_model = hf_model
        # LoRA layers would be bypassed by the engine's fused decode path: it keeps a copy
        self.generation_model = hf_model if lora is None else None
        self._autocast = any(p.dtype != self.compute_dtype for p in hf_model.parameters())
        self.policy = TokenLogprobModel(hf_model, chunk_tokens=self.chunk_tokens)
        self.optimizer = build_optimizer(self.policy.named_parameters(), config.train,
                                         device=self.device)
        self.scheduler = build_scheduler(self.optimizer, config.train, lambda: ctx.total_steps)

    def _build_diffusion(self, ctx: RunContext, param_dtype: torch.dtype) -> None:
        config = ctx.config
        if config.model.lora is None:
            model = self.load_diffusion_transformer(ctx, param_dtype=param_dtype,
                                                    device=self.device)
        else:  # as for a language model: the frozen base in the compute dtype, adapters
            # created on the CPU in the parameter dtype, then moved
            model = self.load_diffusion_transformer(
                ctx, param_dtype=self.compute_dtype, device="cpu", trainable_dtype=param_dtype)
            model.to(self.device)
        if config.train.compile:  # denoising steps have fixed shapes: sampling compiles too
            compile_blocks(model, without_grad=True)
        self.hf_model = self.generation_model = self.policy = model
        self._autocast = any(p.dtype != self.compute_dtype for p in model.parameters())
        self.optimizer = build_optimizer(model.named_parameters(), config.train,
                                         device=self.device)
        self.scheduler = build_scheduler(self.optimizer, config.train, lambda: ctx.total_steps)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the compute dtype when parameters are kept in a wider dtype."""
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def gather_full_state_dict(self, *, trainable_only: bool = False
                               ) -> dict[str, torch.Tensor]:
        """The model's state dict as CPU tensors (Hugging Face names); ``trainable_only``
        keeps the parameters that train."""
        if trainable_only:
            return {k: v.detach().cpu() for k, v in self.hf_model.named_parameters()
                    if v.requires_grad}
        return {k: v.detach().cpu() for k, v in self.hf_model.state_dict().items()}

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the live parameters and buffers by name (no copies)."""
        for name, tensor in self.hf_model.state_dict().items():
            yield name, tensor.detach()
