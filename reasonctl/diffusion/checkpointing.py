"""``model.gradient_checkpointing = "auto"`` for diffusion transformers.

Checkpointing every block costs one more forward pass per trained transition (about a
third of the update); keeping every block's activations may not fit. ``auto`` checkpoints
only as many blocks as memory needs. The backend starts with every block checkpointed (the
safe choice); at the first update of the process, :func:`plan_checkpointing` runs the
update's own forward pass with gradients on one and on two transitions of the first
micro-batch with no block checkpointed, reads from the allocator what each block keeps
for backward and what the rest of the model keeps, and picks the fewest checkpointed
blocks whose activations, for the micro-batch size, fit in the device memory still free
after gradients and optimizer state (with a tenth of the device kept spare). Under FSDP
every rank measures and the largest count wins, so all ranks recompute the same blocks.
The probe runs eagerly under ``train.compile`` (no recompilation for its batch sizes).
On a device without allocator statistics (the CPU) ``auto`` keeps every activation.

:func:`checkpoint_blocks` applies a choice through diffusers'
``enable_gradient_checkpointing(fn)``: the model's blocks call ``fn(block, *args)``, which
checkpoints the chosen blocks and calls the others directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SPARE_FRACTION = 0.1
"""Share of the device's memory the plan leaves unused (fragmentation, transients)."""


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``: modules of a class in its ``_no_split_modules`` (also when
    FSDP has subclassed them)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules()
            if any(cls.__name__ in names for cls in type(m).__mro__)]


def checkpoint_blocks(model: nn.Module, chosen: Collection[nn.Module], *,
                      prefer_cudnn: bool = False) -> None:
    """Checkpoint exactly the blocks ``chosen`` of a diffusers transformer (none: off);
    ``prefer_cudnn`` recomputes them under the same attention preference as the forward
    (:mod:`.attention`)."""
    from reasonctl.diffusion.attention import attention_context

    if not chosen:
        model.disable_gradient_checkpointing()  # type: ignore[operator]
        return
    ids = {id(block) for block in chosen}

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), attention_context(prefer_cudnn)

    def call(block: nn.Module, *args: Any) -> Any:
        if id(block) in ids:
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False,
                                                     context_fn=contexts)
        return block(*args)

    model.enable_gradient_checkpointing(call)  # type: ignore[operator]


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes a forward pass with gradients keeps for backward, per transition:
    ``per_block`` for each block, ``block_input`` for a checkpointed block (its input),
    ``outside`` for the rest of the model; ``fixed`` whatever does not grow with the batch,
    ``transient`` the forward's peak above what it keeps."""

    blocks: int
    per_block: float
    block_input: float
    outside: float
    fixed: float
    transient: float

    def need(self, checkpointed: int, size: int) -> float:
        """Bytes the forward and backward of ``size`` transitions need with
        ``checkpointed`` blocks checkpointed (one block recomputed at a time)."""
        kept = self.outside + (self.blocks - checkpointed) * self.per_block \
            + checkpointed * self.block_input
        recompute = self.per_block if checkpointed else 0.0
        return self.fixed + size * (kept + recompute) + self.transient


def fewest_checkpointed(profile: ActivationProfile, size: int, budget: float) -> int:
    """The fewest blocks to checkpoint for ``size`` transitions to fit in ``budget`` bytes
    (every block when even that does not fit)."""
    for count in range(profile.blocks + 1):
        if profile.need(count, size) <= budget:
            return count
    return profile.blocks


def largest_uncheckpointed(profile: ActivationProfile, budget: float, limit: int) -> int:
    """The most transitions (up to ``limit``) one forward pass can take with no block
    checkpointed within ``budget`` bytes (0: not even one)."""
    return max((n for n in range(1, limit + 1) if profile.need(0, n) <= budget), default=0)


