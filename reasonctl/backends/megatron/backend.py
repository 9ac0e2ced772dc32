"""The megatron-core backend: tensor, pipeline (optionally interleaved) and data parallelism.

Set-up, in order: join the process group (NCCL) -> megatron's parallel state from tp/pp/
vpp (data parallel over the rest) -> one ``GPTModel`` chunk per virtual stage, built from
the Hugging Face config with the local layer spec -> each rank loads only its shard of the
safetensors checkpoint -> megatron ``DistributedDataParallel`` (float32 gradient
reduction) -> megatron's optimizer (``get_megatron_optimizer``: Adam with decoupled weight
decay and float32 main weights for bf16 models, i.e. ``Float16OptimizerWithFloat16Params``
around torch's AdamW when Transformer Engine / Apex are absent; with
``use_distributed_optimizer`` (needs one of them) megatron's ``DistributedOptimizer`` shards
that state over data-parallel ranks).

Steps run through ``megatron.core.pipeline_parallel.get_forward_backward_func()``: one
schedule call per step over all micro-batches (1F1B, or interleaved with vpp). The last
stage turns vocabulary-parallel logits into token log-probs
(:mod:`~reasonctl.backends.megatron.logprobs`) and calls the algorithm's loss function.
Losses are already normalised by a global count, so gradients are *summed* over
micro-batches and data-parallel ranks (``calculate_per_token_loss`` with no further
token scaling).

Ranks: ``rank`` / ``world_size`` are the **data-parallel** coordinates (algorithms split
data by them; the ranks of one tensor/pipeline group get the same share, and the backend
uses the batches of the group's first rank on all of them), ``is_main`` is global rank 0.

Megatron-core runs on CUDA only (its schedules, gradient buffers and RNG tracker allocate
on the current CUDA device). This module is the whole ``Backend`` protocol for megatron
(longer than our usual module: set-up, the schedule-driven step, checkpoints and the
gathers for export and rollout share the parallel state built here); batching, log-probs,
weight conversion and checkpoint layout are in the sibling modules.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reasonctl.backends.distributed import (
    barrier_all,
    init_process_group,
    mean_over_processes,
    resolve_device,
)
from reasonctl.backends.export import DEFAULT_MAX_SHARD_SIZE, save_hf_export, tied_parameter_groups
from reasonctl.backends.megatron import batches, checkpoint, parallel
from reasonctl.backends.megatron.convert import (
    ModelShape,
    ParallelLayout,
    SafetensorsSource,
    hf_to_megatron,
)
from reasonctl.backends.megatron.logprobs import vocab_parallel_logprobs
from reasonctl.backends.megatron.model import (
    ModelParallelSizes,
    build_gpt_model,
    require_megatron,
    transformer_config,
)
from reasonctl.backends.megatron.weights import (
    ParallelGroups,
    load_chunk_weights,
    stream_hf_weights,
)
from reasonctl.backends.optim import lr_multiplier
from reasonctl.backends.perf import peak_flops, training_flops
from reasonctl.backends.reference import ReferenceWeights
from reasonctl.backends.token_logprobs import TokenLogprobs
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.protocols import LossFn, RunContext
from reasonctl.core.types import Metrics
from reasonctl.models.loading import (
    ModelSource,
    ParameterCounts,
    checkpoint_dtype,
    compute_dtype,
    count_parameters,
    ensure_model_source,
    load_hf_config,
    load_pretrained,
)


@dataclass(frozen=True)
class MegatronSettings:
    """What ``[backend.megatron]`` configures."""

    sizes: ModelParallelSizes = ModelParallelSizes()
    micro_batch_size: int | None = None
    use_distributed_optimizer: bool = False
    export_shard_size: str = DEFAULT_MAX_SHARD_SIZE


@dataclass
class _MicroBatch:
    prepared: batches.PreparedBatch
    batch: dict[str, Any]


class MegatronBackend:
    """Trains a Qwen2/Qwen3/Llama-family model with megatron-core TP/PP/DP."""

    rank: int = 0
    world_size: int = 1
    is_main: bool = True
    device: torch.device = torch.device("cpu")

    def __init__(self, settings: MegatronSettings) -> None:
        self.settings = settings
        self.ctx: RunContext | None = None
        self.groups = ParallelGroups()
        self.shape: ModelShape | None = None
        self.hf_config: Any = None
        self.hf_skeleton: Any = None
        self.source: ModelSource | None = None
        self.chunks: list[torch.nn.Module] = []
        """This rank's ``GPTModel`` chunks (unwrapped), one per virtual pipeline stage."""
        self.ddp_chunks: list[torch.nn.Module] = []
        self.tconfig: Any = None
        self.optimizer: Any = None
        self.steps_done = 0
        self._said_sync_saves = False
        self.parameter_counts = ParameterCounts(0, 0)
        self.reference_weights: ReferenceWeights | None = None
        self._owns_process_group = False

    # --- set-up ---------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Process groups, model chunks with their weight shards, DDP and the optimizer."""
        require_megatron()
        self.ctx = ctx
        config = ctx.config
        _check_supported(config)
        self.device = resolve_device(config.backend.device)
        if self.device.type != "cuda":
            raise ReasonctlError(
                "backend.name = 'megatron' needs CUDA GPUs (megatron-core's schedules and "
                "gradient buffers are CUDA-only); use backend.name = 'single' or 'fsdp' on CPU"
            )
        torch.cuda.set_device(self.device)
        group = init_process_group(self.device)
        self._owns_process_group = group.created
        sizes = self.settings.sizes
        parallel.check_sizes(sizes, group.world_size)
        self.groups = parallel.initialize(sizes, seed=config.run.seed)
        self.rank, self.world_size = parallel.data_parallel_coordinates()
        self.is_main = group.rank == 0

        self.source = ensure_model_source(ctx)
        self.hf_config = load_hf_config(self.source.model_dir,
                                        trust_remote_code=config.model.trust_remote_code)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        dtype = compute_dtype(config.model.dtype, self.device)
        if dtype == torch.float16:
            raise ConfigError(["model.dtype: the megatron backend trains in bfloat16 or float32"])
        self.hf_skeleton = _hf_skeleton(self.source, config)
        self.parameter_counts = count_parameters(self.hf_skeleton)
        self._build_chunks(dtype, recompute=config.model.gradient_checkpointing)
        self._build_optimizer(dtype)
        ctx.info(
            f"model {config.model.name_or_path}: {self.parameter_counts.describe()}, megatron "
            f"tp={sizes.tp} pp={sizes.pp} vpp={sizes.vpp} dp={self.world_size} on "
            f"{group.world_size} GPU(s)"
        )

    def _build_chunks(self, dtype: torch.dtype, *, recompute: bool) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        assert self.source is not None and self.shape is not None
        sizes = self.settings.sizes
        tconfig = transformer_config(self.hf_config, sizes=sizes, dtype=dtype,
                                     recompute=recompute)
        tconfig.calculate_per_token_loss = True  # losses arrive globally normalised: sum grads
        reader = SafetensorsSource(self.source.model_dir)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=self.settings.use_distributed_optimizer,
        )
        for vpp_rank in range(sizes.vpp):
            layout = ParallelLayout(sizes.tp, self.groups.tp_rank, sizes.pp, self.groups.pp_rank,
                                    sizes.vpp, vpp_rank)
            layout.check(self.shape)
            chunk = build_gpt_model(
                self.hf_config, tconfig, pre_process=layout.is_first_stage,
                post_process=layout.is_last_stage, vp_stage=vpp_rank if sizes.vpp > 1 else None,
            )
            # every parameter on this GPU in the training dtype (the local spec builds its
            # torch norms on the CPU in float32), as megatron's optimizers expect
            chunk.to(device=self.device, dtype=dtype)
            load_chunk_weights(chunk, hf_to_megatron(reader, self.shape, layout))
            self.chunks.append(chunk)
            self.ddp_chunks.append(DistributedDataParallel(
                config=tconfig, ddp_config=ddp_config, module=chunk,
                disable_bucketing=vpp_rank > 0,
            ))
        no_sync = [c.no_sync for c in self.ddp_chunks]
        tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        tconfig.finalize_model_grads_func = _finalize_grads_summed
        self.tconfig = tconfig

    def _build_optimizer(self, dtype: torch.dtype) -> None:
        from megatron.core.optimizer import (
            OptimizerConfig,
            distrib_optimizer,
            get_megatron_optimizer,
        )

        if self.settings.use_distributed_optimizer and not getattr(
                distrib_optimizer, "HAVE_APEX_OR_TE", False):
            raise ConfigError([
                "backend.megatron.use_distributed_optimizer: without Transformer Engine or "
                "Apex, megatron-core falls back to torch's Adam, whose per-parameter step its "
                "DistributedOptimizer cannot restore from a checkpoint; set it to false (the "
                "optimizer state is then replicated over data-parallel ranks) or install "
                "Transformer Engine"
            ])
        train = self._ctx().config.train
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=train.lr,
            min_lr=train.lr * train.min_lr_ratio,
            weight_decay=train.weight_decay,
            adam_beta1=train.betas[0],
            adam_beta2=train.betas[1],
            adam_eps=train.adam_eps,
            clip_grad=train.max_grad_norm,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=self.settings.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.ddp_chunks)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss

    # --- forward and step -----------------------------------------------------------------

    def token_outputs(self, batch: dict[str, Any], *, with_entropy: bool = False,
                      temperature: float = 1.0) -> TokenLogprobs:
        """Per-token log-probs (and entropy) of ``batch``, without gradients, on every rank."""
        for chunk in self.ddp_chunks:
            chunk.eval()
        batch = self._shared([batch])[0]
        pieces = self._micro_batches([self._to_device(batch)])
        real = len(pieces)
        if self.settings.sizes.vpp > 1:  # the interleaved schedule wants >= pp micro-batches
            pieces += [pieces[0]] * max(0, self.settings.sizes.pp - real)
        with torch.no_grad():
            stored = self._schedule(pieces, None, with_entropy=with_entropy,
                                    temperature=temperature, forward_only=True)[:real]
        rows, length = batch["input_ids"].shape
        logprobs = torch.empty((rows, length - 1), dtype=torch.float32, device=self.device)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        if stored:  # last pipeline stage
            outputs = [item["outputs"] for item in stored]
            logprobs.copy_(torch.cat([o.logprobs for o in outputs]))
            if entropy is not None:
                entropy.copy_(torch.cat([o.entropy for o in outputs]))
        if self.groups.pp_size > 1:
            last = self.groups.pp_size - 1
            dist.broadcast(logprobs, group=self.groups.pp_group, group_src=last)
            if entropy is not None:
                dist.broadcast(entropy, group=self.groups.pp_group, group_src=last)
        return TokenLogprobs(logprobs, entropy)

    def build_reference_model(self) -> None:
        """Keep a frozen copy of this rank's weight shards as the KL reference policy
        (called by algorithms in ``setup``, before a resumed run loads its checkpoint)."""
        self.reference_weights = ReferenceWeights(
            lambda: (p for chunk in self.chunks for p in chunk.parameters()))

    def reference_token_outputs(self, batch: dict[str, Any], *, with_entropy: bool = False,
                                temperature: float = 1.0) -> TokenLogprobs:
        """:meth:`token_outputs` under the weights saved by :meth:`build_reference_model`.

        Only the model's (bf16 or fp32) parameters are swapped; the optimizer's float32
        main weights are untouched, and the parameters are restored exactly afterwards.
        """
        if self.reference_weights is None:
            raise RuntimeError("no reference model: call build_reference_model() first")
        with self.reference_weights.active():
            return self.token_outputs(batch, with_entropy=with_entropy, temperature=temperature)

    def train_step(self, micro_batches: Sequence[dict[str, Any]], loss_fn: LossFn, *,
                   with_entropy: bool = False, temperature: float = 1.0) -> Metrics:
        """One pipeline-schedule pass over the micro-batches, clip, one optimizer step.

        Metrics as the other backends: ``loss`` (sum of ``loss_fn`` losses over micro-batches
        and data-parallel ranks), ``grad_norm`` (before clipping), ``lr`` (of this step),
        ``loss_fn``'s metrics averaged over micro-batches and ranks, and
        ``skipped_update = 1`` when the gradient norm is not finite (weights unchanged).
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        optimizer = self._optimizer()
        for chunk in self.ddp_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        pieces = self._micro_batches([self._to_device(b) for b in self._shared(micro_batches)])
        sizes = self.settings.sizes
        if sizes.vpp > 1 and len(pieces) < sizes.pp:
            raise ReasonctlError(
                f"the interleaved pipeline (vpp = {sizes.vpp}) needs at least pp = {sizes.pp} "
                f"micro-batches per step, got {len(pieces)}; lower train.micro_batch_size or "
                "set backend.megatron.micro_batch_size"
            )
        self._set_lr()
        lr = float(optimizer.param_groups[0]["lr"])
        stored = self._schedule(pieces, loss_fn, with_entropy=with_entropy,
                                temperature=temperature, forward_only=False)
        grad_norm, finite = self._optimizer_step()
        local = self._step_metrics(stored, len(pieces))
        reduced = self.all_reduce_mean(local)
        reduced.update(grad_norm=grad_norm, lr=lr)
        if not finite:
            reduced["skipped_update"] = 1.0
        return reduced

    def _shared(self, inputs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batches of the first rank of this tensor/pipeline group, on every member.

        The ranks of one group must compute on identical data; algorithms give them the
        same data-parallel share, but sampled completions could still differ between
        GPUs, so the group's first rank decides.
        """
        sizes = self.settings.sizes
        if sizes.tp * sizes.pp == 1:
            return list(inputs)
        from megatron.core import parallel_state

        payload: list[Any] = [[{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                for k, v in batch.items()} for batch in inputs]]
        dist.broadcast_object_list(payload, group=parallel_state.get_model_parallel_group(),
                                   group_src=0)
        return payload[0]

    def _micro_batches(self, inputs: Sequence[dict[str, Any]]) -> list[_MicroBatch]:
        size = self.settings.micro_batch_size
        split = [piece for batch in inputs
                 for piece in (batches.split_rows(batch, size) if size else [batch])]
        sizes = self.settings.sizes
        rows = length = None
        if sizes.pp > 1:  # every micro-batch of a pipeline step has one tensor shape
            rows, length = batches.common_shape(split)
        return [_MicroBatch(batches.prepare(b, rows=rows, length=length), b)
                for b in split]

    def _schedule(self, items: list[_MicroBatch], loss_fn: LossFn | None, *,
                  with_entropy: bool, temperature: float, forward_only: bool
                  ) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows = max(item.prepared.shape[0] for item in items)
        length = max(item.prepared.shape[1] for item in items)
        compute_loss = functools.partial(self._loss, loss_fn=loss_fn, with_entropy=with_entropy,
                                         temperature=temperature)

        def forward_step(data_iterator: Iterator[_MicroBatch], model: torch.nn.Module
                         ) -> tuple[torch.Tensor, Any]:
            item = next(data_iterator)
            prepared = item.prepared
            output = model(prepared.tokens, prepared.position_ids, prepared.attention_mask)
            return output, functools.partial(compute_loss, item)

        several = len(self.ddp_chunks) > 1
        data = [iter(items) for _ in self.ddp_chunks] if several else iter(items)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.ddp_chunks if several else self.ddp_chunks[0],
            num_microbatches=len(items),
            seq_length=length,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _loss(self, item: _MicroBatch, logits: torch.Tensor, *, loss_fn: LossFn | None,
              with_entropy: bool, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Megatron's loss hook on the last stage: ``(loss, count, reported)``."""
        assert self.shape is not None
        prepared = item.prepared
        per_rank = self.shape.padded_vocab_size // self.groups.tp_size
        raw = vocab_parallel_logprobs(
            logits[:, :-1], prepared.tokens[:, 1:],
            vocab_start=self.groups.tp_rank * per_rank, vocab_size=self.shape.vocab_size,
            group=self.groups.tp_group, group_size=self.groups.tp_size,
            temperature=temperature, with_entropy=with_entropy,
        )
        outputs = TokenLogprobs(
            prepared.restore(raw.logprobs),
            prepared.restore(raw.entropy) if raw.entropy is not None else None,
        )
        count = torch.ones((), dtype=torch.int, device=self.device)
        if loss_fn is None:
            return logits.new_zeros(()), count, {"outputs": outputs}
        loss, metrics = loss_fn(outputs, item.batch)
        return loss, count, {"loss": float(loss.detach()),
                             "metrics": {k: float(v) for k, v in metrics.items()}}

    def _optimizer_step(self) -> tuple[float, bool]:
        """Gradient norm, clipping and the update; no update when the norm is not finite."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizer = self._optimizer()
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        finite = not found_inf and math.isfinite(grad_norm)
        if finite:
            clip = self._ctx().config.train.max_grad_norm
            if clip > 0:
                for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
                    params = sub.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, clip, grad_norm)
            optimizer.step_with_ready_grads()
        self.steps_done += 1
        return grad_norm, finite

    def _step_metrics(self, stored: list[dict[str, Any]], count: int) -> Metrics:
        """This data-parallel rank's loss sum and mean metrics, shared over its pipeline."""
        payload: list[Any] = [None]
        if stored:
            sums: dict[str, float] = {}
            for item in stored:
                for key, value in item["metrics"].items():
                    sums[key] = sums.get(key, 0.0) + value
            local = {k: v / count for k, v in sums.items()}
            local["loss"] = sum(item["loss"] for item in stored) * self.world_size
            payload = [local]
        if self.groups.pp_size > 1:
            dist.broadcast_object_list(payload, group=self.groups.pp_group,
                                       group_src=self.groups.pp_size - 1)
        return dict(payload[0])

    def _set_lr(self) -> None:
        train = self._ctx().config.train
        factor = lr_multiplier(
            self.steps_done,
            total_steps=self._ctx().total_steps,
            schedule=train.schedule,
            warmup_steps=train.warmup_steps,
            min_lr_ratio=train.min_lr_ratio,
        )
        for group in self._optimizer().param_groups:
            group["lr"] = train.lr * factor

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    # --- metrics and collectives ------------------------------------------------------------

    def all_reduce_mean(self, values: Metrics) -> Metrics:
        """Average scalar metrics over all processes (= over data-parallel ranks for values
        that the ranks of a tensor/pipeline group share)."""
        return mean_over_processes(values, self.device)

    def barrier(self) -> None:
        """Wait for all processes."""
        barrier_all()

    def training_flops(self, tokens: int, mean_seq_len: float) -> float:
        """Approximate model FLOPs of a training step over ``tokens`` tokens."""
        return training_flops(self.parameter_counts.total, self.hf_config, tokens, mean_seq_len)

    def peak_flops(self) -> float | None:
        """Peak bf16 FLOP/s of the GPUs one data-parallel rank spans (``tp x pp`` devices)."""
        peak = peak_flops(torch.cuda.get_device_name(self.device))
        sizes = self.settings.sizes
        return None if peak is None else peak * sizes.tp * sizes.pp

    def memory_metrics(self) -> Metrics:
        """``peak_mem_gb``: the most CUDA memory this process had allocated."""
        return {"peak_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9}

    # --- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, directory: Path, *, asynchronous: bool = False) -> None:
        """Write model, optimizer and step count with megatron dist_checkpointing.

        Always synchronous: ``asynchronous`` is accepted (``checkpoint.async_save``) and
        the state is on disk when this returns."""
        if asynchronous and not self._said_sync_saves and self.is_main:
            self._said_sync_saves = True
            self._ctx().info("checkpoint.async_save: the megatron backend writes "
                             "checkpoints synchronously")
        checkpoint.save_state(directory, self.chunks, self._optimizer(),
                              {"steps_done": self.steps_done})

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the state of :meth:`save_checkpoint` (any process count and tp/pp split)."""
        common = checkpoint.load_state(directory, self.chunks, self._optimizer())
        self.steps_done = int(common.get("steps_done", 0))

    # --- weights out ----------------------------------------------------------------------

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full tensors by Hugging Face name (collective: every rank iterates all).

        Tied output embeddings are yielded once, as ``model.embed_tokens.weight``.
        """
        assert self.shape is not None
        yield from stream_hf_weights(self.chunks, self.shape, self.groups, device=self.device)

    def export(self, directory: Path) -> None:
        """Write the Hugging Face layout of the ``fsdp`` backend on the main rank."""
        state: dict[str, torch.Tensor] = {}
        for name, tensor in self.full_state_dict():
            if self.is_main:
                state[name] = tensor.cpu()
        if self.is_main:
            assert self.source is not None and self.shape is not None
            if self.shape.tie_word_embeddings:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            name = self._ctx().config.checkpoint.export_dtype
            dtype = (checkpoint_dtype(self.hf_skeleton.config) if name == "auto"
                     else getattr(torch, name))
            save_hf_export(
                Path(directory), state, hf_model=self.hf_skeleton, source=self.source,
                dtype=dtype, tied_groups=tied_parameter_groups(self.hf_skeleton),
                max_shard_size=self.settings.export_shard_size, run_config=self._ctx().config,
            )
        self.barrier()

    def close(self) -> None:
        """Release the model, megatron's groups and, if created here, the process group."""
        self.chunks, self.ddp_chunks, self.optimizer = [], [], None
        self.reference_weights = None
        parallel.destroy()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    # --- helpers --------------------------------------------------------------------------

    def _ctx(self) -> RunContext:
        if self.ctx is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.ctx

    def _optimizer(self) -> Any:
        if self.optimizer is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.optimizer


def _finalize_grads_summed(model: list[torch.nn.Module], num_tokens: torch.Tensor | None,
                           **kwargs: Any) -> None:
    """megatron's gradient finalisation without dividing by the token count."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def _check_supported(config: Any) -> None:
    problems = []
    if config.model.freeze or config.model.trainable:
        problems.append("model.freeze / model.trainable: not supported by the megatron backend "
                        "(every parameter trains)")
    if config.train.compile:
        problems.append("train.compile: not supported by the megatron backend")
    if config.model.lora is not None:
        problems.append("model.lora: not supported by the megatron backend; train LoRA "
                        "adapters with backend.name = 'single' or 'fsdp'")
    if problems:
        raise ConfigError(problems)


def _hf_skeleton(source: ModelSource, config: Any) -> Any:
    """A weightless (meta) Hugging Face model: class, config and generation config to export."""
    from transformers import GenerationConfig

    skeleton = load_pretrained(source.model_dir, config.model, param_dtype=torch.float32,
                               on_meta=True)
    if (source.model_dir / "generation_config.json").is_file():
        skeleton.generation_config = GenerationConfig.from_pretrained(source.model_dir)
    return skeleton
