"""Supervised fine-tuning: next-token loss on the assistant turns of chat samples.

Each step draws one global batch from a seeded, resumable stream (see
:mod:`reasonctl.algorithms.sampling`), encodes this rank's share with the model's chat
template, splits it into micro-batches and asks the backend for one optimizer step. The
loss is normalised by the number of target tokens in the whole global batch (all
micro-batches, all ranks), so the gradient does not depend on how the batch is split.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from reasonctl.algorithms.sampling import BatchLayout, EpochSampler
from reasonctl.algorithms.sft_config import SFTConfig
from reasonctl.core.errors import ConfigError, DataError
from reasonctl.core.protocols import (
    Backend,
    Dataset,
    Processor,
    ReportsEfficiency,
    ReportsMemory,
    RunContext,
    TokenOutputs,
)
from reasonctl.core.types import Metrics
from reasonctl.data.collate import collate
from reasonctl.data.processing import EncodedSample
from reasonctl.data.rows import split_problem


class SFTAlgorithm:
    """The SFT step (implements the ``Algorithm`` protocol).

    It uses the runner's default parts (the chat processor and the training dataset), so it
    declares no ``needs()``. ``loss_reduction = "token"`` averages over all target tokens of
    the global batch; ``"sample"`` first averages within each sample, then over the samples
    that have targets, so long answers do not dominate.
    """

    def __init__(self, config: SFTConfig | None = None) -> None:
        self.loss_reduction = (config or SFTConfig()).loss_reduction
        self.processor: Processor | None = None
        self.dataset: Dataset | None = None
        self.sampler: EpochSampler | None = None
        self.layout: BatchLayout | None = None
        self.skipped_samples = 0
        self.truncated_samples = 0

    # --- set-up ---------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Take the run's processor and dataset; set the data order and ``ctx.total_steps``."""
        backend = _backend(ctx)
        config = ctx.config
        if ctx.processor is None or ctx.dataset is None:
            raise RuntimeError("SFT needs the run's processor and dataset; the runner builds them")
        self.processor = ctx.processor
        self.dataset = ctx.dataset
        size = len(self.dataset)
        if size == 0:
            raise ConfigError([f"data.format = {config.data.format!r}: the dataset is empty"])
        self.layout = BatchLayout.from_train(config.train, backend.world_size)
        self.sampler = EpochSampler(size, seed=config.run.seed, shuffle=config.data.shuffle)
        global_batch = self.layout.global_batch_size
        if config.train.max_steps is not None:
            total = config.train.max_steps
        else:
            total = config.train.epochs * size // global_batch
        if total == 0:
            raise ConfigError([
                f"train.global_batch_size: {global_batch} is more than the {size} samples x "
                f"{config.train.epochs} epoch(s) of data, so there is not one full step; lower "
                "train.global_batch_size, raise train.epochs or set train.max_steps"
            ])
        ctx.total_steps = total
        if config.data.packing and config.model.attention in ("sdpa", "eager"):
            ctx.info(
                f"note: data.packing with model.attention = {config.model.attention!r} attends "
                "through a dense mask over each packed row (quadratic in the row length); "
                "use 'flash_attention_2' for packing or set data.packing = false"
            )
        layout = self.layout
        ctx.info(
            f"sft: {size} samples, {total} steps, global batch {global_batch} = "
            f"{layout.world_size} rank(s) x micro-batch {layout.micro_batch_size} x "
            f"{layout.grad_accum} accumulation step(s)"
        )

    # --- the step -------------------------------------------------------------------------

    def step(self, ctx: RunContext) -> Metrics:
        """Encode this rank's share of the next global batch and take one optimizer step."""
        backend = _backend(ctx)
        sampler, layout, processor = self._require()
        started = time.perf_counter()
        indices = layout.rank_slice(sampler.take(layout.global_batch_size), backend.rank)
        encoded, skipped = self._encode(ctx, indices)
        micro_batches = [
            collate(chunk, processor.pad_id, pack=ctx.config.data.packing)
            for chunk in layout.micro_chunks(encoded)
        ]
        data_seconds = time.perf_counter() - started
        local = {
            "loss_tokens": float(sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)),
            "target_samples": float(sum(_num_target_sequences(mb) for mb in micro_batches)),
            "input_tokens": float(sum(len(e) for e in encoded)),
            "samples": float(len(encoded)),
            "truncated": float(sum(e.truncated for e in encoded)),
            "skipped": float(skipped),
        }
        totals = {k: round(v * backend.world_size)
                  for k, v in backend.all_reduce_mean(local).items()}
        loss_fn = self._loss_fn(totals)
        result = backend.train_step(micro_batches, loss_fn)
        elapsed = time.perf_counter() - started
        self.truncated_samples += totals["truncated"]
        self.skipped_samples += totals["skipped"]
        ctx.skipped_rows += totals["skipped"] - skipped  # this rank's are recorded already
        metrics: Metrics = {
            "loss": result["loss"],
            "lr": result["lr"],
            "grad_norm": result["grad_norm"],
            "tokens_per_s": totals["input_tokens"] / elapsed if elapsed > 0 else 0.0,
            "loss_tokens": float(totals["loss_tokens"]),
            "truncated": float(totals["truncated"]),
            "epoch": sampler.epoch + sampler.index / sampler.size,
            "data_s": data_seconds,
        }
        if totals["skipped"]:
            metrics["skipped"] = float(totals["skipped"])
        if "skipped_update" in result:
            metrics["skipped_update"] = result["skipped_update"]
        metrics.update(self._efficiency(backend, totals, elapsed))
        return metrics

    def _encode(self, ctx: RunContext, indices: list[int]) -> tuple[list[EncodedSample], int]:
        """Encode samples; with ``data.on_bad_row = "skip"`` a bad one becomes a no-target stand-in.

        A stand-in (the previous good sample with its targets masked out) keeps the number of
        micro-batches equal on every rank, which collective backends require, without
        changing the loss.
        """
        assert self.dataset is not None and self.processor is not None
        encoded: list[EncodedSample | None] = []
        skipped = 0
        for index in indices:
            sample = self.dataset[index]
            try:
                encoded.append(self.processor.encode_sft(sample))
            except DataError as exc:
                if ctx.config.data.on_bad_row != "skip":
                    raise
                ctx.record_skipped_row(*split_problem(exc, sample.source))
                skipped += 1
                encoded.append(None)
        good = [e for e in encoded if e is not None]
        filler = good[0] if good else EncodedSample([self.processor.pad_id] * 2, [0, 0])
        out: list[EncodedSample] = []
        for item in encoded:
            if item is None:
                item = EncodedSample(list(filler.input_ids), [0] * len(filler.input_ids),
                                     dict(filler.extras))
            out.append(item)
        return out, skipped

    def _loss_fn(self, totals: dict[str, int]) -> Any:
        tokens = max(1, totals["loss_tokens"])
        sequences = max(1, totals["target_samples"])
        per_sample = self.loss_reduction == "sample"

        def sft_loss(outputs: TokenOutputs, batch: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
            mask = batch["loss_mask"][:, 1:].to(outputs.logprobs.dtype)
            nll = -(outputs.logprobs * mask)
            if not per_sample:
                return nll.sum() / tokens, {}
            ids, count = _sequence_ids(batch)
            ids = ids[:, 1:].reshape(-1)
            sums = torch.zeros(count, dtype=nll.dtype, device=nll.device)
            sizes = torch.zeros(count, dtype=nll.dtype, device=nll.device)
            sums.index_add_(0, ids, nll.reshape(-1))
            sizes.index_add_(0, ids, mask.reshape(-1))
            return (sums / sizes.clamp(min=1)).sum() / sequences, {}

        return sft_loss

    def _efficiency(self, backend: Backend, totals: dict[str, int], elapsed: float) -> Metrics:
        out: Metrics = {}
        if isinstance(backend, ReportsEfficiency):
            peak = backend.peak_flops()
            if peak and elapsed > 0 and totals["samples"]:
                mean_len = totals["input_tokens"] / totals["samples"]
                flops = backend.training_flops(totals["input_tokens"], mean_len)
                out["mfu"] = flops / (elapsed * peak * backend.world_size)
        if isinstance(backend, ReportsMemory):
            out.update(backend.memory_metrics())
        return out

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Data position and running counts (JSON-serialisable)."""
        sampler, _, _ = self._require()
        return {
            "sampler": sampler.state_dict(),
            "skipped_samples": self.skipped_samples,
            "truncated_samples": self.truncated_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output."""
        sampler, _, _ = self._require()
        if "sampler" in state:
            sampler.load_state_dict(state["sampler"])
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.truncated_samples = int(state.get("truncated_samples", 0))

    # --- helpers --------------------------------------------------------------------------

    def _require(self) -> tuple[EpochSampler, BatchLayout, Processor]:
        if self.sampler is None or self.layout is None or self.processor is None:
            raise RuntimeError("SFTAlgorithm.setup(ctx) must run before step/state_dict")
        return self.sampler, self.layout, self.processor


def _backend(ctx: RunContext) -> Backend:
    if ctx.backend is None:
        raise RuntimeError("the run context has no backend; the runner sets it before setup")
    return ctx.backend


def _sequence_ids(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Per-token sequence index (rows, or packed samples split where positions restart)."""
    input_ids = batch["input_ids"]
    if "position_ids" in batch and "attention_mask" not in batch:
        starts = (batch["position_ids"] == 0).long()
        ids = starts.cumsum(dim=-1) - 1
        return ids.clamp(min=0), int(starts.sum())
    rows, width = input_ids.shape
    ids = torch.arange(rows, device=input_ids.device).unsqueeze(1).expand(rows, width)
    return ids, rows


def _num_target_sequences(batch: dict[str, Any]) -> int:
    ids, count = _sequence_ids(batch)
    targets = batch["loss_mask"][:, 1:]
    has = torch.zeros(count, dtype=torch.long)
    has.index_add_(0, ids[:, 1:].reshape(-1).cpu(), targets.reshape(-1).cpu().long())
    return int((has > 0).sum())
