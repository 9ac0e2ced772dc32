"""FSDP2 / HSDP backend: parameters, gradients and optimizer state sharded over ranks.

Composition, in torchtitan's order: build the model (real weights on rank 0, on the meta
device elsewhere) -> freeze patterns, or LoRA adapters with ``[model.lora]`` (the frozen
base is sharded like any weight; checkpoints hold only the adapters) -> activation
checkpointing -> ``train.compile`` of each block's training forward
(:mod:`reasonctl.backends.compile`) -> ``fully_shard`` each transformer block (the
classes in the model's ``_no_split_modules``) and then the root
(embeddings, final norm, output projection, vision merger) -> allocate the shards ->
broadcast the weights from rank 0 into them.

The device mesh is ``dp_shard`` (FSDP) or ``dp_replicate x dp_shard`` (HSDP: replicas of a
sharded group, e.g. one replica per node), then a ``cp`` dimension when
``backend.fsdp.cp > 1`` and a trailing ``tp`` dimension when ``backend.fsdp.tp > 1``.

With ``cp`` every sequence is split over the ``cp`` ranks
(:mod:`reasonctl.backends.context_parallel`: load-balanced chunks, keys and values
gathered in each attention layer, log-probs gathered for the loss); FSDP shards over
``dp_shard x cp`` flattened (as torchtitan does), so the ``cp`` ranks also share the
parameters, and the gradient reduction adds their contributions.

With ``tp`` the query/key/value, gate and up projections of every decoder block are split
by output features and the output and down projections by input features over the ``tp``
ranks (DTensor tensor parallelism, applied before FSDP), so each rank holds
``heads / tp`` attention heads. Embeddings, norms and the output head stay whole on each
tensor-parallel rank.

Precision and speed (``[backend.fsdp]``): ``param_dtype = "float32"`` (the default, as for
the single backend) keeps float32 shards and optimizer state and computes in
``model.dtype``; ``"compute"`` keeps the shards, gradients and optimizer state in
``model.dtype`` itself (half the memory and traffic, no casts; small updates can round
away in bfloat16). Gradients are reduced in float32 unless ``reduce_dtype = "compute"``.
Each block's all-gather is issued ``prefetch`` blocks ahead in forward and backward.
``reshard_after_forward``: ``"default"`` frees each block's gathered weights after its
forward except the last block's (backward needs them at once); ``"always"`` frees every
block's; ``"never"`` keeps every block gathered from forward to backward, as ZeRO-2 (no
all-gathers in backward, at the memory of a whole unsharded model per rank; a forward
without backward, e.g. log-probs under ``no_grad``, leaves them gathered until the next
backward or weight read).
``gradient_sync = "last_micro_batch"`` reduces gradients once per step instead of after
every micro-batch (unsharded gradients are kept meanwhile: more memory).

A diffusers pipeline directory trains its diffusion transformer the same way (its
``_no_split_modules`` blocks sharded, the transformer itself the root; no ``tp``), with
LoRA adapters with ``[model.lora]`` (:mod:`reasonctl.diffusion.policy`); with ``cp`` its
latent tokens are split (:mod:`reasonctl.diffusion.context_parallel`).

Ranks: ``rank`` / ``world_size`` are the **data-parallel** coordinates (algorithms split
data by them; the ranks of one context- or tensor-parallel group get the same share, and
each batch is taken from the group's first rank), ``is_main`` is global rank 0.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from reasonctl.backends.base import TorchBackend
from reasonctl.backends.compile import compile_blocks
from reasonctl.backends.context_parallel import enable_context_parallel
from reasonctl.backends.distributed import init_process_group, run_device
from reasonctl.backends.export import tied_parameter_groups
from reasonctl.backends.layout import fsdp_layout_problems
from reasonctl.backends.lora import LoraState
from reasonctl.backends.optim import build_optimizer, build_scheduler
from reasonctl.backends.tensor_parallel import parallelize_blocks
from reasonctl.backends.token_logprobs import TokenLogprobModel
from reasonctl.core.errors import ConfigError, ReasonctlError
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

POLICY_PREFIX = "hf_model."
"""Prefix of the Hugging Face model's names inside :class:`TokenLogprobModel`."""


