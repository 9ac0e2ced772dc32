"""Supervised fine-tuning: next-token loss on the assistant turns of chat samples.

Each step draws one global batch from a seeded, resumable order (see
:mod:`reasonctl.algorithms.sampling`), or this rank's share from its stream of a streamed
dataset (:mod:`reasonctl.algorithms.sample_order`), encodes this rank's share with the
model's chat template, splits it into micro-batches and asks the backend for one optimizer step. The
loss is normalised by the number of target tokens in the whole global batch (all
micro-batches, all ranks), so the gradient does not depend on how the batch is split.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from reasonctl.algorithms.sample_order import SampleOrder, sample_order, steps_per_epochs
from reasonctl.algorithms.sampling import BatchLayout
from reasonctl.algorithms.sft_batches import StepBatches, sequence_ids
from reasonctl.algorithms.sft_config import SFTConfig
from reasonctl.core.errors import ConfigError
from reasonctl.core.protocols import (
    Backend,
    Dataset,
    Processor,
    ReportsEfficiency,
    RunContext,
    StreamsSamples,
    TokenOutputs,
    streams_samples,
)
from reasonctl.core.types import Metrics


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
        self.dataset: Dataset | StreamsSamples | None = None
        self.order: SampleOrder | None = None
        self.layout: BatchLayout | None = None
        self.batches: StepBatches | None = None
        self.position: dict[str, Any] | None = None
        """The data order's position after the last trained step (what a checkpoint holds)."""
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
        if not streams_samples(self.dataset) and len(self.dataset) == 0:  # type: ignore[arg-type]
            raise ConfigError([f"data.format = {config.data.format!r}: the dataset is empty"])
        self.order = order = sample_order(self.dataset, seed=config.run.seed,
                                          shuffle=config.data.shuffle, rank=backend.rank,
                                          world_size=backend.world_size)
        size = order.samples_per_epoch
        self.layout = BatchLayout.from_train(config.train, backend.world_size)
        self.position = order.state_dict()
        self.batches = StepBatches(
            order, self.processor, self.layout,
            pack=config.data.packing, skip_bad_rows=config.data.on_bad_row == "skip",
            pin_memory=backend.device.type == "cuda",
        )
        global_batch = self.layout.global_batch_size
        if config.train.max_steps is not None:
            total = config.train.max_steps
        else:
            total = steps_per_epochs(order, config.train.epochs, global_batch,
                                     format_name=config.data.format)
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
            f"sft: {size if size is not None else 'streamed'} samples, {total} steps, "
            f"global batch {global_batch} = "
            f"{layout.world_size} rank(s) x micro-batch {layout.micro_batch_size} x "
            f"{layout.grad_accum} accumulation step(s)"
        )

    # --- the step -------------------------------------------------------------------------

    def step(self, ctx: RunContext) -> Metrics:
        """Take this rank's share of the next global batch (prepared ahead) and one step."""
        backend = _backend(ctx)
        batches = self._require_batches()
        started = time.perf_counter()
        prepared = batches.next()
        data_seconds = time.perf_counter() - started
        totals = {k: round(v * backend.world_size)
                  for k, v in backend.all_reduce_mean(prepared.counts).items()}
        loss_fn = self._loss_fn(totals)
        result = backend.train_step(prepared.micro_batches, loss_fn)
        elapsed = time.perf_counter() - started
        self.position = prepared.sampler_state
        self.truncated_samples += totals["truncated"]
        self.skipped_samples += totals["skipped"]
        for where, reason in prepared.skipped_reports:
            ctx.record_skipped_row(where, reason)
        # this rank's rows are recorded (and counted) above; other ranks' are only counted
        ctx.skipped_rows += totals["skipped"] - len(prepared.skipped_reports)
        metrics: Metrics = {
            "loss": result["loss"],
            "lr": result["lr"],
            "grad_norm": result["grad_norm"],
            "tokens_per_s": totals["input_tokens"] / elapsed if elapsed > 0 else 0.0,
            "loss_tokens": float(totals["loss_tokens"]),
            "truncated": float(totals["truncated"]),
            "epoch": prepared.epoch,
            "data_s": data_seconds,
        }
        if totals["skipped"]:
            metrics["skipped"] = float(totals["skipped"])
        if "skipped_update" in result:
            metrics["skipped_update"] = result["skipped_update"]
        metrics.update(self._efficiency(backend, totals, elapsed))
        return metrics

    def _loss_fn(self, totals: dict[str, int]) -> Any:
        tokens = max(1, totals["loss_tokens"])
        sequences = max(1, totals["target_samples"])
        per_sample = self.loss_reduction == "sample"

        def sft_loss(outputs: TokenOutputs, batch: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
            mask = batch["loss_mask"][:, 1:].to(outputs.logprobs.dtype)
            nll = -(outputs.logprobs * mask)
            if not per_sample:
                return nll.sum() / tokens, {}
            ids, count = sequence_ids(batch)
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
        return out

    # --- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Data position after the last trained step and running counts (JSON-serialisable).

        With a streamed dataset the position holds every data-parallel rank's, gathered
        from all processes (every process calls this when a checkpoint is saved)."""
        if self.position is None or self.order is None:
            raise RuntimeError("SFTAlgorithm.setup(ctx) must run before state_dict")
        return {
            "sampler": self.order.checkpoint_state(self.position),
            "skipped_samples": self.skipped_samples,
            "truncated_samples": self.truncated_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output."""
        batches = self._require_batches()
        if "sampler" in state:
            batches.restart_at(state["sampler"])
            self.position = batches.order.state_dict()
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.truncated_samples = int(state.get("truncated_samples", 0))

    def close(self) -> None:
        """Stop preparing batches."""
        if self.batches is not None:
            self.batches.close()

    # --- helpers --------------------------------------------------------------------------

    def _require_batches(self) -> StepBatches:
        if self.batches is None:
            raise RuntimeError("SFTAlgorithm.setup(ctx) must run before step/load_state_dict")
        return self.batches


def _backend(ctx: RunContext) -> Backend:
    if ctx.backend is None:
        raise RuntimeError("the run context has no backend; the runner sets it before setup")
    return ctx.backend
