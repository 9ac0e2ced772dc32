"""From samples to what the transformer is conditioned on: text conditions and media.

A diffusion sample is an ordinary :class:`~reasonctl.core.types.Sample`: the prompt is the
text of its last user message, its media (the real video or image of DDRL's data term,
or the conditioning frames of image/video-to-world) is the first image or video part of
its prompt, and ``meta["text_embedding"]`` may name a file of precomputed embeddings.

:class:`TextConditioner` gives one condition row per sample: the precomputed embeddings
when a sample has them (a safetensors file with ``prompt_embeds`` ``[L, D]`` and, for SD3,
``pooled_prompt_embeds`` ``[P]``; a ``.pickle`` only when the data format allowed it,
since unpickling runs code), otherwise the pipeline's own text encoder, loaded on first
use. Widths are checked against the model; a wrong one is a ``file: reason`` error.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reasonctl.core.errors import DataError
from reasonctl.core.types import Sample
from reasonctl.diffusion.adapters.base import ModelAdapter, TextCondition, TextEncoder

TEXT_EMBEDDING = "text_embedding"
"""``Sample.meta`` key naming a precomputed text embedding file."""
EMBEDDING_KEY = "prompt_embeds"
POOLED_KEY = "pooled_prompt_embeds"
PICKLE_SUFFIXES = (".pickle", ".pkl")
CACHE_SIZE = 256


def prompt_text(sample: Sample) -> str:
    """The text of the sample's last user message (its prompt)."""
    for message in reversed(sample.prompt_messages()):
        if message.role == "user":
            return message.text.strip()
    return ""


def media_path(sample: Sample) -> str | None:
    """The first image or video file of the sample's prompt, if any."""
    for message in sample.prompt_messages():
        for part in message.content:
            if part.type in ("image", "video") and part.path:
                return part.path
    return None


def embedding_path(sample: Sample) -> str | None:
    """The precomputed text embedding file of the sample, if any."""
    value = sample.meta.get(TEXT_EMBEDDING) if isinstance(sample.meta, dict) else None
    return str(value) if value else None


class TextConditioner:
    """Text conditions for samples and prompts (see the module docstring)."""

    def __init__(self, adapter: ModelAdapter, *, device: torch.device, dtype: torch.dtype,
                 max_tokens: int | None, allow_pickle: bool = False) -> None:
        self.adapter = adapter
        self.device = device
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.allow_pickle = allow_pickle
        self._encoder: TextEncoder | None = None
        self._cache: OrderedDict[str, TextCondition] = OrderedDict()

    def for_samples(self, samples: Sequence[Sample]) -> TextCondition:
        """One row per sample, in order."""
        rows: list[TextCondition | None] = []
        to_encode: dict[int, str] = {}
        for index, sample in enumerate(samples):
            path = embedding_path(sample)
            if path is None:
                rows.append(None)
                to_encode[index] = prompt_text(sample)
            else:
                rows.append(self.load_embedding(Path(path)))
        if to_encode:
            encoded = self.for_prompts(list(to_encode.values()))
            for row, index in enumerate(to_encode):
                rows[index] = encoded.select([row])
        return TextCondition.cat([r for r in rows if r is not None])

    def for_prompts(self, prompts: Sequence[str]) -> TextCondition:
        """One row per prompt from the pipeline's encoder (cached by prompt).

        Prompts are encoded one at a time: a prompt's embedding then does not depend on the
        other prompts of a batch (float sums differ with batch shapes), so a resumed run
        conditions exactly like the uninterrupted one, cache or no cache.
        """
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._cache:
                self._cache[prompt] = self.encoder().encode([prompt]).to(self.device, self.dtype)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return TextCondition.cat([self._cache[p] for p in prompts])

    def encoder(self) -> TextEncoder:
        """The pipeline's text encoder, loaded once."""
        if self._encoder is None:
            self._encoder = self.adapter.load_text_encoder(self.device, self.dtype,
                                                           self.max_tokens)
        return self._encoder

    def load_embedding(self, path: Path) -> TextCondition:
        """A precomputed embedding file, checked against the model's widths."""
        if not path.is_file():
            raise DataError(f"{path}: text embedding file not found")
        if path.suffix.lower() in PICKLE_SUFFIXES:
            embeds, pooled = self._load_pickle(path), None
        else:
            embeds, pooled = _load_safetensors(path)
        width, pooled_width = self.adapter.text_dims()
        if embeds.ndim == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.ndim != 2 or embeds.shape[1] != width:
            raise DataError(
                f"{path}: {EMBEDDING_KEY} has shape {list(embeds.shape)}, but "
                f"{self.adapter.transformer_class} takes [tokens, {width}]; recompute the "
                "embeddings with this model's text encoder")
        if pooled_width is not None:
            if pooled is None or pooled.reshape(-1).shape[0] != pooled_width:
                got = "none" if pooled is None else f"shape {list(pooled.shape)}"
                raise DataError(f"{path}: {POOLED_KEY} ({got}) must hold {pooled_width} "
                                f"values for {self.adapter.transformer_class}")
            pooled = pooled.reshape(1, -1)
        else:
            pooled = None
        condition = TextCondition(embeds[None], pooled)
        return condition.to(self.device, self.dtype)

    def _load_pickle(self, path: Path) -> torch.Tensor:
        if not self.allow_pickle:
            raise DataError(
                f"{path}: pickled text embeddings run code when loaded; convert them to "
                "safetensors, or set data.video_text.allow_pickle = true for files you trust")
        import pickle

        with path.open("rb") as handle:
            value: Any = pickle.load(handle)  # only with allow_pickle = true
        if isinstance(value, dict):
            value = value.get(EMBEDDING_KEY, next(iter(value.values()), None))
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, dict):  # cosmos-rl: [{"<caption type>": array}, ...]
            value = next(iter(value.values()), None)
        if value is None:
            raise DataError(f"{path}: no embedding array in the pickle")
        return torch.as_tensor(np.asarray(value), dtype=torch.float32)


