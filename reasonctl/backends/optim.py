"""Optimizer and learning-rate schedule built from ``[train]``.

AdamW with decoupled weight decay on matrices only (biases and norm scales, the 1-D
parameters, are not decayed), fused on CUDA. The schedule is a linear warmup followed by a
constant, linear or cosine curve that ends at ``lr * min_lr_ratio``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from reasonctl.core.config import TrainSection


def build_optimizer(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    train: TrainSection,
    *,
    device: torch.device,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (weight decay only on parameters with ndim >= 2)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for _, param in named_parameters:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": group, "weight_decay": wd}
        for group, wd in ((decay, train.weight_decay), (no_decay, 0.0))
        if group
    ]
    if not groups:
        raise ValueError("no trainable parameters: check model.freeze / model.trainable")
    return torch.optim.AdamW(
        groups,
        lr=train.lr,
        betas=tuple(train.betas),
        eps=train.adam_eps,
        fused=device.type == "cuda",
    )


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    schedule: str,
    warmup_steps: int,
    min_lr_ratio: float,
) -> float:
    """Factor applied to the base learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown train.schedule {schedule!r}; use constant, linear or cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    train: TrainSection,
    total_steps: Callable[[], int],
) -> LambdaLR:
    """The warmup + decay schedule; ``total_steps()`` is read lazily at each step.

    Backends build the optimizer before the algorithm knows the run length (it sets
    ``ctx.total_steps`` in its setup), hence the callable.
    """

    def factor(step: int) -> float:
        return lr_multiplier(
            step,
            total_steps=total_steps(),
            schedule=train.schedule,
            warmup_steps=train.warmup_steps,
            min_lr_ratio=train.min_lr_ratio,
        )

    return LambdaLR(optimizer, factor)


def apply_train_settings(optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                         train: TrainSection) -> None:
    """Give a restored optimizer and schedule the hyperparameters of ``train``.

    A checkpoint restores the optimizer's parameter groups (``lr``, ``betas``, ``eps``,
    ``weight_decay``) and the schedule's base rates as they were saved; this puts the
    configured values back, with the learning rate the schedule gives at its restored
    step. With an unchanged config it changes nothing.
    """
    factors = [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    scheduler.base_lrs = [train.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, factors, strict=True):
        decayed = any(p.ndim >= 2 for p in group["params"])
        group.update(initial_lr=train.lr, lr=train.lr * factor, betas=tuple(train.betas),
                     eps=train.adam_eps, weight_decay=train.weight_decay if decayed else 0.0)
