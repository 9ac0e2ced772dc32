"""FSDP2 / HSDP backend: parameters, gradients and optimizer state sharded over ranks.

Composition, in torchtitan's order: build the model (real weights on rank 0, on the meta
device elsewhere) -> freeze patterns -> activation checkpointing -> ``train.compile`` of
each block's training forward (:mod:`reasonctl.backends.compile`) -> ``fully_shard`` each
transformer block (the classes in the model's ``_no_split_modules``) and then the root
(embeddings, final norm, output projection, vision merger) -> allocate the shards ->
broadcast the weights from rank 0 into them.

The device mesh is ``dp_shard`` (FSDP) or ``dp_replicate x dp_shard`` (HSDP: replicas of a
sharded group, e.g. one replica per node). Mixed precision keeps float32 shards and
computes in ``model.dtype`` with float32 gradient reduction.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

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
from reasonctl.backends.distributed import init_process_group, resolve_device
from reasonctl.backends.export import tied_parameter_groups
from reasonctl.backends.optim import build_optimizer, build_scheduler
from reasonctl.backends.token_logprobs import TokenLogprobModel
from reasonctl.core.context import RunContext
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.models.loading import (
    apply_trainable_patterns,
    compute_dtype,
    enable_gradient_checkpointing,
    load_pretrained,
    model_source,
)

POLICY_PREFIX = "hf_model."
"""Prefix of the Hugging Face model's names inside :class:`TokenLogprobModel`."""


class FSDPBackend(TorchBackend):
    """Fully sharded data parallel training over the processes of one launch."""

    def __init__(self, *, dp_replicate: int = 1, dp_shard: int = -1,
                 reshard_after_forward: bool = True, chunk_tokens: int,
                 export_shard_size: str) -> None:
        super().__init__(chunk_tokens=chunk_tokens, export_shard_size=export_shard_size)
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.reshard_after_forward = reshard_after_forward
        self.mesh: DeviceMesh | None = None
        self._owns_process_group = False

    # --- set-up ---------------------------------------------------------------------------

    def build(self, ctx: RunContext) -> None:
        """Join the process group, build the mesh, shard the model, create AdamW."""
        config = ctx.config
        self.device = resolve_device(config.backend.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group = init_process_group(self.device)
        self._owns_process_group = group.created
        self.rank, self.world_size = group.rank, group.world_size
        self.is_main = self.rank == 0
        self.mesh = self._build_mesh()
        self.grad_scale = float(self.world_size)

        # rank 0 resolves first (creates the tiny model, downloads remote weights) so the
        # other ranks find a finished local directory
        if self.is_main:
            self.source = model_source(ctx)
        dist.barrier()
        self.source = model_source(ctx)
        on_meta = self.rank != 0
        hf_model = load_pretrained(self.source.model_dir, config.model,
                                   param_dtype=torch.float32, device="cpu", on_meta=on_meta)
        full_state = {} if on_meta else {
            POLICY_PREFIX + k: v for k, v in hf_model.state_dict().items()
        }
        self.parameter_counts = apply_trainable_patterns(
            hf_model, freeze=config.model.freeze, trainable=config.model.trainable
        )
        if config.model.gradient_checkpointing:
            enable_gradient_checkpointing(hf_model)
        if config.train.compile:
            compile_blocks(hf_model)
        self.tied_groups = tied_parameter_groups(hf_model)
        self.hf_model = hf_model
        self.policy = TokenLogprobModel(hf_model, chunk_tokens=self.chunk_tokens)
        self._shard(self.policy, compute_dtype(config.model.dtype, self.device))
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

    def _build_mesh(self) -> DeviceMesh:
        replicate = self.dp_replicate
        shard = self.dp_shard if self.dp_shard > 0 else self.world_size // max(replicate, 1)
        if replicate < 1 or replicate * shard != self.world_size:
            raise ConfigError([
                f"backend.fsdp: dp_replicate ({replicate}) x dp_shard ({self.dp_shard}) must "
                f"equal the number of processes ({self.world_size}); set dp_shard = -1 to use "
                "world_size / dp_replicate"
            ])
        if replicate == 1:
            return init_device_mesh(self.device.type, (shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(self.device.type, (replicate, shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))

    def _shard(self, policy: TokenLogprobModel, dtype: torch.dtype) -> None:
        """``fully_shard`` every transformer block (innermost first), then the root."""
        hf_model = policy.hf_model
        block_names = set(getattr(hf_model, "_no_split_modules", None) or [])
        blocks = [m for m in hf_model.modules() if type(m).__name__ in block_names]
        if not blocks:
            raise ReasonctlError(
                f"{type(hf_model).__name__} declares no transformer block classes "
                "(_no_split_modules), so FSDP cannot shard it block by block; use the "
                "single backend"
            )
        if dtype == torch.float32:
            policy_mp = MixedPrecisionPolicy()
        else:
            policy_mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        options = {"mesh": self.mesh, "mp_policy": policy_mp}
        for block in reversed(blocks):
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        # The root group holds the embedding and (tied) output head. Backward needs them right
        # after forward, and the log-prob op recomputes the head's logits chunk by chunk in
        # backward, so resharding the root after forward only frees memory that is gathered
        # again at once -- and leaves that recomputation reading a freed weight.
        fully_shard(policy, reshard_after_forward=False, **options)

    # --- weights out ----------------------------------------------------------------------

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gather full CPU tensors to rank 0 (collective; other ranks get ``{}``)."""
        self._reshard()
        state = get_model_state_dict(
            self._policy(), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {k.removeprefix(POLICY_PREFIX): v for k, v in state.items()}

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each full tensor by Hugging Face name, all-gathered one at a time.

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
            dist.barrier()  # no rank tears down its gloo threads while a peer still talks
            dist.destroy_process_group()
        self._owns_process_group = False

    def _reshard(self) -> None:
        policy = self.policy
        if policy is None:
            return
        for module in policy.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
