"""The plugin contract: the run context every component receives and one Protocol per kind.

Together with :mod:`reasonctl.core.hookspecs` this file is the whole surface a plugin author
needs to read (``docs/plugins.md`` walks through it with examples). It is longer than our
usual module on purpose: the contract stays in one place.

**Factories.** A component is built by the factory it registers, called with one positional
argument, its validated config (an instance of the ``config_model`` given at registration,
or ``None`` without one). A factory that declares a parameter named ``ctx`` also receives
the run's :class:`RunContext` as ``ctx=`` (opt-in, like pluggy hook arguments). The built
object is checked against its kind's Protocol below; a missing member is reported at build
time, naming it.

**Required and optional.** Each Protocol lists what every component of its kind must have.
What a component *may* offer is a separate, smaller Protocol (``SupportsReferenceModel``,
``SharesPolicyWeights`` ...) with the default that applies when it does not; the functions
at the end of this module (:func:`algorithm_needs`, :func:`shares_policy_weights` ...)
apply those defaults, so nothing in reasonctl probes components with ``getattr``.

Every protocol is structural: no base class to inherit. Torch types appear only in
annotations; this module does not import torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol, runtime_checkable

from reasonctl.core.config import RunConfig
from reasonctl.core.config.preflight import ChecksUris
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.registry import Registry
from reasonctl.core.types import (
    Completion,
    EncodedSample,
    Explanation,
    Metrics,
    ModelSource,
    Observation,
    PolicyBatch,
    Sample,
    SamplingParams,
    TrainBatch,
)

if TYPE_CHECKING:
    import torch

    from reasonctl.core.checkpoint import CheckpointManager


# --- the run context ---------------------------------------------------------------------------

SHOWN_SKIPPED_ROWS = 20
"""Skipped rows printed one by one; the rest are only listed in ``skipped_rows.jsonl``."""


@dataclass
class RunContext:
    """Everything a component may use during a run, built by the runner (the only composer).

    The runner fills the parts in this order: ``backend`` (then ``backend.setup(ctx)``),
    ``model_source``, then what the algorithm's :class:`Needs` ask for: ``processor``,
    ``dataset``, ``rewards``, the reference model (inside the backend), ``environment``
    (with ``[environment] name``), ``engine`` (or, with ``rollout.placement =
    "separate"``, ``rollout_workers``); and ``evaluator`` when
    ``[eval]`` asks for periodic evaluation. A part the algorithm did not
    ask for is ``None``. Algorithms set ``total_steps`` in ``setup``; the runner advances
    ``step`` after each :meth:`Algorithm.step`.

    ``skipped_rows`` counts malformed data rows skipped under ``data.on_bad_row = "skip"``
    (the dataset's own count is added by the runner; algorithms add rows they skip while
    encoding, with :meth:`record_skipped_row`); the run reports it at the end, and every
    recorded row is printed and appended to ``skipped_rows.jsonl`` in the output directory
    (``skipped_rows.rank<N>.jsonl`` on other ranks) as it is skipped.
    """

    config: RunConfig
    registry: Registry
    hooks: LifecycleHooks
    output_dir: Path
    backend: Backend | None = None
    model_source: ModelSource | None = None
    processor: Processor | None = None
    dataset: Dataset | StreamsSamples | None = None
    rewards: RewardScorer | None = None
    engine: RolloutEngine | None = None
    environment: Environment | None = None
    """With ``[environment] name``: the environment rollouts run their episodes in (built
    for algorithms that need a rollout engine, and for periodic evaluation)."""
    evaluator: Evaluator | None = None
    rollout_workers: Any = None
    """With ``rollout.placement = "separate"``: the run's connection to its rollout workers
    (:class:`reasonctl.async_rl.pool.RolloutWorkers`), built by the runner."""
    checkpoints: CheckpointManager | None = None
    total_steps: int = 0
    step: int = 0
    skipped_rows: int = 0
    stop_signal: str | None = None
    skipped_row_reports: list[tuple[str, str]] = field(default_factory=list)
    """``(file:line, reason)`` of the rows recorded by :meth:`record_skipped_row`."""
    _recorded_rows: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def record_skipped_row(self, where: str, reason: str) -> None:
        """Count a malformed row skipped under ``data.on_bad_row = "skip"``, print it (the
        first :data:`SHOWN_SKIPPED_ROWS`) and append it to this rank's
        ``skipped_rows.jsonl``. A row skipped again (drawn in a later epoch, or by a retry)
        is neither counted nor listed twice, so the list is the data's bad rows, as
        ``reasonctl data check`` names them."""
        import json

        if (where, reason) in self._recorded_rows:
            return
        self._recorded_rows.add((where, reason))
        self.skipped_rows += 1
        self.skipped_row_reports.append((where, reason))
        if len(self.skipped_row_reports) <= SHOWN_SKIPPED_ROWS:
            self.info(f"skipped {where}: {reason}")
        elif len(self.skipped_row_reports) == SHOWN_SKIPPED_ROWS + 1:
            self.info(f"skipping more rows; every one is listed in {self.skipped_rows_file}")
        self.skipped_rows_file.parent.mkdir(parents=True, exist_ok=True)
        with self.skipped_rows_file.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"row": where, "reason": reason, "step": self.step},
                                  ensure_ascii=False) + "\n")

    @property
    def skipped_rows_file(self) -> Path:
        """Where this rank lists the rows it skipped."""
        rank = int(os.environ.get("RANK", "0"))
        name = "skipped_rows.jsonl" if rank == 0 else f"skipped_rows.rank{rank}.jsonl"
        return self.output_dir / name

    @property
    def is_main(self) -> bool:
        """True on the process that logs, exports and prints (global rank 0)."""
        if self.backend is not None:
            return self.backend.is_main
        return int(os.environ.get("RANK", "0")) == 0

    def info(self, message: str) -> None:
        """Print a progress message on the main rank (stderr, so stdout stays clean)."""
        if self.is_main:
            print(message, file=sys.stderr, flush=True)

    def component_config(self, section: str, name: str) -> Any:
        """Typed config of component ``name`` under ``[section.name]`` (defaults if absent)."""
        return self.config.component_config(section, name)


# --- what algorithms ask the runner for ----------------------------------------------------------


@dataclass(frozen=True)
class Needs:
    """The parts of a run an algorithm uses; the runner builds exactly these.

    The default (an algorithm without :meth:`DeclaresNeeds.needs`) is a chat processor and
    the training dataset, which is what supervised fine-tuning uses. RL algorithms add
    ``rewards`` and ``rollout_engine``; ``reference_model`` asks the backend for a frozen copy
    of the starting weights (a backend without :class:`SupportsReferenceModel` then fails at
    build time). An algorithm that trains on something other than chat data (for instance a
    diffusion model) sets ``processor = False``.
    """

    processor: bool = True
    dataset: bool = True
    rewards: bool = False
    rollout_engine: bool = False
    reference_model: bool = False


@runtime_checkable
class DeclaresNeeds(Protocol):
    """Optional for algorithms or their config models: which parts of the run they use
    (default: :class:`Needs()`).

    Declare it on the **config model** where you can: it is known before anything is built,
    so ``reasonctl config validate`` checks only what the run will use (for instance no
    data paths for an algorithm that reads no dataset). An algorithm's own ``needs()``, if
    it has one, takes precedence when the run is composed.
    """

    def needs(self) -> Needs:
        """The parts to build; the runner asks once, before building any part."""
        ...


@runtime_checkable
class Closes(Protocol):
    """Optional for algorithms and rollout engines: release what they hold (worker threads,
    server processes, device memory) when the run ends, whatever its outcome (default:
    nothing to release)."""

    def close(self) -> None:
        """Release resources; called once by the runner at the end of the run."""
        ...


@runtime_checkable
class ValidatesRunConfig(Protocol):
    """Optional for an algorithm's, a backend's or a reward's config model: problems of the
    whole run config that the component can tell before any model or data is loaded
    (default: none), e.g. SFT's global batch splitting into micro-batches, or the
    ``remote`` reward's token. ``reasonctl config validate`` and ``reasonctl run`` report
    them with the other pre-flight problems, as ``path: message`` lines (exit 2); a
    reward's paths are relative to its ``[[rewards.components]]`` entry. It lives on the
    config model, which imports nothing heavy, so the check stays fast."""

    def config_problems(self, config: RunConfig, *, world_size: int) -> list[str]:
        """Problems of ``config`` for this algorithm on ``world_size`` data-parallel ranks."""
        ...


@runtime_checkable
class ValidatesProcessLayout(Protocol):
    """Optional for a backend's config model: how it lays out ``processes`` launched
    processes, checked by the launcher before it starts any (``reasonctl run
    --nproc-per-node N``): the problems of the layout (sizes that do not divide the
    processes or the model, a device the backend cannot use), as ``path: message`` lines
    reported with the other pre-flight problems (exit 2), and the data-parallel ranks the
    algorithm's :class:`ValidatesRunConfig` check then sees. Default: none, and every
    process a data-parallel rank. Keep it free of torch imports at module level."""

    def layout_problems(self, config: RunConfig, *, processes: int) -> list[str]:
        """Problems of running ``config`` on ``processes`` processes with this backend."""
        ...

    def data_parallel_size(self, *, processes: int) -> int:
        """Data-parallel ranks among ``processes`` (called when there are no problems)."""
        ...


# --- components ----------------------------------------------------------------------------------


@runtime_checkable
class Dataset(Protocol):
    """A map-style collection of :class:`Sample` objects.

    Map-style (``len`` + index) lets the runner shuffle with a seed and resume at an exact
    position. Factories read the format-independent options they apply from
    ``ctx.config.data`` (``on_bad_row``); the runner applies ``max_samples``,
    ``system_prompt`` and ``prompt_template`` itself, to every format alike.
    """

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> Sample:
        """Return sample ``index`` (0-based)."""
        ...


@runtime_checkable
class StreamsSamples(Protocol):
    """A dataset read as a stream rather than by index (instead of ``__len__`` and
    ``__getitem__``), e.g. WebDataset shards in object storage.

    :meth:`iterate` gives one data-parallel rank its endless stream of ``(sample,
    position)`` pairs: the ranks' streams are disjoint and together hold every sample once
    per epoch, and ``position`` is a JSON-serialisable dict saying where the stream stands
    after that sample (``position["epoch"]`` counts epochs). Passed back as ``state``, it
    continues right after that sample, so algorithms record the position of the last
    sample they trained on in their checkpoints. ``samples_per_epoch`` is the number of
    samples of one epoch over all ranks when the format knows it (``None`` otherwise: a run
    then needs ``train.max_steps``). SFT and GRPO consume either kind of dataset.
    """

    samples_per_epoch: int | None

    def iterate(self, rank: int, world_size: int, state: dict[str, Any] | None
                ) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """This rank's samples from the start (``state=None``) or after ``state``."""
        ...


