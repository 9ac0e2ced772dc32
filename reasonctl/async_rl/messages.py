"""What travels through the streams: prompt batches and their rollouts, without pickle.

A :class:`PromptBatch` is one trainer rank's prompts of one step: their encoded form (token
ids and any vision tensors, as safetensors bytes), the sampling seed and its identity
``(step, rank)``; each prompt is a *prompt group* with the id ``s<step>-r<rank>-g<i>``.
A :class:`RolloutBatch` answers it: the completions of every prompt (token ids as int32
bytes, engine log-probs as float32 bytes, texts and finish reasons as JSON), stamped with
the weight version that generated them and what the worker measured. Decoding never runs
code: JSON, raw arrays and safetensors only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from reasonctl.core.types import Completion, EpisodeSummary

Fields = dict[str, bytes]


@dataclass(frozen=True, order=True)
class WeightVersion:
    """Which weights: the trainer's start count (``incarnation``) and updates done (``step``)."""

    incarnation: int
    step: int

    def as_text(self) -> str:
        """``<incarnation>:<step>``."""
        return f"{self.incarnation}:{self.step}"

    @classmethod
    def parse(cls, text: str) -> WeightVersion:
        """The inverse of :meth:`as_text`."""
        incarnation, step = text.split(":")
        return cls(int(incarnation), int(step))


def group_ids(step: int, rank: int, count: int) -> list[str]:
    """``s<step>-r<rank>-g<i>`` for the ``count`` prompt groups of a batch."""
    return [f"s{step}-r{rank}-g{i}" for i in range(count)]


@dataclass
class PromptBatch:
    """One rank's prompts of one step, to be sampled ``rollout.n`` times each with ``seed``."""

    step: int
    rank: int
    seed: int
    indices: list[int]
    prompts: list[dict[str, Any]]
    """``EncodedSample.as_prompt()`` of each prompt: ``input_ids`` plus vision tensors."""
    attempt: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)
    """With an ``[environment]``: each prompt's sample (``Sample.to_dict()``), which the
    worker's episodes start from; empty otherwise."""

    @property
    def batch_id(self) -> str:
        """``s<step>-r<rank>``."""
        return f"s{self.step}-r{self.rank}"

    def group_ids(self) -> list[str]:
        """The id of each prompt group."""
        return group_ids(self.step, self.rank, len(self.prompts))

    def to_fields(self) -> Fields:
        """Stream fields: ``meta`` (JSON) and ``prompts`` (safetensors bytes)."""
        import torch
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        extras: list[list[str]] = []
        for i, prompt in enumerate(self.prompts):
            tensors[f"{i}.input_ids"] = torch.tensor(prompt["input_ids"], dtype=torch.int64)
            names = sorted(k for k in prompt if k != "input_ids")
            for name in names:
                tensors[f"{i}.{name}"] = prompt[name].detach().cpu().contiguous()
            extras.append(names)
        meta = {"step": self.step, "rank": self.rank, "seed": self.seed, "attempt": self.attempt,
                "indices": self.indices, "extras": extras, "samples": self.samples}
        return {"meta": json.dumps(meta).encode(), "prompts": save(tensors)}

    @classmethod
    def from_fields(cls, fields: Fields) -> PromptBatch:
        """Decode :meth:`to_fields`."""
        from safetensors.torch import load

        meta = json.loads(fields["meta"])
        tensors = load(fields["prompts"])
        prompts: list[dict[str, Any]] = []
        for i, names in enumerate(meta["extras"]):
            prompt: dict[str, Any] = {"input_ids": tensors[f"{i}.input_ids"].tolist()}
            prompt.update({name: tensors[f"{i}.{name}"] for name in names})
            prompts.append(prompt)
        return cls(step=int(meta["step"]), rank=int(meta["rank"]), seed=int(meta["seed"]),
                   indices=[int(i) for i in meta["indices"]], prompts=prompts,
                   attempt=int(meta["attempt"]), samples=list(meta.get("samples") or []))


