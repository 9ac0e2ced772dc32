"""Context parallelism for diffusion transformers: each rank of a ``cp`` group holds a slice
of the latent token sequence (video or image patches) of the same samples.

**Layout.** The patch tokens (``S`` of them, after patch embedding) are cut into ``cp``
contiguous slices of ``ceil(S / cp)`` or ``floor(S / cp)`` tokens (any ``S`` works); rank
``r`` of the group holds slice ``r``. Attention is bidirectional, so contiguous slices
balance the work without the causal pairing the language-model path uses.

**What is split where** (:data:`PLANS`, one per transformer family, by module name):

- the rotary tables and learnable position embeddings are computed by the model for the
  whole sequence and narrowed to this rank's slice as they leave their module, so every
  token keeps its global position (Wan and Cosmos ``rope``, Cosmos
  ``learnable_pos_embed``); SD3's patch embedding adds its position table before the
  split (``pos_embed``);
- the token sequence is narrowed as it enters the first block (Wan, Cosmos) or as it
  leaves the patch embedding (SD3); per-token modulation (Cosmos with conditioning
  frames) is narrowed as it enters each block and the output norm;
- **self-attention** modules run inside a torch function mode that replaces their
  ``scaled_dot_product_attention`` call: this rank's queries attend to the group's
  keys and values, all-gathered (one collective per layer, keys and values stacked;
  the backward pass reduce-scatters their gradients). Tokens after the local slice
  (SD3's text tokens, which joint attention appends to the image tokens) are the same
  on every rank and are kept once, not gathered. Cross-attention to text stays local;
- the output projection's result is all-gathered, so the transformer returns the full
  velocity on every rank of the group and the samplers, FlowGRPO/DDRL log-probs and
  losses see what they see without context parallelism. Its backward keeps this rank's
  slice of the gradient; the data-parallel gradient reduction, which spans the ``cp``
  ranks, adds their parts (as for language models).

Samples are identical across a group because every rank of it has the same data-parallel
rank, and so the same prompts and noise seeds; the gathered output is bitwise equal on
all of them, so sampling trajectories stay in step.

**Why not diffusers' own context parallelism.** diffusers 0.42 has
``ContextParallelConfig`` / ``ModelMixin.enable_parallelism`` with ring and Ulysses
templates (both with backward passes) and a ``_cp_plan`` on ``WanTransformer3DModel``,
but: ``SD3Transformer2DModel`` and ``CosmosTransformer3DModel`` have no plan, and SD3's
joint attention appends the text tokens to the sequence (an even split would cut them
too); ``_resolve_parallel_config`` picks the device as ``rank % torch.accelerator.
device_count()``, which fails on a CPU/gloo job (no accelerator); the ring template
needs an attention backend that returns log-sum-exp (not the native SDPA one used on
CPU); Ulysses needs the heads and the sequence divisible by ``cp``; and its sharder
asserts an evenly divisible sequence. The hooks here are small, work on gloo and NCCL
alike and are checked against the unsplit model on CPU.

The attention call must go through ``torch.nn.functional.scaled_dot_product_attention``
(diffusers' default ``native`` attention backend); a self-attention module that made no
such call raises instead of silently attending to its local keys only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from reasonctl.backends.distributed import all_gather_into, reduce_scatter_into
from reasonctl.core.errors import ConfigError


@dataclass(frozen=True)
class ArgSplit:
    """A per-token argument of a module call: by ``position`` or keyword ``name``, split
    along ``dim`` when it has ``ndim`` dimensions and the full sequence length there."""

    position: int
    name: str
    dim: int = 1
    ndim: int = 3


@dataclass(frozen=True)
class SequencePlan:
    """Where one transformer family's token sequence is split and gathered (module names
    are full-matched regular expressions)."""

    split_outputs: dict[str, int]
    """Modules whose output (a tensor or tuple of tensors) is narrowed along this dim."""
    split_inputs: dict[str, tuple[ArgSplit, ...]]
    """Modules whose per-token arguments are narrowed as they enter."""
    gather_output: str
    """The module whose output (``[B, S_local, ...]``) is all-gathered along dim 1."""
    self_attention: str
    """The self-attention modules (their keys/values are gathered)."""


_BLOCK_HIDDEN = ArgSplit(0, "hidden_states")

PLANS: dict[str, SequencePlan] = {
    "WanTransformer3DModel": SequencePlan(
        split_outputs={"rope": 1},
        split_inputs={r"blocks\.0": (_BLOCK_HIDDEN,)},
        gather_output="proj_out",
        self_attention=r"blocks\.\d+\.attn1",
    ),
    "SD3Transformer2DModel": SequencePlan(
        split_outputs={"pos_embed": 1},
        split_inputs={},
        gather_output="proj_out",
        self_attention=r"transformer_blocks\.\d+\.attn2?",
    ),
    "CosmosTransformer3DModel": SequencePlan(
        split_outputs={"rope": 0, "learnable_pos_embed": 1},
        split_inputs={
            r"transformer_blocks\.\d+": (
                _BLOCK_HIDDEN, ArgSplit(2, "embedded_timestep"), ArgSplit(3, "temb"),
                ArgSplit(7, "controlnet_residual"),
            ),
            "norm_out": (ArgSplit(1, "embedded_timestep"), ArgSplit(2, "temb")),
        },
        gather_output="proj_out",
        self_attention=r"transformer_blocks\.\d+\.attn1",
    ),
}
"""The supported transformer classes (diffusers class name -> plan)."""


@dataclass
class SequenceSlices:
    """How a sequence of ``full`` tokens is cut over the group: ``counts[r]`` tokens for
    rank ``r``, in rank order."""

    group: Any
    size: int
    rank: int
    full: int
    counts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        base, extra = divmod(self.full, self.size)
        self.counts = [base + (1 if r < extra else 0) for r in range(self.size)]

    @property
    def local(self) -> int:
        """Tokens this rank holds."""
        return self.counts[self.rank]

    @property
    def start(self) -> int:
        """Global index of this rank's first token."""
        return sum(self.counts[: self.rank])

    def narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full-length ``tensor`` along ``dim``."""
        return tensor.narrow(dim, self.start, self.local)


class DiffusionContextParallel:
    """The hooks that split one diffusion transformer's sequence over a ``cp`` group."""

    def __init__(self, group: Any, plan: SequencePlan) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.plan = plan
        self.slices: SequenceSlices | None = None
        """The layout of the latest forward pass (set by its first split). It stays after
        the pass: gradient checkpointing recomputes blocks during the backward pass, which
        reads it again (a run's passes all have one latent shape)."""
        self.pending = False
        self.gathered = False

    # --- per forward pass -------------------------------------------------------------

    def begin(self, _module: nn.Module, _args: Any) -> None:
        """Root pre-hook: a new forward pass, its layout set by its first split."""
        self.pending = True
        self.gathered = False

    def finish(self, module: nn.Module, _args: Any, output: Any) -> Any:
        """Root hook: the output must have been gathered."""
        if not self.gathered:
            raise RuntimeError(f"{type(module).__name__}: context parallelism split the "
                               "sequence but its output was not gathered")
        return output

    def _split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.pending or self.slices is None:
            self.slices = SequenceSlices(self.group, self.size, self.rank,
                                         int(tensor.shape[dim]))
            self.pending = False
        if tensor.shape[dim] != self.slices.full:
            raise RuntimeError(f"context parallelism: a per-token tensor has {tensor.shape[dim]}"
                               f" positions but the sequence has {self.slices.full}")
        return self.slices.narrow(tensor, dim)

    def split_output(self, dim: int, _module: nn.Module, _args: Any, output: Any) -> Any:
        """Forward hook: narrow the module's output tensor(s) to this rank's slice."""
        if isinstance(output, torch.Tensor):
            return self._split(output, dim)
        return type(output)(self._split(t, dim) for t in output)

    def split_inputs(self, specs: tuple[ArgSplit, ...], _module: nn.Module,
                     args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: narrow full-length per-token arguments (see :class:`ArgSplit`)."""
        args = list(args)  # type: ignore[assignment]
        for spec in specs:
            if spec.position < len(args):
                args[spec.position] = self._split_if_full(args[spec.position], spec)  # type: ignore[index]
            elif spec.name in kwargs:
                kwargs[spec.name] = self._split_if_full(kwargs[spec.name], spec)
        return tuple(args), kwargs

    def _split_if_full(self, value: Any, spec: ArgSplit) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() != spec.ndim:
            return value
        if (not self.pending and self.slices is not None
                and value.shape[spec.dim] != self.slices.full):
            return value  # already this rank's slice
        return self._split(value, spec.dim)

    def gather_output(self, _module: nn.Module, _args: Any, output: torch.Tensor
                      ) -> torch.Tensor:
        """Forward hook: the full sequence of the output projection on every rank."""
        if self.slices is None:
            raise RuntimeError("context parallelism: the output projection ran before the "
                               "sequence was split")
        self.gathered = True
        return _GatherReplicated.apply(output, self.slices, 1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        """``scaled_dot_product_attention`` of the local queries over the group's keys and
        values (``[B, H, S, D]``; positions past the local slice are shared, kept once)."""
        slices = self.slices
        if slices is None:
            raise RuntimeError("context parallelism: self-attention ran before the sequence "
                               "was split")
        if attn_mask is not None or is_causal:
            raise RuntimeError("context parallelism supports unmasked self-attention only")
        local = slices.local
        if key.shape[-2] < local or query.shape[-2] != key.shape[-2]:
            raise RuntimeError(f"context parallelism: self-attention over {key.shape[-2]} "
                               f"keys, but this rank holds {local} of {slices.full} tokens")
        both = torch.stack([key[..., :local, :], value[..., :local, :]])
        both = _GatherSharded.apply(both, slices, both.dim() - 2)
        if key.shape[-2] > local:  # shared tokens (SD3's text) after the image tokens
            rest = torch.stack([key[..., local:, :], value[..., local:, :]])
            both = torch.cat([both, rest], dim=-2)
        return F.scaled_dot_product_attention(query, both[0], both[1], dropout_p=dropout_p,
                                              scale=scale, enable_gqa=enable_gqa)


class _GatheredAttention(TorchFunctionMode):
    """Routes the ``scaled_dot_product_attention`` calls of one module to
    :meth:`DiffusionContextParallel.attend`."""

    def __init__(self, parallel: DiffusionContextParallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.parallel.attend(*args, **kwargs)
        return func(*args, **kwargs)


def _gathered_forward(module: nn.Module, forward: Any, parallel: DiffusionContextParallel,
                      name: str) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        mode = _GatheredAttention(parallel)
        with mode:
            out = forward(*args, **kwargs)
        if mode.calls != 1:
            raise RuntimeError(
                f"context parallelism: self-attention {name} ({type(module).__name__}) made "
                f"{mode.calls} scaled_dot_product_attention calls (expected 1); it needs "
                "diffusers' native attention backend (unset DIFFUSERS_ATTN_BACKEND or "
                "set_attention_backend('native'))"
            )
        return out

    return run


def check_diffusion_context_parallel(model: nn.Module, *, compile: bool = False) -> SequencePlan:
    """The plan for ``model``, or :class:`ConfigError` naming why it cannot be split."""
    name = type(model).__name__
    plan = PLANS.get(name)
    problems = []
    if plan is None:
        problems.append(f"backend.fsdp.cp > 1: {name} has no context-parallel plan (supported "
                        f"diffusion transformers: {', '.join(sorted(PLANS))}); set cp = 1")
    if compile:
        problems.append("backend.fsdp.cp > 1 with a diffusion transformer does not support "
                        "train.compile yet; set train.compile = false or cp = 1")
    if problems:
        raise ConfigError(problems)
    assert plan is not None
    return plan


def enable_diffusion_context_parallel(model: nn.Module, group: Any, *,
                                      compile: bool = False) -> DiffusionContextParallel:
    """Split ``model``'s token sequence over ``group`` (hooks only; weights untouched).

    Call before sharding. Raises :class:`ConfigError` for unsupported models or options.
    """
    plan = check_diffusion_context_parallel(model, compile=compile)
    parallel = DiffusionContextParallel(group, plan)
    modules = dict(model.named_modules())
    found = {"outputs": 0, "inputs": 0, "attention": 0, "gather": 0}
    for name, module in modules.items():
        for pattern, dim in plan.split_outputs.items():
            if re.fullmatch(pattern, name):
                module.register_forward_hook(_partial(parallel.split_output, dim))
                found["outputs"] += 1
        for pattern, specs in plan.split_inputs.items():
            if re.fullmatch(pattern, name):
                module.register_forward_pre_hook(_partial(parallel.split_inputs, specs),
                                                 with_kwargs=True)
                found["inputs"] += 1
        if re.fullmatch(plan.self_attention, name):
            module.forward = _gathered_forward(module, module.forward, parallel, name)  # type: ignore[method-assign]
            found["attention"] += 1
        if name == plan.gather_output:
            module.register_forward_hook(parallel.gather_output)
            found["gather"] += 1
    missing = [k for k, v in found.items() if not v and (k != "inputs" or plan.split_inputs)]
    if missing:
        raise ConfigError([f"backend.fsdp.cp > 1: {type(model).__name__} lacks the modules "
                           f"its context-parallel plan names ({', '.join(missing)}); set "
                           "cp = 1"])
    model.register_forward_pre_hook(parallel.begin)
    model.register_forward_hook(parallel.finish)
    return parallel


def _partial(fn: Any, first: Any) -> Any:
    def hook(*args: Any, **kwargs: Any) -> Any:
        return fn(first, *args, **kwargs)

    return hook


# --- collectives with autograd (uneven slices) --------------------------------------------


def _all_gather(local: torch.Tensor, slices: SequenceSlices, dim: int) -> torch.Tensor:
    """Every rank's slice along ``dim``, concatenated in rank order."""
    longest = max(slices.counts)
    padded = local
    if local.shape[dim] < longest:
        shape = list(local.shape)
        shape[dim] = longest - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(shape)], dim=dim)
    padded = padded.contiguous()
    out = padded.new_empty((slices.size * padded.shape[0], *padded.shape[1:]))
    all_gather_into(out, padded, slices.group)
    pieces = out.view(slices.size, *padded.shape)
    return torch.cat([pieces[r].narrow(dim, 0, n) for r, n in enumerate(slices.counts)],
                     dim=dim)