@runtime_checkable
class CountsSkippedRows(Protocol):
    """Optional for datasets: how many malformed rows were skipped (default 0).

    A format that honours ``data.on_bad_row = "skip"`` exposes the count so the run can
    report it.
    """

    skipped_rows: int


@runtime_checkable
class ReportsSkippedRows(Protocol):
    """Optional for datasets: which malformed rows were skipped and why (default: none
    named), as ``(file:line, reason)`` pairs; the run prints them and writes them to
    ``skipped_rows.jsonl``."""

    skipped: list[tuple[str, str]]


@runtime_checkable
class Reward(Protocol):
    """A batched reward function.

    Called with the generated texts and the samples they answer (same length). Returns one
    score per completion, or ``None`` for a completion this reward does not apply to (it is
    then left out of this reward's mean and contributes 0 to the weighted sum). Plain Python
    functions are adapted by :func:`reasonctl.as_reward`.
    """

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion."""
        ...


MediaType = Literal["image", "video", "latent"]
"""What a media reward's completions are (see :class:`ScoresMedia`)."""


@runtime_checkable
class ScoresMedia(Protocol):
    """Optional for rewards: the completions are generated media, not text (default: text).

    A reward with ``media_type`` receives numpy arrays as ``completions``, one per sample:
    ``"image"``: ``uint8 [H, W, 3]``; ``"video"``: ``uint8 [T, H, W, 3]``; ``"latent"``:
    ``float32`` of any shape (what a world model generates before decoding). The reward
    service checks every request's arrays against the reward's ``media_type`` before the
    reward sees them. Diffusion algorithms (``flow_grpo``, ``ddrl``) decode what their
    rewards ask for; a text reward in such a run is a configuration error, and plain
    callables without the attribute receive the model's natural media (images or videos).
    """

    media_type: MediaType