class FSDPBackend(TorchBackend):
    """Fully sharded data parallel training over the processes of one launch."""

    def __init__(self, *, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, cp: int = 1,
                 reshard_after_forward: Literal["default", "always", "never"] = "default",
                 param_dtype: Literal["float32", "compute"] = "float32",
                 reduce_dtype: Literal["float32", "compute"] = "float32",
                 prefetch: int = 1,
                 gradient_sync: Literal["every_micro_batch", "last_micro_batch"]
                 = "every_micro_batch",
                 chunk_tokens: int, export_shard_size: str) -> None:
        super().__init__(chunk_tokens=chunk_tokens, export_shard_size=export_shard_size)
        self.param_dtype_mode = param_dtype
        self.reduce_dtype_mode = reduce_dtype
        self.prefetch = prefetch
        self.gradient_sync = gradient_sync
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.tp = tp
        self.cp = cp
        self.reshard_after_forward = reshard_after_forward
        self.mesh: DeviceMesh | None = None
        self._flattened: dict[str, DeviceMesh] = {}
        """Flattened mesh dimensions (``dp_shard_cp``, ``cp_tp``) as created."""
        self.processes = 1
        """Processes of the job (data-parallel x context-parallel x tensor-parallel)."""
        self._owns_process_group = False

    # --- set-up ---------------------------------------------------------------------------

    def build(self, ctx: RunContext) -> None:
        """Join the process group, build the mesh, shard the model, create AdamW."""
        config = ctx.config
        self.device = run_device(config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group = init_process_group(self.device)
        self._owns_process_group = group.created
        self.processes = group.world_size
        self.is_main = group.rank == 0
        self.mesh = self._build_mesh()
        data_mesh = self._data_mesh()
        self.world_size = data_mesh.size()
        self.rank = data_mesh.get_local_rank(0)
        if data_mesh.ndim == 2:  # HSDP: replica-major
            self.rank = self.rank * data_mesh.size(1) + data_mesh.get_local_rank(1)
        if data_mesh.ndim == 2 and self.is_main:
            ctx.info(f"fsdp: HSDP, {data_mesh.size(0)} replicas (dp_replicate) x "
                     f"{data_mesh.size(1)} shards (dp_shard); gradients reduce-scattered "
                     "within a replica, then all-reduced across replicas")
        # FSDP averages gradients over dp x cp; the cp ranks' parts of one sequence add up
        self.grad_scale = float(self.world_size * self.cp)

        # rank 0 resolves first (creates the tiny model, downloads remote weights) so the
        # other ranks find a finished local directory
        if self.is_main:
            self.source = ensure_model_source(ctx)
        dist.barrier()
        self.source = ensure_model_source(ctx)
        on_meta = self.rank != 0
        dtype = compute_dtype(config.model.dtype, self.device)
        param_dtype = torch.float32 if self.param_dtype_mode == "float32" else dtype
        if is_pipeline_dir(self.source.model_dir):
            self._build_diffusion(ctx, on_meta, param_dtype)
            return
        hf_model = load_pretrained(self.source.model_dir, config.model,
                                   param_dtype=param_dtype, device="cpu", on_meta=on_meta)
        self.tied_groups = tied_parameter_groups(hf_model)
        if config.model.lora is not None:
            if self.tp > 1:
                raise ConfigError([
                    "backend.fsdp.tp: tensor parallelism does not split LoRA layers; use "
                    "tp = 1 with [model.lora] (the frozen base is sharded by FSDP)"
                ])
            self.lora = LoraState.attach(hf_model, config.model.lora, seed=config.run.seed,
                                         trainable_dtype=param_dtype)
            self.parameter_counts = count_parameters(hf_model)
        else:
            self.parameter_counts = apply_trainable_patterns(
                hf_model, freeze=config.model.freeze, trainable=config.model.trainable
            )
        full_state = {} if on_meta else {
            POLICY_PREFIX + k: v for k, v in hf_model.state_dict().items()
        }
        if self.tp > 1:
            # DTensor notes every two-dimensional gather or norm as "suboptimal" (it takes
            # one collective per mesh dimension) at warning level, on every rank
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
            blocks = parallelize_blocks(hf_model, self.mesh["tp"])
            if self.is_main:
                ctx.info(f"fsdp: {blocks} blocks split over tp={self.tp}; data parallel over "
                         f"{self.world_size} group(s) of {self.tp} processes")
        context_parallel = None
        if self.cp > 1:
            context_parallel = enable_context_parallel(hf_model, self.mesh["cp"].get_group())
            if self.is_main:
                ctx.info(f"fsdp: sequences split over cp={self.cp} ranks; data parallel over "
                         f"{self.world_size} group(s)")
        if config.model.gradient_checkpointing:
            enable_gradient_checkpointing(hf_model)
        if config.train.compile:
            compile_blocks(hf_model)
        self.hf_model = hf_model
        self.policy = TokenLogprobModel(hf_model, chunk_tokens=self.chunk_tokens)
        self.policy.context_parallel = context_parallel
        self._shard(self.policy, dtype)
        if on_meta:
            self.policy.to_empty(device=self.device)
        set_model_state_dict(
            self.policy, full_state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        del full_state
        for buffer in self.policy.buffers():  # e.g. rotary frequencies (not in state dicts)
            dist.broadcast(buffer, src=0)
        self.optimizer = build_optimizer(self.policy.named_parameters(), config.train,
                                         device=self.device)
        self.scheduler = build_scheduler(self.optimizer, config.train, lambda: ctx.total_steps)

    def _build_diffusion(self, ctx: RunContext, on_meta: bool, param_dtype: torch.dtype
                         ) -> None:
        """Shard a pipeline's diffusion transformer (the root) block by block."""
        config = ctx.config
        if self.tp > 1:
            raise ConfigError([
                f"backend.fsdp.tp: {self.tp} splits language-model decoder blocks; a diffusion "
                "transformer is sharded with FSDP only, set tp = 1"
            ])
        model = self.load_diffusion_transformer(ctx, param_dtype=param_dtype, device="cpu",
                                                on_meta=on_meta)
        if self.cp > 1:
            from reasonctl.diffusion.context_parallel import enable_diffusion_context_parallel

            enable_diffusion_context_parallel(model, self.mesh["cp"].get_group(),
                                              compile=config.train.compile)
            if self.is_main:
                ctx.info(f"fsdp: latent tokens split over cp={self.cp} ranks; data parallel "
                         f"over {self.world_size} group(s)")
        full_state = {} if on_meta else dict(model.state_dict())
        if config.train.compile:  # denoising steps have fixed shapes: sampling compiles too
            compile_blocks(model, without_grad=True)
        self.hf_model = self.policy = model
        self._shard(model, compute_dtype(config.model.dtype, self.device))
        if on_meta:
            model.to_empty(device=self.device)
        set_model_state_dict(
            model, full_state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                     strict=True),
        )
        del full_state
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        self.optimizer = build_optimizer(model.named_parameters(), config.train,
                                         device=self.device)
        self.scheduler = build_scheduler(self.optimizer, config.train, lambda: ctx.total_steps)

    def _build_mesh(self) -> DeviceMesh:
        replicate, tp, cp = self.dp_replicate, self.tp, self.cp
        problems = fsdp_layout_problems(self.processes, dp_replicate=replicate,
                                        dp_shard=self.dp_shard, cp=cp, tp=tp)
        if problems:
            raise ConfigError(problems)
        data = self.processes // (tp * cp)
        shard = self.dp_shard if self.dp_shard > 0 else data // replicate
        sizes, names = [shard], ["dp_shard"]
        if replicate > 1:
            sizes, names = [replicate, shard], ["dp_replicate", "dp_shard"]
        for key, value in (("cp", cp), ("tp", tp)):
            if value > 1:
                sizes, names = [*sizes, value], [*names, key]
        mesh = init_device_mesh(self.device.type, tuple(sizes), mesh_dim_names=tuple(names))
        if cp > 1:  # FSDP shards over dp_shard x cp (the cp ranks share parameters)
            self._flattened["dp_shard_cp"] = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
            if tp > 1:  # the group a batch is shared over
                self._flattened["cp_tp"] = mesh[("cp", "tp")]._flatten("cp_tp")
        return mesh

    # --- batches ------------------------------------------------------------------------

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch on this device; with ``cp > 1`` or ``tp > 1`` the context/tensor-parallel
        group's first rank's batch on every member (they must compute on identical data)."""
        shared_over = [name for name, size in (("cp", self.cp), ("tp", self.tp)) if size > 1]
        if shared_over:
            assert self.mesh is not None
            name = "cp_tp" if len(shared_over) == 2 else shared_over[0]
            group = self._submesh([name]).get_group()
            shared = [batch]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
            batch = shared[0]
        return super().to_device(batch)

    def _data_mesh(self) -> DeviceMesh:
        """The data-parallel mesh (``dp_replicate x dp_shard``): what ranks split data by."""
        return self._submesh([n for n in ("dp_replicate", "dp_shard") if self._has_dim(n)])

    def _shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards (and replicates) over: ``dp_replicate x dp_shard[_cp]``."""
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        return self._submesh([n for n in ("dp_replicate", shard) if n == shard
                              or self._has_dim(n)])

    def _has_dim(self, name: str) -> bool:
        assert self.mesh is not None
        return name in (self.mesh.mesh_dim_names or ())

    def _submesh(self, names: list[str]) -> DeviceMesh:
        assert self.mesh is not None
        if len(names) == 1 and names[0] in self._flattened:  # kept: torch deprecates
            return self._flattened[names[0]]                  # slicing them from the root
        return self.mesh[tuple(names)] if len(names) > 1 else self.mesh[names[0]]

    def _shard(self, policy: torch.nn.Module, dtype: torch.dtype) -> None:
        """``fully_shard`` every transformer block (innermost first), then the root."""
        hf_model = self.hf_model
        block_names = set(getattr(hf_model, "_no_split_modules", None) or [])
        blocks = [m for m in hf_model.modules() if type(m).__name__ in block_names]
        if not blocks:
            raise ReasonctlError(
                f"{type(hf_model).__name__} declares no transformer block classes "
                "(_no_split_modules), so FSDP cannot shard it block by block; use the "
                "single backend"
            )
        # gathers in the compute dtype (no cast when the shards hold it), reduces in float32
        # or, with reduce_dtype = "compute", in the compute dtype
        reduce_dtype = dtype if self.reduce_dtype_mode == "compute" else torch.float32
        if dtype == torch.float32:
            policy_mp = MixedPrecisionPolicy()
        else:
            policy_mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
        options = {"mesh": self._shard_mesh(), "mp_policy": policy_mp}
        if self.diffusion is not None and dtype != torch.float32:
            # FSDP casts a block's floating inputs (a diffusion transformer passes float32
            # rotary tables and modulation) in its pre-forward hook, which it skips when
            # gradient checkpointing recomputes the block in backward; this plain hook casts
            # them on every call, so the recomputation sees the forward's dtypes.
            for block in blocks:
                block.register_forward_pre_hook(partial(_cast_floating_inputs, dtype),
                                                with_kwargs=True)
        for block in reversed(blocks):
            fully_shard(block, reshard_after_forward=self._reshards_after_forward(
                block is blocks[-1]), **options)
        _set_prefetch(hf_model, blocks, self.prefetch)
        # The root group holds the embedding and (tied) output head. Backward needs them right
        # after forward, and the log-prob op recomputes the head's logits chunk by chunk in
        # backward, so resharding the root after forward only frees memory that is gathered
        # again at once -- and leaves that recomputation reading a freed weight.
        if self.diffusion is not None and dtype != torch.float32:
            # a diffusion transformer's inputs are cast by its adapter, and its timestep
            # (sigma or sigma x 1000) must reach the sinusoidal embedding in float32
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        fully_shard(policy, reshard_after_forward=False, **options)

    def _reshards_after_forward(self, last: bool) -> bool:
        """Whether a block frees its gathered weights after forward. By default every block
        but the last does: backward starts with the last block, so resharding it would only
        free weights that are gathered again at once."""
        if self.reshard_after_forward == "default":
            return not last
        return self.reshard_after_forward == "always"

    # --- weights out ----------------------------------------------------------------------

    def gather_full_state_dict(self, *, trainable_only: bool = False
                               ) -> dict[str, torch.Tensor]:
        """Gather full CPU tensors to rank 0 (collective; other ranks get ``{}``);
        ``trainable_only`` keeps the parameters that train."""
        self._reshard()
        state = get_model_state_dict(
            self._policy(), options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                     ignore_frozen_params=trainable_only)
        )
        return {k.removeprefix(POLICY_PREFIX): v for k, v in state.items()}

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each full tensor by name, all-gathered one at a time.

        Collective: every rank must consume the iterator to the end in the same order.
        """
        self._reshard()
        for name, tensor in self.hf_model.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, tensor.detach()

    def close(self) -> None:
        """Release the model and, if this backend created it, the process group."""
        super().close()
        # sharded tensors in reference cycles keep their device mesh, and with it the
        # process group, alive past its destruction: collect them while the group exists
        gc.collect()
        if self._owns_process_group and dist.is_initialized():
            # a run that failed on this rank (closed while its error propagates) skips the
            # barrier: its peers may wait in another collective, and the barrier would hang
            # both; tearing the group down ends their waits with an error instead
            if sys.exc_info()[1] is None:
                dist.barrier()  # no rank tears down its gloo threads while a peer still talks
            dist.destroy_process_group()
        self._owns_process_group = False

    def _before_micro_batch(self, *, last: bool) -> None:
        """With ``gradient_sync = "last_micro_batch"`` gradients accumulate unsharded on
        each rank and are reduced once, in the step's last backward."""
        if self.gradient_sync == "last_micro_batch" and isinstance(self.policy, FSDPModule):
            self.policy.set_requires_gradient_sync(last)

    def _reshard(self) -> None:
        policy = self.policy
        if policy is None:
            return
        for module in policy.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _set_prefetch(root: torch.nn.Module, blocks: list[torch.nn.Module], depth: int) -> None:
    """Issue each block's all-gather ``depth`` blocks ahead in forward (and behind in
    backward), within each list of sibling blocks (e.g. ``model.layers``), which run in
    order; ``depth = 0`` keeps FSDP's implicit one-ahead order."""
    if depth <= 0:
        return
    parents = {id(child): id(module) for module in root.modules() for child in module.children()}
    chains: dict[int | None, list[torch.nn.Module]] = {}
    for block in blocks:  # in registration order, which is their list's order
        chains.setdefault(parents.get(id(block)), []).append(block)
    for chain in chains.values():
        for index, block in enumerate(chain):
            ahead = chain[index + 1:index + 1 + depth]
            behind = chain[max(0, index - depth):index][::-1]
            if ahead:
                block.set_modules_to_forward_prefetch(ahead)  # type: ignore[operator]
            if behind:
                block.set_modules_to_backward_prefetch(behind)  # type: ignore[operator]


def _cast_floating_inputs(dtype: torch.dtype, _module: torch.nn.Module, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: every floating-point tensor in ``args``/``kwargs`` cast to ``dtype``."""
    from torch.utils._pytree import tree_map

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return tree_map(cast, args), tree_map(cast, kwargs)
