"""A step's rollout as training data: per-sample tensors and per-transition tensors.

``B`` samples (``rollout.n`` per prompt, group-major) each recorded ``K`` transitions.
Per-sample tensors (text rows, conditioning frames, DDRL's real latents) are stored once;
:meth:`RolloutData.batch` assembles the :class:`~reasonctl.diffusion.batches.FlowBatch`
of any list of ``(sample, transition)`` pairs, so micro-batches never copy the text
condition ``K`` times.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from reasonctl.diffusion.adapters.base import FrameCondition, TextCondition
from reasonctl.diffusion.batches import FlowBatch
from reasonctl.diffusion.sampler import Trajectories
from reasonctl.diffusion.sde import Schedule

Row = tuple[int, int]
"""A transition: ``(sample index, recorded-step index)``."""


@dataclass
class RolloutData:
    """Everything the update needs about one step's samples."""

    trajectories: Trajectories
    schedule: Schedule
    std_devs: torch.Tensor
    text: TextCondition
    advantages: torch.Tensor
    negative: TextCondition | None = None
    frames: FrameCondition | None = None
    ref_means: torch.Tensor | None = None
    data_clean: torch.Tensor | None = None
    data_noise: torch.Tensor | None = None
    data_sigma: torch.Tensor | None = None
    steps: tuple[int, ...] = field(default=())
    device_tables: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def samples(self) -> int:
        """``B``."""
        return int(self.trajectories.latents.shape[0])

    def rows(self, samples: Sequence[int] | None = None) -> list[Row]:
        """Every transition of ``samples`` (default: all), sample-major."""
        chosen = range(self.samples) if samples is None else samples
        return [(b, k) for b in chosen for k in range(len(self.steps))]

    def batch(self, rows: Sequence[Row]) -> FlowBatch:
        """The :class:`FlowBatch` of ``rows``."""
        b, k = self.indices(rows)
        return self.gather(b, k)

    def indices(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` as sample and recorded-step index tensors on the trajectories' device
        (one host-to-device copy)."""
        assert self.trajectories.states is not None
        both = torch.tensor(rows, dtype=torch.long).view(-1, 2)
        both = both.to(self.trajectories.states.device)
        return both[:, 0], both[:, 1]

    def gather(self, b: torch.Tensor, k: torch.Tensor) -> FlowBatch:
        """The :class:`FlowBatch` of the transitions ``(b[i], k[i])`` (device index tensors):
        indexing only, so building a micro-batch never waits on the device."""
        traj = self.trajectories
        assert traj.states is not None and traj.next_states is not None \
            and traj.log_probs is not None
        tables = self._tables()
        step = tables["steps"][k]
        out: FlowBatch = {
            "latents": traj.states[b, k],
            "next_latents": traj.next_states[b, k],
            "sigma": tables["sigmas"][step],
            "sigma_next": tables["sigmas"][step + 1],
            "std_dev": tables["std_devs"][step],
            "old_log_prob": traj.log_probs[b, k],
            "advantages": tables["advantages"][b],
        }
        text = self.text.select(b.to(self.text.embeds.device))
        out["text_embeds"] = text.embeds
        if text.pooled is not None:
            out["text_pooled"] = text.pooled
        if self.negative is not None:
            negative = self.negative.select(b.to(self.negative.embeds.device))
            out["negative_embeds"] = negative.embeds
            if negative.pooled is not None:
                out["negative_pooled"] = negative.pooled
        if self.frames is not None:
            frames = self.frames.select(b)
            out["frame_latents"] = frames.latents
            out["frame_indicator"] = frames.indicator
            out["frame_noise"] = frames.noise
        if self.ref_means is not None:
            out["ref_mean"] = self.ref_means[b, k]
        if self.data_clean is not None:
            assert self.data_noise is not None and self.data_sigma is not None
            out["data_clean"] = self.data_clean[b]
            out["data_noise"] = self.data_noise[b]
            out["data_sigma"] = self.data_sigma[b, k]
        return out

    def _tables(self) -> dict[str, torch.Tensor]:
        """Per-step and per-sample values on the trajectories' device (copied once)."""
        if self.device_tables is None:
            assert self.trajectories.states is not None
            device = self.trajectories.states.device
            self.device_tables = {
                "steps": torch.tensor(self.steps, dtype=torch.long, device=device),
                "sigmas": self.schedule.sigmas.to(device),
                "std_devs": self.std_devs.to(device),
                "advantages": self.advantages.to(device),
            }
        return self.device_tables


class MicroBatches(Sequence[FlowBatch]):
    """The micro-batches of ``size`` transitions of ``rows``, each assembled when the
    update reaches it (one micro-batch's gathered inputs alive at a time, not the whole
    optimizer step's)."""

    def __init__(self, data: RolloutData, rows: Sequence[Row], size: int) -> None:
        if size < 1:
            raise ValueError(f"micro-batch size must be positive (got {size})")
        self.data = data
        self.rows = list(rows)
        self.size = size
        self.b, self.k = data.indices(self.rows)  # one copy for the whole optimizer step

    def __len__(self) -> int:
        return -(-len(self.rows) // self.size)

    def __getitem__(self, index: int) -> FlowBatch:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        part = slice(index * self.size, (index + 1) * self.size)
        return self.data.gather(self.b[part], self.k[part])

    def __iter__(self) -> Iterator[FlowBatch]:
        for index in range(len(self)):
            yield self[index]