@runtime_checkable
class SubmitsAsync(Protocol):
    """Optional for rewards: scoring that runs elsewhere and can overlap training (default:
    the reward is called synchronously).

    :meth:`submit` starts scoring and returns at once with a handle; :meth:`collect` waits
    for that handle's scores. :meth:`reasonctl.RewardSet.submit` submits every such reward
    before it computes the local ones, and GRPO collects just before its update, so the
    scoring overlaps the log-prob passes. ``__call__`` (the :class:`Reward` protocol) stays
    required: it is ``collect(submit(...))``. A failure may surface in either method;
    ``rewards.on_error`` applies to it as to a raising ``__call__``.
    """

    def submit(self, completions: Sequence[Any], samples: Sequence[Sample]) -> Any:
        """Start scoring ``completions`` (answers to ``samples``); return a handle."""
        ...

    def collect(self, handle: Any) -> list[float | None]:
        """The scores of a submitted batch, one per completion (``None``: does not apply)."""
        ...


@runtime_checkable
class ExplainsScores(Protocol):
    """Optional for rewards: say, per completion, what was read and why it scored what it
    did (default: only the score; explanations then say ``scored`` or ``not_applicable``).

    :meth:`explain` returns one :class:`~reasonctl.core.types.Explanation` per completion;
    its ``score`` must equal what ``__call__`` returns for that completion.
    ``reasonctl rewards score --explain`` and evaluation predictions show them.
    """

    def explain(self, completions: Sequence[Any], samples: Sequence[Sample]
                ) -> list[Explanation]:
        """Score each completion and say why."""
        ...


