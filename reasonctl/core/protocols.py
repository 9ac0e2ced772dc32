"""The interfaces each component kind implements.

Together with :mod:`reasonctl.core.hookspecs` this file is the whole surface a plugin author
needs to read. Components are constructed by the factory they register, which is called
with the component's validated config section (an instance of the ``config_model`` given
at registration, or ``None`` when the component registered none) and, for some kinds, the
:class:`~reasonctl.core.context.RunContext`. Every protocol is structural: no base class
to inherit.

Torch types appear only in annotations; this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reasonctl.core.types import Completion, Metrics, Sample, SamplingParams

if TYPE_CHECKING:
    import torch

    from reasonctl.core.context import RunContext


@runtime_checkable
class Dataset(Protocol):
    """A map-style collection of :class:`Sample` objects.

    Map-style (``len`` + index) lets the runner shuffle with a seed and resume at an exact
    position. Formats that skip malformed rows expose how many they skipped in
    ``skipped_rows`` so the run can report it.
    """

    skipped_rows: int

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> Sample:
        """Return sample ``index`` (0-based)."""
        ...


@runtime_checkable
class Reward(Protocol):
    """A batched reward function.

    Called with the generated texts and the samples they answer (same length). Returns one
    score per completion, or ``None`` for a completion this reward does not apply to (it is
    then left out of this reward's mean and contributes 0 to the weighted sum).
    """

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion."""
        ...


LossFn = Callable[["TokenOutputs", dict[str, Any]], "tuple[torch.Tensor, Metrics]"]
"""A loss over one micro-batch: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``.

The backend sums the returned losses over all micro-batches and ranks, so a loss function
normalises by the *global* count it needs (e.g. all loss tokens in the step), which the
algorithm computes before calling :meth:`Backend.train_step`.
"""


class TokenOutputs(Protocol):
    """What a backend's forward pass yields for the loss: per-token values for the labels.

    ``logprobs[b, t]`` is log p(input_ids[b, t+1] | input_ids[b, :t+1]) aligned so that
    position ``t`` predicts token ``t+1``; its shape is ``[B, T-1]`` (or ``[1, total-1]``
    for packed batches). ``entropy`` has the same shape when requested, else ``None``.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@runtime_checkable
class Backend(Protocol):
    """Owns devices, parallelism, the model, the optimizer and distributed state.

    Whatever its parallelism (one device, FSDP2, Megatron TP/PP), a backend offers the same
    operations so algorithms never deal with ranks or sharding.

    A backend may also offer ``generation_model``: a plain (unsharded) Hugging Face module
    holding the live policy weights that a rollout engine in the same process can call
    directly, sharing them instead of keeping a copy; ``None`` or absent where the weights
    are sharded or wrapped (FSDP, Megatron), which engines then copy via
    :meth:`full_state_dict`.
    """

    rank: int
    world_size: int
    is_main: bool
    device: torch.device

    def setup(self, ctx: RunContext) -> None:
        """Initialise process groups, build and shard the model, optimizer and schedule."""
        ...

    def token_outputs(self, batch: dict[str, Any], *, with_entropy: bool = False,
                      temperature: float = 1.0) -> TokenOutputs:
        """Per-token log-probs (and optionally entropy) of a batch, without gradients."""
        ...

    def train_step(self, micro_batches: Sequence[dict[str, Any]], loss_fn: LossFn, *,
                   with_entropy: bool = False, temperature: float = 1.0) -> Metrics:
        """Forward/backward over micro-batches, clip, one optimizer and schedule step.

        Returns metrics including ``grad_norm`` and ``lr`` plus the loss function's metrics
        averaged over micro-batches.
        """
        ...

    def save_checkpoint(self, directory: Path, *, asynchronous: bool = False
                        ) -> Future[Any] | None:
        """Save model, optimizer and schedule state (collectively, all ranks call it).

        With ``asynchronous`` (only passed when ``checkpoint.async_save`` is on) a backend
        may stage the state in host memory and write it in the background, returning a
        future that completes when the files are written (on the coordinating rank: when
        every rank's are); returning ``None`` means the state is already on disk.
        """
        ...

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the state written by :meth:`save_checkpoint` (any world size)."""
        ...

    def export(self, directory: Path) -> None:
        """Write a Hugging Face layout (config, safetensors, tokenizer) on the main rank."""
        ...

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full (unsharded) parameters by Hugging Face name, e.g. for a rollout engine."""
        ...

    def all_reduce_mean(self, values: Metrics) -> Metrics:
        """Average scalar metrics over data-parallel ranks."""
        ...

    def barrier(self) -> None:
        """Wait for all ranks."""
        ...

    def close(self) -> None:
        """Release process groups and device memory."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """The semantics of a training step (SFT batch, GRPO rollout/update, ...).

    The runner calls :meth:`setup` once, then :meth:`step` until ``ctx.total_steps``.
    ``state_dict``/``load_state_dict`` hold what the algorithm needs to resume exactly
    (data position, sampler state); model and optimizer state belong to the backend.
    """

    def setup(self, ctx: RunContext) -> None:
        """Build datasets, processors and the backend's model; set ``ctx.total_steps``."""
        ...

    def step(self, ctx: RunContext) -> Metrics:
        """Run one optimisation step and return its metrics."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state needed to resume."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state returned by :meth:`state_dict`."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates completions for prompts with the current policy weights."""

    def generate(
        self, prompts: Sequence[dict[str, Any]], params: SamplingParams
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each encoded prompt.

        Each prompt is a dict with at least ``input_ids`` (list[int]) and, for VLMs, the
        processor's vision tensors. Returns one list of completions per prompt.
        """
        ...

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights in place (no reallocation, no disk)."""
        ...


@runtime_checkable
class Storage(Protocol):
    """Files and directories addressed by URI (``file://``, ``s3://``, ``hf://``)."""

    def put_file(self, local: Path, uri: str) -> None:
        """Upload one local file to ``uri``."""
        ...

    def put_dir(self, local: Path, uri: str) -> None:
        """Upload a local directory tree under ``uri``."""
        ...

    def get_file(self, uri: str, local: Path) -> Path:
        """Download ``uri`` to ``local`` and return the local path."""
        ...

    def get_dir(self, uri: str, local: Path) -> Path:
        """Download everything under ``uri`` into ``local`` and return it."""
        ...

    def list(self, uri: str) -> list[str]:
        """URIs of the objects under ``uri`` (recursive)."""
        ...

    def exists(self, uri: str) -> bool:
        """Whether an object or prefix exists at ``uri``."""
        ...

    def delete(self, uri: str) -> None:
        """Delete the object or everything under the prefix ``uri``."""
        ...


@runtime_checkable
class Logger(Protocol):
    """Receives metrics; only the main rank's loggers are called."""

    def log(self, metrics: Metrics, step: int) -> None:
        """Record the metrics of ``step``."""
        ...

    def close(self) -> None:
        """Flush and release resources at the end of the run."""
        ...