def _load_safetensors(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DataError(f"{path}: not a readable safetensors file ({exc})") from None
    if EMBEDDING_KEY not in tensors:
        raise DataError(f"{path}: no {EMBEDDING_KEY!r} tensor (found: "
                        f"{', '.join(sorted(tensors)) or 'none'})")
    return tensors[EMBEDDING_KEY].float(), tensors.get(POOLED_KEY)


def load_frames(samples: Sequence[Sample], *, frames: int, height: int, width: int,
                what: str) -> torch.Tensor:
    """uint8 ``[B, F, H, W, 3]`` media of ``samples`` (see :mod:`.media`); a sample without
    media or an unreadable file is a ``file: reason`` error naming ``what`` needs it."""
    from reasonctl.diffusion.media import load_media

    clips = []
    for sample in samples:
        path = media_path(sample)
        if path is None:
            raise DataError(f"{sample.source or '<sample>'}: {what} needs a video or image in "
                            "each sample, this one has none")
        try:
            clips.append(load_media(path, frames=frames, height=height, width=width))
        except ValueError as exc:
            raise DataError(f"{path}: {exc}") from None
    return torch.from_numpy(np.stack(clips))


def drop_unfit_embeddings(ctx: Any, dataset: Any, adapter: ModelAdapter) -> Any:
    """``dataset`` without the samples whose precomputed embeddings the model cannot take,
    checked up front from the safetensors headers (not at the step that would draw them):
    an error naming every such file, or, under ``data.on_bad_row = "skip"``, those samples
    left out and counted."""
    from reasonctl.data.datasets import ListDataset

    if not hasattr(dataset, "__len__"):
        return dataset  # streamed: each file is checked when it is loaded
    samples = [dataset[i] for i in range(len(dataset))]
    bad: dict[int, tuple[str, str]] = {}
    for index, sample in enumerate(samples):
        path = embedding_path(sample)
        if path is not None and not path.lower().endswith(PICKLE_SUFFIXES):
            problem = _header_problem(Path(path), adapter)
            if problem is not None:
                bad[index] = (path, problem)
    if not bad:
        return dataset
    if ctx.config.data.on_bad_row != "skip":
        listing = "\n  ".join(f"{path}: {problem}" for path, problem in bad.values())
        raise DataError(f"{len(bad)} text embedding file(s) do not fit "
                        f"{adapter.transformer_class}; recompute them with this model's text "
                        "encoder, or delete them to encode the captions (data.on_bad_row = "
                        f"\"skip\" leaves their samples out):\n  {listing}")
    for path, problem in bad.values():
        ctx.record_skipped_row(path, problem)
    return ListDataset([s for i, s in enumerate(samples) if i not in bad])


def _header_problem(path: Path, adapter: ModelAdapter) -> str | None:
    from safetensors import SafetensorError, safe_open

    width, pooled_width = adapter.text_dims()
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            shape = list(handle.get_slice(EMBEDDING_KEY).get_shape()) \
                if EMBEDDING_KEY in keys else None
            pooled = list(handle.get_slice(POOLED_KEY).get_shape()) if POOLED_KEY in keys \
                else None
    except (SafetensorError, OSError) as exc:
        return f"not a readable safetensors file ({exc})"
    if shape is None:
        return f"no {EMBEDDING_KEY!r} tensor"
    if shape[-1] != width:
        return (f"{EMBEDDING_KEY} has shape {shape}, but {adapter.transformer_class} takes "
                f"[tokens, {width}]")
    if pooled_width is not None and (pooled is None or int(np.prod(pooled)) != pooled_width):
        got = "none" if pooled is None else f"shape {pooled}"
        return f"{POOLED_KEY} ({got}) must hold {pooled_width} values"
    return None