@dataclass
class RolloutBatch:
    """The completions a worker sampled for a :class:`PromptBatch`."""

    step: int
    rank: int
    attempt: int
    version: WeightVersion
    worker: str
    completions: list[list[Completion]]
    deliveries: int = 1
    generate_s: float = 0.0
    sync_ms: float = 0.0
    """Milliseconds the worker's last weight transfer took (0 when it had them already)."""
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def batch_id(self) -> str:
        """``s<step>-r<rank>``, the id of the prompt batch answered."""
        return f"s{self.step}-r{self.rank}"

    @property
    def tokens(self) -> int:
        """Generated tokens in this batch."""
        return sum(len(c.token_ids) for group in self.completions for c in group)

    def to_fields(self) -> Fields:
        """Stream fields: ``meta`` (JSON), ``token_ids`` (int32) and ``logprobs`` (float32);
        for episodes of an environment also ``loss_masks`` (uint8, aligned with the token ids)
        and each episode's summary in ``meta``."""
        flat = [c for group in self.completions for c in group]
        episodic = any(c.episode is not None or c.loss_mask is not None for c in flat)
        meta = {
            "step": self.step, "rank": self.rank, "attempt": self.attempt,
            "version": self.version.as_text(), "worker": self.worker,
            "deliveries": self.deliveries, "generate_s": self.generate_s,
            "sync_ms": self.sync_ms, "stats": self.stats,
            "groups": [len(group) for group in self.completions],
            "lengths": [len(c.token_ids) for c in flat],
            "texts": [c.text for c in flat],
            "finish": [c.finish_reason for c in flat],
        }
        ids = np.fromiter((t for c in flat for t in c.token_ids), dtype="<i4")
        logprobs = np.fromiter((v for c in flat for v in c.logprobs), dtype="<f4")
        fields = {"token_ids": ids.tobytes(), "logprobs": logprobs.tobytes()}
        if episodic:
            meta["episodes"] = [asdict(c.episode) if c.episode is not None else None
                                for c in flat]
            fields["loss_masks"] = np.fromiter(
                (m for c in flat for m in (c.loss_mask or [1] * len(c.token_ids))),
                dtype="u1").tobytes()
        return {"meta": json.dumps(meta).encode(), **fields}

    @classmethod
    def from_fields(cls, fields: Fields) -> RolloutBatch:
        """Decode :meth:`to_fields`."""
        meta = json.loads(fields["meta"])
        ids = np.frombuffer(fields["token_ids"], dtype="<i4")
        logprobs = np.frombuffer(fields["logprobs"], dtype="<f4")
        masks = np.frombuffer(fields["loss_masks"], dtype="u1") if "loss_masks" in fields \
            else None
        episodes = meta.get("episodes") or [None] * len(meta["lengths"])
        flat: list[Completion] = []
        offset = 0
        for length, text, finish, episode in zip(meta["lengths"], meta["texts"], meta["finish"],
                                                 episodes, strict=True):
            end = offset + int(length)
            flat.append(Completion(
                text=text, token_ids=ids[offset:end].tolist(),
                logprobs=logprobs[offset:end].tolist(), finish_reason=finish,
                loss_mask=masks[offset:end].tolist() if masks is not None else None,
                episode=EpisodeSummary(**episode) if episode is not None else None))
            offset = end
        if offset != len(ids) or len(ids) != len(logprobs) or (
                masks is not None and len(masks) != len(ids)):
            raise ValueError("a rollout entry's token arrays do not match its lengths")
        completions: list[list[Completion]] = []
        start = 0
        for size in meta["groups"]:
            completions.append(flat[start : start + int(size)])
            start += int(size)
        return cls(step=int(meta["step"]), rank=int(meta["rank"]), attempt=int(meta["attempt"]),
                   version=WeightVersion.parse(meta["version"]), worker=str(meta["worker"]),
                   completions=completions, deliveries=int(meta["deliveries"]),
                   generate_s=float(meta["generate_s"]), sync_ms=float(meta["sync_ms"]),
                   stats={k: float(v) for k, v in meta.get("stats", {}).items()})
