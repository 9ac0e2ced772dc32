"""The completions of a prompt trained in one packed row that holds the prompt once.

A GRPO update trains on ``n`` completions of every prompt. Padded, each row repeats the
prompt: for a video prompt of a thousand vision tokens and ``n = 8`` most of the update's
work is the same prompt computed eight times (vision tower, rotary positions, every layer
forward and backward). Here a *unit* is one prompt followed by its completions,
``[prompt, c_1, ..., c_k]``, and a micro-batch is one row of several units:

- **Attention**: the prompt attends causally to itself; completion ``c_j`` attends to the
  prompt and causally to itself, never to another completion. That is one variable-length
  attention call per layer (:mod:`reasonctl.models.varlen_attention`): segment
  ``[prompt]`` with its own keys, and segment ``[c_j]`` whose keys are the prompt's
  followed by its own (gathered by :attr:`SharedPromptLayout.key_index`; the gather's
  backward adds every completion's gradient into the prompt's keys and values).
- **Positions**: the prompt's positions (Qwen-VL's 3D rotary positions included) are
  computed once; each completion continues from the prompt's last position, exactly as in
  its own padded row.
- **Scores**: the log-prob of completion token ``t`` comes from the hidden state of the
  token before it, which for ``t = 0`` is the prompt's last token (shared by the unit's
  completions); only completion tokens reach the output projection.

The log-probs are returned in the padded ``[B, T - 1]`` layout of the same rows, so losses
cannot tell the difference: the values and gradients equal the padded computation's up to
floating-point summation order (``tests/test_shared_prompt.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from reasonctl.data.processing import PER_TOKEN_EXTRAS
from reasonctl.models.packed_positions import GRID_KEYS, packed_rope_positions

LAYOUT_KWARG = "reasonctl_shared_prompt"
"""The keyword under which the layout travels through the model to its attention layers."""


@dataclass
class SharedPromptLayout:
    """Where every token of a packed row of units sits (see the module docstring).

    ``units`` lists, per unit, its prompt length and its completions' lengths; ``rows``
    gives, for each row of the padded batch (in order), its unit and completion index.
    The tensors are derived by :meth:`build`; ``width`` is ``T - 1`` of the padded batch.
    """

    units: list[tuple[int, list[int]]]
    width: int
    cu_q: torch.Tensor = field(repr=False)
    cu_k: torch.Tensor = field(repr=False)
    max_q: int = 0
    max_k: int = 0
    key_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    """Packed positions of each segment's keys, segments in order ``[Tk]``."""
    score_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    """Packed position whose hidden state scores each completion token ``[M]``."""
    target_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    """Packed position of each completion token ``[M]``."""
    output_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    """Row of the padded batch each completion token's log-prob goes to ``[M]``."""
    output_columns: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    """Its column in the ``[B, width]`` log-probs ``[M]``."""
    prompt_starts: list[int] = field(default_factory=list)
    completion_starts: list[list[int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens in the packed row."""
        return sum(p + sum(c) for p, c in self.units)

    @property
    def rows(self) -> int:
        """Rows of the padded batch (one per completion)."""
        return sum(len(c) for _, c in self.units)

    @classmethod
    def build(cls, units: Sequence[tuple[int, Sequence[int]]], width: int) -> SharedPromptLayout:
        """The layout of ``units`` (prompt length, completion lengths), rows in unit order."""
        q_lengths: list[int] = []
        k_lengths: list[int] = []
        key_index: list[int] = []
        score_index: list[int] = []
        target_index: list[int] = []
        output_rows: list[int] = []
        output_columns: list[int] = []
        prompt_starts: list[int] = []
        completion_starts: list[list[int]] = []
        position = 0
        row = 0
        for prompt_len, completions in units:
            if prompt_len < 1:
                raise ValueError("a shared-prompt unit needs at least one prompt token")
            prompt = list(range(position, position + prompt_len))
            prompt_starts.append(position)
            q_lengths.append(prompt_len)
            k_lengths.append(prompt_len)
            key_index += prompt
            position += prompt_len
            starts = []
            for length in completions:
                starts.append(position)
                own = list(range(position, position + length))
                if length:
                    q_lengths.append(length)
                    k_lengths.append(prompt_len + length)
                    key_index += prompt + own
                    score_index += [prompt[-1], *own[:-1]]
                    target_index += own
                    # padded row: the completion's tokens sit at prompt_len .. and are
                    # scored at positions prompt_len - 1 .. of the [B, T - 1] log-probs
                    output_rows += [row] * length
                    output_columns += range(prompt_len - 1, prompt_len - 1 + length)
                position += length
                row += 1
            completion_starts.append(starts)
        cu_q = torch.tensor([0, *_cumsum(q_lengths)], dtype=torch.int32)
        cu_k = torch.tensor([0, *_cumsum(k_lengths)], dtype=torch.int32)
        return cls(
            units=[(p, list(c)) for p, c in units], width=width, cu_q=cu_q, cu_k=cu_k,
            max_q=max(q_lengths, default=0), max_k=max(k_lengths, default=0),
            key_index=torch.tensor(key_index, dtype=torch.long),
            score_index=torch.tensor(score_index, dtype=torch.long),
            target_index=torch.tensor(target_index, dtype=torch.long),
            output_rows=torch.tensor(output_rows, dtype=torch.long),
            output_columns=torch.tensor(output_columns, dtype=torch.long),
            prompt_starts=prompt_starts, completion_starts=completion_starts,
        )

    def to(self, device: torch.device | str) -> SharedPromptLayout:
        """The layout with its tensors on ``device``."""
        return replace(self, cu_q=self.cu_q.to(device), cu_k=self.cu_k.to(device),
                       key_index=self.key_index.to(device),
                       score_index=self.score_index.to(device),
                       target_index=self.target_index.to(device),
                       output_rows=self.output_rows.to(device),
                       output_columns=self.output_columns.to(device))

    def text_positions(self) -> torch.Tensor:
        """``[N]`` positions of a text-only model: each completion continues its prompt."""
        out = torch.empty(self.length, dtype=torch.long)
        for (prompt_len, completions), start, starts in zip(
                self.units, self.prompt_starts, self.completion_starts, strict=True):
            out[start:start + prompt_len] = torch.arange(prompt_len)
            for length, first in zip(completions, starts, strict=True):
                out[first:first + length] = torch.arange(prompt_len, prompt_len + length)
        return out

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """Per-completion-token ``values`` (``[M]``) placed in a zero ``[B, width]`` tensor."""
        zeros = values.new_zeros((self.rows, self.width))
        return zeros.index_put((self.output_rows, self.output_columns), values)


@dataclass
class SharedPromptInputs:
    """The model inputs of a packed row of units: ``input_ids`` ``[1, N]``, the units'
    prompts' vision tensors (in unit order, as the model consumes them) and per-token
    extras laid out like ``input_ids``."""

    input_ids: torch.Tensor
    layout: SharedPromptLayout
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> SharedPromptInputs:
        """The inputs with every tensor on ``device``."""
        return SharedPromptInputs(
            self.input_ids.to(device, non_blocking=True), self.layout.to(device),
            {k: v.to(device, non_blocking=True) for k, v in self.extras.items()})


def rope_positions(decoder: Any, inputs: SharedPromptInputs) -> torch.Tensor:
    """``[3, N]`` rotary positions of a Qwen-VL-style model: the model's own
    ``get_rope_index`` over the prompts alone (once per prompt), then each completion
    continuing from its prompt's largest position."""
    layout = inputs.layout
    ids = inputs.input_ids[0]
    if not any(inputs.extras.get(key) is not None for key in GRID_KEYS):  # text prompts only
        return layout.text_positions().to(ids.device).expand(3, -1)
    prompt_index = torch.cat([torch.arange(start, start + p) for (p, _), start
                              in zip(layout.units, layout.prompt_starts, strict=True)])
    prompt_index = prompt_index.to(ids.device)
    prompts: dict[str, Any] = {
        "input_ids": ids.index_select(0, prompt_index).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(p) for p, _ in layout.units])
        .to(ids.device).unsqueeze(0),
    }
    for key, value in inputs.extras.items():
        if key in PER_TOKEN_EXTRAS:
            prompts[key] = value.index_select(1, prompt_index)
        else:
            prompts[key] = value
    prompt_rope = packed_rope_positions(decoder, prompts)[1:, 0]  # [3, prompt tokens]
    out = prompt_rope.new_empty((3, layout.length))
    offset = 0
    for (prompt_len, completions), start, starts in zip(
            layout.units, layout.prompt_starts, layout.completion_starts, strict=True):
        own = prompt_rope[:, offset:offset + prompt_len]
        out[:, start:start + prompt_len] = own
        following = int(own.max()) + 1
        for length, first in zip(completions, starts, strict=True):
            out[:, first:first + length] = torch.arange(
                following, following + length, device=out.device)
        offset += prompt_len
    return out


def _cumsum(values: Sequence[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out