@runtime_checkable
class RewardScorer(Protocol):
    """The run's configured rewards as one scorer (:class:`reasonctl.RewardSet`).

    ``score`` returns a :class:`reasonctl.RewardScores` (weighted ``totals``, per-reward
    ``components``, ``metrics``); ``submit``/``collect`` split it in two so asynchronous
    rewards (``SubmitsAsync``) work while the caller does something else.
    """

    @property
    def names(self) -> list[str]:
        """Reward names in config order."""
        ...

    def score(self, completions: Sequence[Any], samples: Sequence[Sample]) -> Any:
        """Score ``completions[i]`` as an answer to ``samples[i]`` with every reward."""
        ...

    def submit(self, completions: Sequence[Any], samples: Sequence[Sample]) -> Any:
        """Start scoring; pass the result to :meth:`collect`."""
        ...

    def collect(self, pending: Any) -> Any:
        """Finish what :meth:`submit` started."""
        ...


@runtime_checkable
class Processor(Protocol):
    """The run's tokenizer/processor: chat template, tokenization, vision inputs.

    The runner builds one (:class:`reasonctl.ChatProcessor`) from the model's tokenizer
    directory for algorithms that need it; an algorithm uses it to encode samples.
    """

    tokenizer: Any
    max_length: int

    @property
    def pad_id(self) -> int:
        """The token id used for padding."""
        ...

    @property
    def reserved_token_ids(self) -> list[int]:
        """Token ids a sampled completion must never contain (vision placeholders ...)."""
        ...

    def token_ids(self, tokens: Sequence[str | int]) -> list[int]:
        """Ids of token strings (ids pass through); ``ValueError`` for an unknown one."""
        ...

    def encode_sft(self, sample: Sample) -> EncodedSample:
        """The whole conversation, with the assistant turns as training targets."""
        ...

    def encode_prompt(self, sample: Sample, *, mcq_layout: bool = True,
                      tools: Sequence[dict[str, Any]] | None = None) -> EncodedSample:
        """The prompt with the generation prompt appended (no targets), options lettered;
        ``tools`` (JSON schemas) are given to the chat template, which describes them."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids back to text."""
        ...


class TokenOutputs(Protocol):
    """What a backend's forward pass yields for the loss: per-token values for the labels.

    ``logprobs[b, t]`` is log p(input_ids[b, t+1] | input_ids[b, :t+1]) aligned so that
    position ``t`` predicts token ``t+1``; its shape is ``[B, T-1]`` (or ``[1, total-1]``
    for packed batches). ``entropy`` has the same shape when requested, else ``None``.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


ForwardFn = Callable[[Any, Any], Any]
"""A custom forward pass: ``forward(model, micro_batch) -> outputs``.

``model`` is the backend's live (possibly sharded) module, ``micro_batch`` one batch on the
backend's device; ``outputs`` is whatever the matching loss function reads. Algorithms
for models that are not causal language models (e.g. a diffusion transformer) pass one to
:meth:`Backend.train_step` and :meth:`RunsForward.run_forward`.
"""

LossFn = Callable[[TokenOutputs, Any], "tuple[torch.Tensor, Metrics]"]
"""A loss over one micro-batch: ``loss_fn(outputs, micro_batch) -> (loss, metrics)``.

