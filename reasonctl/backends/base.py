"""What the single-device and FSDP backends share: the step, checkpoints, export, metrics.

A concrete backend builds ``self.policy`` (a :class:`TokenLogprobModel` around the
Hugging Face model, sharded or not), ``self.optimizer`` and ``self.scheduler`` in
:meth:`TorchBackend.build`, and says how to gather full weights. Everything else, the
micro-batch loop, clipping, distributed checkpoints with torch DCP and the Hugging Face
export, is here.

A model directory that is a diffusers pipeline (``model_index.json``) makes the policy the
pipeline's diffusion transformer itself (:mod:`reasonctl.diffusion.policy`, described by
``self.diffusion``): algorithms then pass their own ``forward`` to :meth:`train_step` and
:meth:`run_forward`, ``[model.lora]`` adapts it as it adapts a language model (the same
:class:`~reasonctl.backends.lora.LoraState`), and the export is a pipeline directory or a
diffusers LoRA file (:mod:`reasonctl.diffusion.export`).

Checkpoint layout (``<step dir>/state``): a DCP checkpoint of ``{"model", "optimizer",
"scheduler"}`` where model and optimizer state come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (keyed by parameter name), so a
checkpoint written by N processes loads into M processes or into the single-device backend.
With ``[model.lora]`` (:mod:`reasonctl.backends.lora`) the model state holds only the
trainable tensors (adapters, modules to save): the frozen base comes from the model source.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from reasonctl.backends.dcp_load import load_state
from reasonctl.backends.distributed import barrier_all, mean_over_processes
from reasonctl.backends.export import DEFAULT_MAX_SHARD_SIZE, check_finite, save_hf_export
from reasonctl.backends.lora import AdaptersOff, LoraState, base_model_reference
from reasonctl.backends.optim import apply_train_settings
from reasonctl.backends.perf import peak_flops, training_flops
from reasonctl.backends.reference import ReferenceWeights
from reasonctl.backends.token_logprobs import TokenLogprobModel, TokenLogprobs
from reasonctl.core.protocols import ForwardFn, LossFn, RunContext
from reasonctl.core.types import Metrics
from reasonctl.models.loading import ModelSource, ParameterCounts, checkpoint_dtype

if TYPE_CHECKING:
    from reasonctl.diffusion.policy import DiffusionModelInfo


class TorchBackend:
    """Base of the PyTorch backends; subclasses implement :meth:`build` and the gathers."""

    rank: int = 0
    world_size: int = 1
    processes: int = 1
    """Processes of the job (``world_size`` counts the data-parallel ranks among them)."""
    is_main: bool = True
    device: torch.device = torch.device("cpu")

    def __init__(self, *, chunk_tokens: int, export_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
                 ) -> None:
        self.chunk_tokens = chunk_tokens
        self.export_shard_size = export_shard_size
        self.ctx: RunContext | None = None
        self.policy: TokenLogprobModel | torch.nn.Module | None = None
        self.hf_model: Any = None
        self.diffusion: DiffusionModelInfo | None = None
        """Set when the model is a diffusers pipeline's transformer (see the module doc)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.source: ModelSource | None = None
        self.parameter_counts = ParameterCounts(0, 0)
        self.tied_groups: list[list[str]] = []
        self.grad_scale = 1.0
        """Multiplier on each micro-batch loss that undoes data-parallel gradient averaging."""
        self.reference_weights: ReferenceWeights | AdaptersOff | None = None
        """Frozen copy of the starting weights (see :meth:`build_reference_model`)."""
        self.lora: LoraState | None = None
        """The adapters, with ``[model.lora]`` (set by :meth:`build`)."""
        self.generation_model: torch.nn.Module | None = None
        """The module a colocated rollout engine may call directly (see ``Backend``)."""
        self._checkpoint_group: Any = None
        """The gloo group background checkpoint writes coordinate over (created on first
        use), so that they never interleave with the training's collectives."""

    # --- set-up ---------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Build the model, optimizer and schedule (see :meth:`build`)."""
        self.ctx = ctx
        self.build(ctx)
        data = (f" ({self.world_size} data-parallel)" if self.world_size != self.processes
                else "")
        ctx.info(f"model {ctx.config.model.name_or_path}: {self.parameter_counts.describe()} "
                 f"on {self.device} x{self.processes}{data}")

    def build(self, ctx: RunContext) -> None:
        """Create ``policy``, ``hf_model``, ``optimizer``, ``scheduler`` and ``source``."""
        raise NotImplementedError

    def load_diffusion_transformer(self, ctx: RunContext, *, param_dtype: torch.dtype,
                                   device: torch.device | str, on_meta: bool = False,
                                   trainable_dtype: torch.dtype | None = None
                                   ) -> torch.nn.Module:
        """Load the pipeline's transformer in ``param_dtype`` and make it trainable: LoRA
        adapters (in ``trainable_dtype``, default ``param_dtype``) with ``[model.lora]``
        (sets ``lora``), else the ``model.freeze``/``model.trainable`` patterns; sets
        ``diffusion`` and the parameter counts."""
        from reasonctl.diffusion.policy import load_transformer, model_info, prepare_trainable

        assert self.source is not None
        config = ctx.config
        self.diffusion = model_info(self.source.model_dir)
        model = load_transformer(self.source.model_dir, dtype=param_dtype, device=device,
                                 on_meta=on_meta)
        self.parameter_counts, self.lora = prepare_trainable(
            model, config.model, seed=config.run.seed,
            trainable_dtype=trainable_dtype or param_dtype)
        return model

    # --- forward and step -----------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of forward passes (none by default)."""
        return contextlib.nullcontext()

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with every tensor on this backend's device."""
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }

    def token_outputs(self, batch: dict[str, Any], *, with_entropy: bool = False,
                      temperature: float = 1.0) -> TokenLogprobs:
        """Per-token log-probs (and entropy) of ``batch`` in eval mode without gradients."""
        self._require_language_model("token_outputs")
        policy = self._policy()
        policy.eval()
        with torch.no_grad(), self.autocast():
            return TokenLogprobs(*policy(self.to_device(batch), with_entropy, temperature))

    def run_forward(self, fn: ForwardFn, batch: Any, *, reference: bool = False) -> Any:
        """``fn(model, batch)`` in eval mode without gradients under :meth:`autocast`
        (``reference=True``: under the weights of :meth:`build_reference_model`).

        Under FSDP every rank must call it the same number of times (the sharded blocks
        gather their weights collectively).
        """
        policy = self._policy()
        policy.eval()
        if isinstance(batch, dict):
            batch = self.to_device(batch)
        if reference and self.reference_weights is None:
            raise RuntimeError("no reference model: call build_reference_model() first")
        swap = self.reference_weights.active() if reference else contextlib.nullcontext()
        with swap, torch.no_grad(), self.autocast():  # type: ignore[union-attr]
            return fn(policy, batch)

    def shared_prompt_problem(self) -> str | None:
        """Why shared-prompt batches cannot run (``None`` when they can; see
        :class:`~reasonctl.core.protocols.RunsSharedPrompts`)."""
        from reasonctl.models.shared_prompt_attention import shared_prompt_problem

        if self.diffusion is not None or not isinstance(self.policy, TokenLogprobModel):
            return "the model is not a language model"
        if self.policy.context_parallel is not None:
            return "context parallelism (backend.fsdp.cp > 1) splits every row"
        return shared_prompt_problem(self.hf_model)

    # --- reference policy (KL penalties) ---------------------------------------------------

    def build_reference_model(self) -> None:
        """Keep a frozen copy of the current weights as the reference policy of a KL penalty.

        Algorithms call it in ``setup``, before a resumed run loads its checkpoint, so the
        reference is the starting model. The copy has the policy's layout (sharded under
        FSDP) and costs one more set of parameters, no optimizer state. With LoRA (language
        model or diffusion transformer) the reference is the base model, i.e. the policy with
        its adapters off: no copy.
        """
        if self.lora is not None:
            self.reference_weights = AdaptersOff(self.lora)
            return
        self.reference_weights = ReferenceWeights(lambda: self._policy().parameters(),
                                                  before_swap=self._reshard)

    def reference_token_outputs(self, batch: dict[str, Any], *, with_entropy: bool = False,
                                temperature: float = 1.0) -> TokenLogprobs:
        """:meth:`token_outputs` under the weights saved by :meth:`build_reference_model`
        (swapped into the policy's parameters for this call, one at a time)."""
        if self.reference_weights is None:
            raise RuntimeError("no reference model: call build_reference_model() first")
        with self.reference_weights.active():
            return self.token_outputs(batch, with_entropy=with_entropy, temperature=temperature)

    def train_step(self, micro_batches: Sequence[dict[str, Any]], loss_fn: LossFn, *,
                   with_entropy: bool = False, temperature: float = 1.0,
                   forward: ForwardFn | None = None) -> Metrics:
        """Forward/backward each micro-batch, clip, then one optimizer and schedule step.

        Metrics: ``loss`` (the sum of ``loss_fn``'s losses over micro-batches and ranks, i.e.
        the objective of this step when the losses are normalised globally), ``grad_norm``
        (before clipping), ``lr`` (used by this step), and ``loss_fn``'s own metrics averaged
        over micro-batches and ranks. A step whose gradient norm is not finite leaves the
        weights unchanged and reports ``skipped_update = 1``. With ``forward`` the loss
        function receives ``forward(model, micro_batch)`` instead of token log-probs.
        """
        if forward is None:
            self._require_language_model("train_step without a forward function")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        policy, optimizer, scheduler = self._policy(), self._optimizer(), self._scheduler()
        policy.train()
        lr = float(optimizer.param_groups[0]["lr"])
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, Any] = {}
        for index, micro_batch in enumerate(micro_batches):
            self._before_micro_batch(last=index == len(micro_batches) - 1)
            batch = self.to_device(micro_batch)
            with self.autocast():
                if forward is None:
                    outputs = TokenLogprobs(*policy(batch, with_entropy, temperature))
                else:
                    outputs = forward(policy, batch)
            loss, metrics = loss_fn(outputs, batch)
            (loss * self.grad_scale).backward()
            loss_total += loss.detach().to(torch.float64)
            for key, value in metrics.items():  # tensors stay on the device until the end
                value = value.detach() if isinstance(value, torch.Tensor) else value
                metric_sums[key] = metric_sums.get(key, 0.0) + value
        grad_norm = self.clip_gradients()
        finite = torch.isfinite(grad_norm)
        skips_on_device = _skips_on_device(optimizer)
        if skips_on_device:  # the fused step skips itself when found_inf is set: no host sync
            optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
            optimizer.step()
            del optimizer.found_inf  # type: ignore[attr-defined]
        elif bool(finite):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        # one host read per step for everything the metrics need
        keys = list(metric_sums)
        values = torch.stack(
            [loss_total.float(), grad_norm.detach().float().to(loss_total.device),
             finite.float().to(loss_total.device)]
            + [torch.as_tensor(metric_sums[k], dtype=torch.float32, device=loss_total.device)
               for k in keys]
        ).tolist()
        loss_value, norm_value, finite_value = values[:3]
        count = len(micro_batches)
        local = {k: v / count for k, v in zip(keys, values[3:], strict=True)}
        local["loss"] = loss_value * self.world_size  # the mean over ranks = sum / world
        reduced = self.all_reduce_mean(local)
        reduced.update(grad_norm=norm_value, lr=lr)
        if not finite_value:
            reduced["skipped_update"] = 1.0
        return reduced

    def clip_gradients(self) -> torch.Tensor:
        """Total gradient norm before clipping; clips to ``train.max_grad_norm`` when > 0."""
        params = [p for p in self._policy().parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        # DTensor gradients (FSDP, tensor parallel) on different meshes are handled per mesh
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for param in params:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in by_mesh.values():
            part = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
            if hasattr(part, "full_tensor"):
                part = part.full_tensor()
            squares = squares + part.float().pow(2)
        norm = squares.sqrt()
        max_norm = self._ctx().config.train.max_grad_norm
        if max_norm > 0:  # a non-finite norm skips the whole step, so clipping it is harmless
            for group in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
        return norm

    # --- metrics and collectives ------------------------------------------------------------

    def all_reduce_mean(self, values: Metrics) -> Metrics:
        """Average scalar metrics over data-parallel ranks (every rank must pass the same
        keys; tensor-parallel peers hold equal values)."""
        return mean_over_processes(values, self.device)

    def barrier(self) -> None:
        """Wait for every process (no-op in one process)."""
        barrier_all()

    def training_flops(self, tokens: int, mean_seq_len: float) -> float:
        """Approximate model FLOPs of a training step over ``tokens`` tokens (with LoRA the
        frozen base costs 4 FLOPs per parameter and token, no weight gradients)."""
        counts = self.parameter_counts
        params = float(counts.total)
        if self.lora is not None:
            params = counts.trainable + (counts.total - counts.trainable) * 2 / 3
        return training_flops(int(params), self.hf_model.config, tokens, mean_seq_len)

    def peak_flops(self) -> float | None:
        """Peak bf16 FLOP/s of one device of this backend (``None`` on CPU or unknown)."""
        if self.device.type != "cuda":
            return None
        return peak_flops(torch.cuda.get_device_name(self.device))

    def memory_metrics(self) -> Metrics:
        """On CUDA ``peak_mem_gb`` (max allocated since start) and ``mem_allocated_gb``
        (allocated now, at the step's end: what a leak grows); empty elsewhere."""
        if self.device.type != "cuda":
            return {}
        return {"peak_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9,
                "mem_allocated_gb": torch.cuda.memory_allocated(self.device) / 1e9}

    # --- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, directory: Path, *, asynchronous: bool = False
                        ) -> Future[Any] | None:
        """Write model, optimizer and schedule state with torch DCP (all ranks call it).

        With ``asynchronous`` the state is copied to host memory now and written by a
        background thread (``dcp.async_save``); the returned future completes when it is
        on disk.
        """
        self._reshard()
        model_state, optim_state = self._checkpoint_state()
        state = {"model": model_state, "optimizer": optim_state,
                 "scheduler": self._scheduler().state_dict()}
        distributed = dist.is_initialized()
        if asynchronous:
            if distributed and self._checkpoint_group is None:
                self._checkpoint_group = dist.new_group(backend="gloo")
            if not distributed:  # the notice comes from the writing thread, later
                warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_NOTICE)
            return dcp.async_save(state, checkpoint_id=str(directory),
                                  process_group=self._checkpoint_group, no_dist=not distributed)
        with _single_process_dcp_quiet():
            dcp.save(state, checkpoint_id=str(directory), no_dist=not distributed)
        return None

    def load_checkpoint(self, directory: Path) -> None:
        """Restore state from :meth:`save_checkpoint` (written by any number of ranks).

        Nothing in the checkpoint runs code (:mod:`reasonctl.backends.dcp_load`); tensors
        that do not fit the model are named. The optimizer then takes ``[train]``'s
        hyperparameters, so a resume with changed settings applies them."""
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"checkpoint state directory {directory} does not exist")
        self._reshard()
        policy, optimizer, scheduler = self._policy(), self._optimizer(), self._scheduler()
        model_state, optim_state = self._checkpoint_state()
        state = {"model": model_state, "optimizer": optim_state,
                 "scheduler": scheduler.state_dict()}
        with _single_process_dcp_quiet():
            load_state(state, Path(directory))
        set_state_dict(policy, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=self._state_options(load=True))
        scheduler.load_state_dict(state["scheduler"])
        apply_train_settings(optimizer, scheduler, self._ctx().config.train)

    # --- weights out ----------------------------------------------------------------------

    def export(self, directory: Path) -> None:
        """Write a Hugging Face model directory on the main rank (all ranks call it).

        With LoRA: the merged model, or with ``model.lora.export = "adapter"`` a peft
        adapter directory. A diffusion transformer is written as a pipeline directory (LoRA
        merged), or with ``export = "adapter"`` as a diffusers LoRA file
        (:mod:`reasonctl.diffusion.export`).
        """
        if self.diffusion is not None:
            self._export_diffusion(Path(directory))
            return
        state = self.gather_full_state_dict()
        try:
            if self.is_main:
                ctx = self._ctx()
                assert self.source is not None
                dtype = self.export_dtype(ctx.config.checkpoint.export_dtype)
                if self.lora is not None and self.lora.section.export == "adapter":
                    check_finite(state)  # the merged export checks in save_hf_export
                    self.lora.save_adapter(
                        Path(directory), state, dtype=dtype, source=self.source,
                        base_model=base_model_reference(ctx.config.model.name_or_path,
                                                        self.source),
                    )
                else:
                    if self.lora is not None:
                        state = dict(self.lora.merged(state.items()))
                    save_hf_export(
                        Path(directory), state, hf_model=self.hf_model, source=self.source,
                        dtype=dtype, tied_groups=self.tied_groups,
                        max_shard_size=self.export_shard_size, run_config=ctx.config,
                    )
        finally:  # the other ranks wait here even when the main rank's write fails
            self.barrier()

    def _export_diffusion(self, directory: Path) -> None:
        from reasonctl.diffusion.export import save_lora_export, save_pipeline_export

        info = self.diffusion
        assert info is not None
        adapter = self.lora is not None and self.lora.section.export == "adapter"
        state = self.gather_full_state_dict(trainable_only=adapter)
        try:
            if self.is_main:
                check_finite(state)
                dtype = self.export_dtype(self._ctx().config.checkpoint.export_dtype)
                if adapter:
                    assert self.lora is not None
                    save_lora_export(directory, state, model=self.hf_model, info=info,
                                     dtype=dtype, lora=self.lora.section.model_dump())
                else:
                    if self.lora is not None:
                        state = dict(self.lora.merged(state.items()))
                    save_pipeline_export(directory, state, info=info, dtype=dtype,
                                         max_shard_size=self.export_shard_size)
        finally:  # the other ranks wait here even when the main rank's write fails
            self.barrier()

    def export_dtype(self, name: str) -> torch.dtype:
        """``auto`` keeps the dtype the source checkpoint declares; else the named dtype."""
        if name == "auto":
            if self.diffusion is not None:
                from reasonctl.diffusion.export import source_weights_dtype

                return source_weights_dtype(self.diffusion.model_dir)
            return checkpoint_dtype(self.hf_model.config)
        return getattr(torch, name)

    def gather_full_state_dict(self, *, trainable_only: bool = False
                               ) -> dict[str, torch.Tensor]:
        """Full CPU tensors of the model's own state on the main rank (empty on others);
        with LoRA the names are the adapted model's (see :mod:`reasonctl.backends.lora`).
        ``trainable_only`` keeps the parameters that train (e.g. the adapters)."""
        raise NotImplementedError

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full parameters and buffers by Hugging Face name (all ranks iterate).

        With LoRA these are the merged model's tensors.
        """
        if self.lora is not None:
            return self.lora.merged(self._full_tensors())
        return self._full_tensors()

    def changed_state_dict(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Only the tensors that differ from the source model, by Hugging Face name, or
        ``None`` when any may differ (full-weight training).

        With LoRA: the merged weights of the adapted layers (computed from the adapters)
        and the modules trained in full. All ranks iterate to the end.
        """
        if self.lora is None:
            return None
        self._reshard()
        return self.lora.changed(_full_tensor)

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the model's own full tensors by name (all ranks iterate)."""
        raise NotImplementedError

    def _state_options(self, *, load: bool = False) -> StateDictOptions | None:
        """With LoRA checkpoints hold only trainable state (the base is not saved; on load
        the frozen weights are absent, while ``dcp.load`` has checked the trainable ones)."""
        if self.lora is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=not load)

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state as checkpoints hold them (DCP-ready, by name)."""
        policy = self._policy()
        model_state, optim_state = get_state_dict(policy, self._optimizer(),
                                                  options=self._state_options())
        if self.lora is not None:  # tied aliases of frozen weights are frozen too
            trainable = {n for n, p in policy.named_parameters(remove_duplicate=False)
                         if p.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k in trainable}
        return model_state, optim_state

    def close(self) -> None:
        """Release the model and optimizer."""
        self._checkpoint_group = None  # destroyed with the default group
        self.policy = self.hf_model = self.generation_model = None
        self.optimizer = self.scheduler = None
        self.reference_weights = None
        self.lora = None

    # --- helpers --------------------------------------------------------------------------

    def _reshard(self) -> None:
        """Hook for sharded backends to put parameters back in sharded form."""

    def _before_micro_batch(self, *, last: bool) -> None:
        """Hook called before each micro-batch of :meth:`train_step` (``last``: the step's
        final one), e.g. to reduce gradients over ranks only once per step."""

    def _require_language_model(self, what: str) -> None:
        if self.diffusion is not None:
            raise TypeError(
                f"{what}: the model is the diffusion transformer of {self.diffusion.model_dir}; "
                "pass a forward function (train_step(..., forward=...), run_forward)"
            )

    def _ctx(self) -> RunContext:
        if self.ctx is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.ctx

    def _policy(self) -> Any:
        if self.policy is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.policy

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.optimizer

    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        if self.scheduler is None:
            raise RuntimeError("the backend is not set up; call setup(ctx) first")
        return self.scheduler


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor (a collective for a sharded one)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


_NO_PROCESS_GROUP_NOTICE = r"torch\.distributed is (disabled|unavailable)"


@contextlib.contextmanager
def _single_process_dcp_quiet() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group (intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP_NOTICE)
        yield


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a fused CUDA optimizer that honours ``found_inf`` (as for
    gradient scaling), so a non-finite step can be skipped without reading the norm."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused", False) for group in optimizer.param_groups
    )