class _GatherSlices(torch.autograd.Function):
    """All-gather of the group's slices along ``dim``; subclasses say what the backward
    does with the whole sequence's gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, slices: SequenceSlices, dim: int
                ) -> torch.Tensor:
        ctx.slices, ctx.dim = slices, dim
        return _all_gather(local, slices, dim)


class _GatherSharded(_GatherSlices):
    """All-gather of sharded activations (keys/values); backward sums every rank's
    gradient of this rank's slice (reduce-scatter)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        slices, dim = ctx.slices, ctx.dim
        longest = max(slices.counts)
        pieces = []
        for part in grad.split(slices.counts, dim=dim):
            if part.shape[dim] < longest:
                shape = list(part.shape)
                shape[dim] = longest - part.shape[dim]
                part = torch.cat([part, part.new_zeros(shape)], dim=dim)
            pieces.append(part)
        stacked = torch.cat(pieces, dim=0).contiguous()
        out = stacked.new_empty(pieces[0].shape)
        reduce_scatter_into(out, stacked, slices.group)
        return out.narrow(dim, 0, slices.local), None, None


class _GatherReplicated(_GatherSlices):
    """All-gather of results every rank then uses identically (the transformer output);
    backward keeps this rank's slice of the gradient."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.slices.narrow(grad, ctx.dim).contiguous(), None, None