``micro_batch`` is the :class:`TrainBatch` (or :class:`PolicyBatch`) passed to
:meth:`Backend.train_step`, moved to the backend's device. With a custom ``forward``
(:data:`ForwardFn`) ``outputs`` is what that function returned. The backend sums the returned
losses over all micro-batches and ranks, so a loss function normalises by the *global*
count it needs (e.g. all loss tokens in the step), which the algorithm computes before
calling :meth:`Backend.train_step`. Metric values may be floats or 0-dim tensors: tensors
stay on the device and are read with the step's other numbers in one host transfer, so a
loss function should return tensors rather than calling ``float()``/``.item()``.
"""


@runtime_checkable
class Backend(Protocol):
    """Owns devices, parallelism, the model, the optimizer and distributed state.

    Whatever its parallelism (one device, FSDP2, Megatron TP/PP), a backend offers the same
    operations so algorithms never deal with sharding. ``rank`` and ``world_size`` are the
    data-parallel coordinates: algorithms split data by them (tensor- or pipeline-parallel
    peers share one rank's data); ``is_main`` is the global rank 0.
    """

    rank: int
    world_size: int
    is_main: bool
    device: torch.device

    def setup(self, ctx: RunContext) -> None:
        """Initialise process groups, build and shard the model, optimizer and schedule.

        May set ``ctx.model_source`` (the runner resolves it otherwise); the model's
        directory is :func:`reasonctl.resolve_model_source`'s result.
        """
        ...

    def token_outputs(self, batch: TrainBatch | PolicyBatch, *, with_entropy: bool = False,
                      temperature: float = 1.0) -> TokenOutputs:
        """Per-token log-probs (and optionally entropy) of a batch, without gradients."""
        ...

    def train_step(self, micro_batches: Sequence[TrainBatch | PolicyBatch], loss_fn: LossFn, *,
                   with_entropy: bool = False, temperature: float = 1.0,
                   forward: ForwardFn | None = None) -> Metrics:
        """Forward/backward over micro-batches, clip, one optimizer and schedule step.

        Returns metrics including ``loss``, ``grad_norm`` and ``lr`` plus the loss
        function's metrics averaged over micro-batches and ranks. With ``forward`` the
        loss receives ``forward(model, micro_batch)`` instead of token log-probs (a backend
        that cannot run one raises ``TypeError``).
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
        """Average scalar metrics over data-parallel ranks (same keys on every rank)."""
        ...

    def barrier(self) -> None:
        """Wait for all ranks."""
        ...

    def close(self) -> None:
        """Release process groups and device memory."""
        ...


@runtime_checkable
class SupportsReferenceModel(Protocol):
    """Optional for backends: a frozen reference policy for KL penalties (default: none).

    Without it, an algorithm whose :class:`Needs` ask for ``reference_model`` fails at
    build time with a message naming the backend.
    """

    def build_reference_model(self) -> None:
        """Keep a frozen copy of the current (starting) weights; called before any resume."""
        ...

    def reference_token_outputs(self, batch: TrainBatch | PolicyBatch, *,
                                with_entropy: bool = False,
                                temperature: float = 1.0) -> TokenOutputs:
        """:meth:`Backend.token_outputs` under the reference weights."""
        ...


@runtime_checkable
class RunsSharedPrompts(Protocol):
    """Optional for backends: shared-prompt batches (default: padded rows only).

    A shared-prompt batch (:func:`reasonctl.algorithms.policy_batch.
    shared_prompt_micro_batches`) holds each prompt once, followed by its completions, and
    is passed to :meth:`Backend.token_outputs` and :meth:`Backend.train_step` like a padded
    one; the outputs have the padded rows' ``[B, T - 1]`` layout.
    """

    def shared_prompt_problem(self) -> str | None:
        """Why this backend cannot run shared-prompt batches now (``None`` when it can)."""
        ...


@runtime_checkable
class ProvidesGenerationModel(Protocol):
    """Optional for backends: the live policy module for a rollout engine in-process.

    ``generation_model`` is a plain (unsharded) Hugging Face module holding the policy
    weights, or ``None`` where they are sharded or wrapped; ``autocast()`` the context its
    forward passes run under. Default (a backend without it): engines keep their own copy
    and are refreshed from :meth:`Backend.full_state_dict`.
    """

    generation_model: Any

    def autocast(self) -> Any:
        """The autocast context manager of forward passes."""
        ...


@runtime_checkable
class RunsForward(Protocol):
    """Optional for backends: run a custom forward pass without gradients (default: none).

    What algorithms for other model kinds (diffusion transformers) use for sampling and
    for scoring under the reference weights; a backend without it cannot train them.
    """

    def run_forward(self, fn: ForwardFn, batch: Any, *, reference: bool = False) -> Any:
        """``fn(model, batch)`` in eval mode, without gradients, under the forward autocast;
        ``reference=True`` runs it under the weights kept by ``build_reference_model``."""
        ...


@runtime_checkable
class ProvidesChangedWeights(Protocol):
    """Optional for backends: the few tensors that differ from the source model.

    ``changed_state_dict()`` yields full tensors by Hugging Face name of only the weights
    training can have changed (with LoRA: the merged weights of the adapted layers), or
    returns ``None`` when any weight may have changed. Default: ``None``, so engines get
    :meth:`Backend.full_state_dict`.
    """

    def changed_state_dict(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The changed tensors (all ranks iterate to the end), or ``None``."""
        ...


@runtime_checkable
class ReportsEfficiency(Protocol):
    """Optional for backends: FLOP counts for the ``mfu`` metric (default: no ``mfu``)."""

    def peak_flops(self) -> float | None:
        """Peak dense FLOP/s of one device in the compute dtype, ``None`` when unknown."""
        ...

    def training_flops(self, tokens: int, mean_seq_len: float) -> float:
        """FLOPs of a forward and backward pass over ``tokens`` tokens."""
        ...


@runtime_checkable
class ReportsMemory(Protocol):
    """Optional for backends: device memory metrics the runner adds to every step's metrics
    (every algorithm gets them; an algorithm's own key of the same name wins). Default: none."""

    def memory_metrics(self) -> Metrics:
        """E.g. ``peak_mem_gb``."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """The semantics of a training step (SFT batch, GRPO rollout/update, ...).

    The runner builds the algorithm, asks it what it needs (:class:`DeclaresNeeds`, optional),
    builds those parts into the :class:`RunContext`, then calls :meth:`setup` once and
    :meth:`step` until ``ctx.total_steps``. ``state_dict``/``load_state_dict`` hold what the
    algorithm needs to resume exactly (data position, sampler state); model and optimizer
    state belong to the backend.
    """

    def setup(self, ctx: RunContext) -> None:
        """Prepare the data order and step state from the built parts; set ``ctx.total_steps``."""
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

        Each prompt is a dict with ``input_ids`` (list[int]) and, for VLMs, the processor's
        vision tensors (``EncodedSample.as_prompt()`` builds it). Returns one list of
        completions per prompt, each with its token ids and per-token log-probs.
        """
        ...

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights in place (no reallocation, no disk)."""
        ...


@runtime_checkable
class SharesPolicyWeights(Protocol):
    """Optional for engines: ``shares_policy_weights = True`` when the engine generates with
    the trainer's own module, so weights never need copying (default ``False``: the
    trainer's weights are loaded with :meth:`RolloutEngine.update_weights` before each
    rollout, see :func:`reasonctl.sync_engine_weights`)."""

    shares_policy_weights: bool


@runtime_checkable
class UpdatesChangedWeights(Protocol):
    """Optional for engines: load some tensors by name and keep the others as they are.

    Engines that hold the source model's weights take only the changed tensors of a
    backend offering :class:`ProvidesChangedWeights` (default: every tensor through
    :meth:`RolloutEngine.update_weights`).
    """

    def update_changed_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy the given full tensors into the weights of the same names, in place."""
        ...


@runtime_checkable
class StreamsText(Protocol):
    """Optional for engines: yield one completion's text as it is generated (used by
    ``reasonctl infer``; default: the whole completion from :meth:`RolloutEngine.generate`)."""

    def stream(self, prompt: dict[str, Any], params: SamplingParams) -> Iterator[str]:
        """Text pieces of one completion of ``prompt``, in order."""
        ...


@runtime_checkable
class ContinuesSequences(Protocol):
    """Optional for engines: generate the next turn of sequences the engine generated in
    its previous call, reusing what it computed for them (default: :meth:`generate` on the
    whole sequence again).

    Multi-turn episodes call it for every turn after the first: each prompt is a sequence
    of the previous call (generate or generate_continuation), its generated tokens and an
    observation. The weights have not changed since that call. An engine that kept the
    keys and values of such a sequence computes only those of the new tokens; any other
    prompt is generated as by :meth:`RolloutEngine.generate`, which the results equal.
    """

    def generate_continuation(self, prompts: Sequence[dict[str, Any]], params: SamplingParams
                              ) -> list[list[Completion]]:
        """:meth:`RolloutEngine.generate` for prompts that may extend earlier sequences."""
        ...


@runtime_checkable
class Episode(Protocol):
    """One episode of an :class:`Environment`: the policy's turns in, observations out.

    The episode runner (:func:`reasonctl.run_episodes`) calls :meth:`step` after each turn
    of the policy with that turn's text; the :class:`~reasonctl.core.types.Observation` it
    returns is appended to the sequence (masked out of the loss), and the policy generates
    the next turn, until the observation says ``done``, the policy runs out of turns
    (``environment.max_turns``) or tokens. Then :meth:`reward` and :meth:`metrics` are read
    once. ``step`` must not raise for bad input from the policy (a malformed tool call is
    an observation saying what is wrong); an exception is a bug of the environment and
    stops the run.
    """

    def step(self, turn: str) -> Observation:
        """Answer the policy's ``turn`` (its text, special tokens removed)."""
        ...

    def reward(self) -> float | None:
        """The environment's score of the finished episode, ``None`` for none. It is added
        to the run's rewards with weight ``environment.reward_weight``."""
        ...

    def metrics(self) -> Metrics:
        """Per-episode counts (e.g. ``tool_calls``, ``tool_errors``, ``tool_seconds``),
        averaged over episodes into ``env/<name>`` metrics."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Multi-turn episodes with tools (``[environment] name``): for each sampled
    completion the rollout starts an episode on its sample.

    Sandboxes and tool processes belong to the environment (or a service it calls), never
    to the trainer process. An environment that holds processes or threads releases them
    in ``close`` (:class:`Closes`).
    """

    def start(self, sample: Sample) -> Episode:
        """A new episode answering ``sample``'s prompt."""
        ...


@runtime_checkable
class DeclaresTools(Protocol):
    """Optional for environments: the tools the policy may call, as JSON schemas (the
    ``tools`` argument of ``tokenizer.apply_chat_template``) that prompts are encoded with,
    so the chat template describes them (default: prompts are encoded without tools)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """One ``{"type": "function", "function": {...}}`` schema per tool."""
        ...


@runtime_checkable
class Evaluator(Protocol):
    """Periodic evaluation the runner performs every ``eval.every_steps`` steps."""

    def evaluate(self, ctx: RunContext) -> Metrics:
        """Generate and score the evaluation set; ``eval/...`` metrics averaged over ranks."""
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
class ChecksAccess(Protocol):
    """Optional capability of a storage: check credentials and target before a run."""

    def check_access(self, uri: str) -> None:
        """Raise :class:`~reasonctl.core.storage.StorageError` (``permanent=True`` for what
        no retry fixes) when ``uri`` cannot be written with the current credentials."""
        ...


@runtime_checkable
class ReadsStreams(Protocol):
    """Optional for storage: read an object as a byte stream from an offset (default: the
    object is downloaded whole with :meth:`Storage.get_file` first). Streamed datasets
    read their shards through it."""

    def open_read(self, uri: str, start: int = 0) -> BinaryIO:
        """A readable binary stream of the object ``uri`` from byte ``start`` on."""
        ...


@runtime_checkable
class Logger(Protocol):
    """Receives metrics; only the main rank's loggers are built and called.

    Loggers are built after a resume: ``ctx.step`` (for a factory that declares ``ctx``) is
    the step the run continues from, 0 for a fresh run. A resumed run logs the steps after
    that checkpoint again, so a logger that appends to a record outliving the run keeps
    what was logged up to ``ctx.step`` and drops the rest.
    """

    def log(self, metrics: Metrics, step: int) -> None:
        """Record the metrics of ``step``."""
        ...

    def close(self) -> None:
        """Flush and release resources at the end of the run."""
        ...


PROTOCOLS: dict[str, type | tuple[type, ...]] = {
    "dataset": (Dataset, StreamsSamples),
    "reward": Reward,
    "algorithm": Algorithm,
    "backend": Backend,
    "storage": Storage,
    "rollout_engine": RolloutEngine,
    "logger": Logger,
    "environment": Environment,
}
"""Component kind -> the Protocol every built component of that kind must satisfy (or
the Protocols one of which it must satisfy)."""


# --- optional capabilities with their defaults --------------------------------------------------


def algorithm_needs(algorithm: Algorithm, options: Any = None) -> Needs:
    """What ``algorithm`` (with its config model instance ``options``) asks the runner to
    build: the algorithm's ``needs()``, else its config model's, else :class:`Needs()`."""
    for declarer in (algorithm, options):
        if isinstance(declarer, DeclaresNeeds):
            needs = declarer.needs()
            if not isinstance(needs, Needs):
                raise TypeError(
                    f"{type(declarer).__name__}.needs() returned {type(needs).__name__}; return "
                    "a reasonctl.Needs(...)"
                )
            return needs
    return Needs()


def shares_policy_weights(engine: RolloutEngine) -> bool:
    """Whether ``engine`` generates with the trainer's own module (``False`` by default)."""
    return isinstance(engine, SharesPolicyWeights) and bool(engine.shares_policy_weights)


def streams_samples(dataset: Any) -> bool:
    """Whether ``dataset`` is streamed (:class:`StreamsSamples`) rather than indexed."""
    return isinstance(dataset, StreamsSamples) and not isinstance(dataset, Dataset)


def changed_state_dict(backend: Backend) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The backend's changed tensors, or ``None`` (the default: any may have changed)."""
    if isinstance(backend, ProvidesChangedWeights):
        return backend.changed_state_dict()
    return None


def updates_changed_weights(engine: RolloutEngine) -> bool:
    """Whether ``engine`` can load a subset of its weights (``False`` by default)."""
    return isinstance(engine, UpdatesChangedWeights)


def skipped_rows(dataset: Dataset | StreamsSamples) -> int:
    """How many malformed rows ``dataset`` skipped (0 by default)."""
    return int(dataset.skipped_rows) if isinstance(dataset, CountsSkippedRows) else 0


def skipped_row_reports(dataset: Dataset) -> list[tuple[str, str]]:
    """The ``(file:line, reason)`` of the rows ``dataset`` skipped (empty by default)."""
    return list(dataset.skipped) if isinstance(dataset, ReportsSkippedRows) else []


def check_storage_access(storage: Storage, uri: str) -> None:
    """Run the storage's start-of-run check of ``uri`` (nothing by default)."""
    if isinstance(storage, ChecksAccess):
        storage.check_access(uri)


def reward_media_type(reward: Reward) -> str:
    """What ``reward`` scores: its :class:`ScoresMedia` ``media_type``, else ``"text"``."""
    return str(reward.media_type) if isinstance(reward, ScoresMedia) else "text"


def shared_prompt_problem(backend: Backend) -> str | None:
    """Why ``backend`` cannot run shared-prompt batches (:class:`RunsSharedPrompts`; by
    default it cannot), or ``None``."""
    if isinstance(backend, RunsSharedPrompts):
        return backend.shared_prompt_problem()
    return f"backend {type(backend).__name__} runs padded rows only"


def environment_tools(environment: Environment | None) -> list[dict[str, Any]] | None:
    """The tool schemas ``environment`` declares (:class:`DeclaresTools`), else ``None``."""
    if isinstance(environment, DeclaresTools):
        return list(environment.tool_schemas())
    return None


def generate_continuation(engine: RolloutEngine, prompts: Sequence[dict[str, Any]],
                          params: SamplingParams) -> list[list[Completion]]:
    """The next turn of earlier sequences: the engine's :class:`ContinuesSequences` method,
    else :meth:`RolloutEngine.generate` (the default)."""
    if isinstance(engine, ContinuesSequences):
        return engine.generate_continuation(prompts, params)
    return engine.generate(prompts, params)


def generation_model(backend: Backend) -> Any:
    """The backend's live unsharded policy module, or ``None`` (the default)."""
    return backend.generation_model if isinstance(backend, ProvidesGenerationModel) else None


__all__ = [
    "PROTOCOLS",
    "Algorithm",
    "Backend",
    "ChecksAccess",
    "ChecksUris",
    "Closes",
    "ContinuesSequences",
    "CountsSkippedRows",
    "Dataset",
    "DeclaresNeeds",
    "DeclaresTools",
    "Environment",
    "Episode",
    "Evaluator",
    "ExplainsScores",
    "ForwardFn",
    "Logger",
    "LossFn",
    "MediaType",
    "Needs",
    "Processor",
    "ProvidesChangedWeights",
    "ProvidesGenerationModel",
    "ReadsStreams",
    "ReportsEfficiency",
    "ReportsMemory",
    "ReportsSkippedRows",
    "Reward",
    "RewardScorer",
    "RolloutEngine",
    "RunContext",
    "RunsForward",
    "RunsSharedPrompts",
    "ScoresMedia",
    "SharesPolicyWeights",
    "Storage",
    "StreamsSamples",
    "StreamsText",
    "SubmitsAsync",
    "SupportsReferenceModel",
    "TokenOutputs",
    "UpdatesChangedWeights",
    "ValidatesProcessLayout",
    "ValidatesRunConfig",
    "algorithm_needs",
    "changed_state_dict",
    "check_storage_access",
    "environment_tools",
    "generate_continuation",
    "generation_model",
    "shared_prompt_problem",
    "reward_media_type",
    "shares_policy_weights",
    "skipped_row_reports",
    "skipped_rows",
    "streams_samples",
]
