"""What the model rewards (``reward_model``, ``judge``) share: their common options, loading
a model and tokenizer on a device, the texts a sample gives them, and scoring in the
background.

A model reward scores in a thread of its own (:class:`BackgroundScoring`): it is
asynchronous (:class:`~reasonctl.core.protocols.SubmitsAsync`), so in a training run its
forward passes or generation overlap the trainer's log-prob passes, as the ``remote``
reward's requests do. Served by ``reasonctl serve-rewards`` the same reward is batched
across the requests of many trainers.

Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from pydantic import Field

from reasonctl.core.types import Explanation, Sample
from reasonctl.rewards.base import RewardConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ModelRewardConfig(RewardConfig):
    """Options every model reward has."""

    model: str = Field(min_length=1,
                       description="The model: a local directory or a Hugging Face model id.")
    tokenizer: str | None = Field(default=None,
                                  description="Tokenizer directory or id (default: model).")
    device: str = Field(
        default="auto",
        description="auto: this process's CUDA device when there is one, else the CPU; or "
        "'cpu', 'cuda', 'cuda:N'. Served with [workers] kind = 'process' and devices, each "
        "worker sees its own device as cuda:0.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 on CUDA, float32 elsewhere.")
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own code (only for models "
        "you trust).")
    batch_size: int = Field(default=16, gt=0,
                            description="Completions per forward pass (judge: generated "
                            "together at most).")


def resolve_device(name: str) -> Any:
    """The torch device ``name`` means (``auto``: the process's CUDA device when there is
    one, from ``LOCAL_RANK``, else the CPU)."""
    import os

    import torch

    from reasonctl.core.errors import ReasonctlError

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ReasonctlError(f"device {name!r} is not a device: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ReasonctlError(f"device {name!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device


def torch_dtype(name: str, device: Any) -> Any:
    """The torch dtype of ``name`` on ``device`` (``auto``: bfloat16 on CUDA, else float32)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, DTYPES[name])


def load_tokenizer(config: ModelRewardConfig) -> Any:
    """The reward's tokenizer (``tokenizer``, else the model's)."""
    from transformers import AutoTokenizer

    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    source = resolve_tiny_alias(config.tokenizer or config.model)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)


def model_source(config: ModelRewardConfig) -> str:
    """Where the model's weights are (a tiny alias resolved to its local directory)."""
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    return resolve_tiny_alias(config.model)


def prompt_text(sample: Sample) -> str:
    """The text of the sample's prompt turns (user and earlier turns, without system
    messages); media parts are left out."""
    return "\n".join(m.text for m in sample.prompt_messages() if m.role != "system").strip()


def reference_text(sample: Sample) -> str | None:
    """The sample's reference answer as text (a multiple-choice layout's ``answer``, a list
    joined by " or "), ``None`` without one."""
    reference: Any = sample.reference
    if isinstance(reference, Mapping):
        reference = reference.get("answer")
    if reference is None and isinstance(sample.meta.get("qa_pairs"), (list, dict)):
        qa = sample.meta["qa_pairs"]
        qa = qa[0] if isinstance(qa, list) and qa else qa
        reference = qa.get("answer") if isinstance(qa, Mapping) else None
    if reference is None or isinstance(reference, bool):
        return None
    if isinstance(reference, (list, tuple)):
        return " or ".join(str(item) for item in reference)
    return str(reference)


class BackgroundScoring(ABC):
    """A reward that scores batches in one background thread of its own.

    :meth:`submit` queues a batch and returns at once; :meth:`collect` waits for its
    scores; ``__call__`` is both. Subclasses implement :meth:`explain` (scores with the
    reason of each), which runs in the background thread, one batch at a time.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=type(self).__name__)
        self._lock = threading.Lock()
        self.reasons: dict[str, int] = {}
        """How many completions were scored for each reason since this reward was built."""

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]
                 ) -> list[float | None]:
        """Score a batch and wait."""
        return self.collect(self.submit(completions, samples))

    def submit(self, completions: Sequence[str], samples: Sequence[Sample]
               ) -> Future[list[Explanation]]:
        """Start scoring ``completions`` in the background."""
        return self._executor.submit(self._explain_counted, list(completions), list(samples))

    def collect(self, handle: Future[list[Explanation]]) -> list[float | None]:
        """The scores of a submitted batch."""
        return [explanation.score for explanation in handle.result()]

    def _explain_counted(self, completions: list[str], samples: list[Sample]
                         ) -> list[Explanation]:
        explained = self.explain(completions, samples)
        self._count(explained)
        return explained

    def _count(self, explained: Sequence[Explanation]) -> None:
        with self._lock:
            for explanation in explained:
                self.reasons[explanation.reason] = self.reasons.get(explanation.reason, 0) + 1

    @abstractmethod
    def explain(self, completions: Sequence[str], samples: Sequence[Sample]
                ) -> list[Explanation]:
        """Score each completion and say why (runs in the caller's thread)."""

    def close(self) -> None:
        """Stop the background thread (after the batch it is scoring)."""
        self._executor.shutdown(wait=True)


__all__ = ["BackgroundScoring", "ModelRewardConfig", "load_tokenizer", "model_source",
           "prompt_text", "reference_text", "resolve_device", "torch_dtype"]