def measure(model: nn.Module, blocks: Sequence[nn.Module], run: Callable[[int], Any],
            device: torch.device) -> ActivationProfile:
    """Profile ``run(n)`` (the forward pass with gradients of ``n`` transitions, whose
    outputs it returns) for ``n`` = 1 and 2, with no block checkpointed."""
    checkpoint_blocks(model, ())
    kept: list[tuple[float, float, float, float]] = []
    transient = 0.0
    for n in (1, 2):
        marks: dict[str, float] = {}
        inputs: list[float] = []

        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   marks: dict[str, float] = marks, inputs: list[float] = inputs) -> None:
            if "first" in marks:  # a block called twice (CFG, DDRL's data pass): keep the first
                return
            marks["first"] = float(torch.cuda.memory_allocated(device))
            first = args[0] if args else kwargs.get("hidden_states")
            if isinstance(first, torch.Tensor):
                inputs.append(float(first.nelement() * first.element_size()))

        def after(module: nn.Module, args: tuple[Any, ...], output: Any,
                  marks: dict[str, float] = marks) -> None:
            marks.setdefault("last", float(torch.cuda.memory_allocated(device)))

        hooks = [blocks[0].register_forward_pre_hook(before, with_kwargs=True),
                 blocks[-1].register_forward_hook(after)]
        torch.cuda.synchronize(device)
        start = float(torch.cuda.memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        try:
            outputs = run(n)
            torch.cuda.synchronize(device)
            end = float(torch.cuda.memory_allocated(device))
            transient = max(transient, float(torch.cuda.max_memory_allocated(device)) - end)
            del outputs
        finally:
            for hook in hooks:
                hook.remove()
        in_blocks = marks.get("last", end) - marks.get("first", start)
        kept.append((end - start, in_blocks, inputs[0] if inputs else 0.0, float(n)))
    (one, blocks_one, input_one, _), (two, blocks_two, _, _) = kept
    per_transition = two - one
    per_blocks = max(blocks_two - blocks_one, 0.0)
    return ActivationProfile(
        blocks=len(blocks), per_block=per_blocks / max(len(blocks), 1), block_input=input_one,
        outside=max(per_transition - per_blocks, 0.0), fixed=max(one - per_transition, 0.0),
        transient=transient)


def free_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
               ) -> float:
    """Memory this process can still allocate, less the gradients and optimizer state the
    first optimizer step has yet to create, less the spare share."""
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pending = 0
    has_state = bool(optimizer.state)
    for param in model.parameters():
        if not param.requires_grad:
            continue
        local = getattr(param, "_local_tensor", param)
        size = local.nelement() * local.element_size()
        if param.grad is None:
            pending += size
        if not has_state:
            pending += 2 * size  # AdamW's two moments
    return float(available - pending - SPARE_FRACTION * total)


@dataclass(frozen=True)
class CheckpointPlan:
    """What :func:`plan_checkpointing` chose: ``checkpointed`` blocks of ``blocks``, and
    ``fits_without``, the largest micro-batch that would need none (``None``: not measured)."""

    checkpointed: int
    blocks: int
    fits_without: int | None = None

    def describe(self, size: int) -> str:
        """A line for the run's log."""
        text = (f"model.gradient_checkpointing = auto: {self.checkpointed} of {self.blocks} "
                f"block(s) checkpointed for micro-batches of {size} transition(s)")
        if self.checkpointed and self.fits_without:
            text += (f"; train.micro_batch_size = {self.fits_without} would need none "
                     "(no recomputation, usually faster)")
        return text


def plan_checkpointing(model: nn.Module, optimizer: torch.optim.Optimizer,
                       run: Callable[[int], Any], *, size: int, device: torch.device,
                       prefer_cudnn: bool = False) -> CheckpointPlan:
    """Measure, choose and apply the checkpointed blocks (see the module docstring)."""
    blocks = transformer_blocks(model)
    if not blocks:
        return CheckpointPlan(0, 0)
    if device.type != "cuda":
        checkpoint_blocks(model, ())
        return CheckpointPlan(0, len(blocks))
    profile = measure(model, blocks, run, device)
    budget = free_bytes(model, optimizer, device)
    count = fewest_checkpointed(profile, size, budget)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        value = torch.tensor([count], device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        count = int(value.item())
    checkpoint_blocks(model, blocks[:count], prefer_cudnn=prefer_cudnn)
    return CheckpointPlan(count, len(blocks), largest_uncheckpointed(profile, budget, size))


def plan_for_backend(backend: Any, forward: Callable[[Any, Any], Any],
                     batch: Callable[[int], Any], *, size: int,
                     prefer_cudnn: bool = False) -> CheckpointPlan | None:
    """:func:`plan_checkpointing` on a torch backend's transformer, profiling
    ``forward(model, batch(n))`` in training mode under the backend's autocast; ``None``
    when the backend does not expose its model and optimizer (checkpointing stays on)."""
    model = getattr(backend, "hf_model", None)
    optimizer = getattr(backend, "optimizer", None)
    autocast = getattr(backend, "autocast", None)
    if model is None or optimizer is None or autocast is None \
            or not getattr(model, "_supports_gradient_checkpointing", False):
        return None

    def run(n: int) -> Any:
        model.train()
        inputs = backend.to_device(batch(n)) if hasattr(backend, "to_device") else batch(n)
        # eagerly: compiled blocks would recompile for these batch sizes (and eager keeps
        # at least what compiled code keeps, so the estimate errs on the safe side)
        with torch.compiler.set_stance("force_eager"), torch.enable_grad(), autocast():
            return forward(model, inputs)

    return plan_checkpointing(model, optimizer, run, size=size, device=backend.device,
                              prefer_cudnn=prefer_cudnn)


def recompute_with_preference(backend: Any) -> None:
    """Re-install a torch backend's checkpointing (when on) so that recomputed blocks prefer
    cuDNN attention like their forward pass (their saved tensors must match)."""
    model = getattr(backend, "hf_model", None)
    if model is not None and getattr(model, "gradient_checkpointing", False):
        checkpoint_blocks(model, transformer_blocks(model), prefer_cudnn=True)
