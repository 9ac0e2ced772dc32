"""Building blocks for RL algorithms: completions as training rows and padded policy batches.

After a rollout and an advantage estimate, a policy-gradient update trains on one row per
completion: the prompt's tokens (no loss) followed by the completion's tokens (loss, unless
masked). :func:`policy_rows` builds those rows from :class:`RolloutGroup` objects and one
advantage per completion; :func:`collate_policy_rows` pads a list of rows into a
:class:`~reasonctl.core.types.PolicyBatch` whose per-token tensors are aligned with the
backend's log-probs (``[B, T-1]``: position ``t`` scores token ``t + 1``). Typical use::

    rows = policy_rows(groups, advantages)
    batches = [collate_policy_rows(chunk, ctx.processor.pad_id)
               for chunk in chunked(rows, ctx.config.train.micro_batch_size)]
    metrics = ctx.backend.train_step(batches, loss_fn)

A backend that runs shared-prompt rows (:class:`~reasonctl.core.protocols.RunsSharedPrompts`)
takes :func:`shared_prompt_micro_batches` instead: each micro-batch holds whole prompts with
their completions, the prompt once (:mod:`reasonctl.models.shared_prompt`), up to a token
budget rather than a row count; the per-row tensors a loss reads are laid out as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from reasonctl.core.types import Completion, PolicyBatch, RolloutGroup
from reasonctl.data.collate import collate_shared_media
from reasonctl.data.processing import PER_TOKEN_EXTRAS, EncodedSample
from reasonctl.models.shared_prompt import SharedPromptInputs, SharedPromptLayout

if TYPE_CHECKING:
    from reasonctl.core.protocols import TokenOutputs

T = TypeVar("T")


@dataclass
class PolicyRow:
    """One completion prepared for training: its group, tokens, advantage and log-probs.

    ``old_logprobs`` / ``ref_logprobs`` hold one value per completion token once computed
    (see :func:`store_completion_logprobs`); ``group`` is the index of the prompt group.
    """

    group: int
    encoded: EncodedSample
    prompt_len: int
    completion: Completion
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    @property
    def completion_len(self) -> int:
        """Number of completion tokens."""
        return len(self.completion.token_ids)

    @property
    def completion_span(self) -> slice:
        """Where this row's completion tokens are scored in a ``[B, T-1]`` log-prob row."""
        return slice(self.prompt_len - 1, self.prompt_len - 1 + self.completion_len)


def policy_rows(
    groups: Sequence[RolloutGroup],
    advantages: Sequence[float],
    *,
    mask_truncated: bool = False,
) -> list[PolicyRow]:
    """One :class:`PolicyRow` per completion, in group order.

    ``advantages`` holds one value per completion (groups concatenated). Each group must
    carry its encoded prompt (``group.prompt``, set by :func:`reasonctl.sample_groups`).
    With ``mask_truncated`` completions cut at ``max_new_tokens`` carry no loss (DAPO's
    overlong filtering). Tokens a multi-turn environment appended (``completion.loss_mask``
    0: observations) never carry loss.
    """
    count = sum(len(g.completions) for g in groups)
    if len(advantages) != count:
        raise ValueError(f"policy_rows got {len(advantages)} advantages for {count} completions")
    rows: list[PolicyRow] = []
    flat = iter(advantages)
    for index, group in enumerate(groups):
        prompt = group.prompt
        if not isinstance(prompt, EncodedSample):
            raise ValueError(
                f"rollout group {index} carries no encoded prompt; sample it with "
                "reasonctl.sample_groups (or set group.prompt to the EncodedSample)"
            )
        group.advantages = []
        for completion in group.completions:
            advantage = float(next(flat))
            group.advantages.append(advantage)
            carries_loss = not (mask_truncated and completion.finish_reason == "length")
            ids = list(prompt.input_ids) + list(completion.token_ids)
            mask = [0] * len(prompt.input_ids) + [int(carries_loss) * m
                                                  for m in generated_mask(completion)]
            encoded = EncodedSample(ids, mask, _extend_per_token(prompt.extras, len(ids)),
                                    num_prompt_tokens=len(prompt.input_ids))
            rows.append(PolicyRow(index, encoded, len(prompt.input_ids), completion, advantage))
    return rows


def collate_policy_rows(rows: Sequence[PolicyRow], pad_id: int) -> PolicyBatch:
    """Pad rows into a :class:`PolicyBatch` (``advantages``, ``completion_mask``: 1 on the
    tokens the policy generated, ``engine_logprobs``, and ``old_logprobs``/``ref_logprobs``
    when every row has them).

    Rows of one prompt share its vision inputs: they are in the batch once, and the
    backend runs the vision tower once per prompt
    (:func:`~reasonctl.data.collate.collate_shared_media`)."""
    batch: Any = collate_shared_media([r.encoded for r in rows], pad_id)
    _add_row_tensors(batch, rows, batch["input_ids"].shape[1] - 1)
    return batch


SHARED_PROMPT_KEY = "shared_prompt"
"""The batch key holding a shared-prompt batch's model inputs (:class:`SharedPromptInputs`)."""


def shared_prompt_micro_batches(rows: Sequence[PolicyRow], pad_id: int, *, budget: int,
                                count: int | None = None
                                ) -> list[tuple[list[PolicyRow], PolicyBatch]]:
    """Micro-batches of whole prompts with their completions, each at most ``budget``
    tokens (a unit larger than that on its own goes alone), with the rows each holds.

    A unit is a prompt followed by completions of its group (:mod:`~reasonctl.models.
    shared_prompt`); a group whose prompt and completions exceed ``budget`` is split into
    several units, each with the prompt. Rows keep their order within a group; groups keep
    their order of first appearance. With ``count`` (at least the number the budget needs,
    at most the number of rows) the largest micro-batches are split until there are exactly
    ``count``: data-parallel ranks must run the same number of forward passes.
    """
    if budget <= 0:
        raise ValueError(f"the micro-batch token budget must be positive (got {budget})")
    groups: dict[int, list[PolicyRow]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    units: list[list[PolicyRow]] = []
    for members in groups.values():
        prompt_len = members[0].prompt_len
        unit: list[PolicyRow] = []
        size = prompt_len
        for row in members:
            if unit and size + row.completion_len > budget:
                units.append(unit)
                unit, size = [], prompt_len
            unit.append(row)
            size += row.completion_len
        units.append(unit)
    packs: list[list[list[PolicyRow]]] = []
    size = 0
    for unit in units:
        tokens = _unit_tokens(unit)
        if not packs or size + tokens > budget:
            packs.append([])
            size = 0
        packs[-1].append(unit)
        size += tokens
    if count is not None:
        if not len(packs) <= count <= len(rows):
            raise ValueError(f"cannot make {count} micro-batches of {len(rows)} rows under a "
                             f"budget that needs {len(packs)}")
        while len(packs) < count:
            _split_largest(packs)
    return [_shared_prompt_batch(pack, pad_id) for pack in packs]


def _unit_tokens(unit: Sequence[PolicyRow]) -> int:
    return unit[0].prompt_len + sum(r.completion_len for r in unit)


def _split_largest(packs: list[list[list[PolicyRow]]]) -> None:
    """Split the micro-batch of most tokens that holds more than one row in two."""
    splittable = [i for i, p in enumerate(packs) if sum(len(u) for u in p) > 1]
    index = max(splittable, key=lambda i: sum(_unit_tokens(u) for u in packs[i]))
    pack = packs[index]
    if len(pack) > 1:
        half = len(pack) // 2
        packs[index:index + 1] = [pack[:half], pack[half:]]
    else:
        unit = pack[0]
        half = len(unit) // 2
        packs[index:index + 1] = [[unit[:half]], [unit[half:]]]


def _shared_prompt_batch(units: list[list[PolicyRow]], pad_id: int
                         ) -> tuple[list[PolicyRow], PolicyBatch]:
    """One micro-batch: the per-row tensors of :func:`collate_policy_rows` (padded
    ``input_ids`` and ``loss_mask``, no model inputs) and the packed row under
    :data:`SHARED_PROMPT_KEY`."""
    rows = [r for unit in units for r in unit]
    width = max(len(r.encoded.input_ids) for r in rows)
    shape = (len(rows), width)
    batch: Any = {"input_ids": torch.full(shape, pad_id, dtype=torch.long),
                  "loss_mask": torch.zeros(shape, dtype=torch.long)}
    for i, row in enumerate(rows):
        length = len(row.encoded.input_ids)
        batch["input_ids"][i, :length] = torch.tensor(row.encoded.input_ids)
        batch["loss_mask"][i, :length] = torch.tensor(row.encoded.loss_mask)
    ids: list[int] = []
    per_token: dict[str, list[torch.Tensor]] = {}
    media: dict[str, list[torch.Tensor]] = {}
    token_keys = sorted({k for r in rows for k in r.encoded.extras if k in PER_TOKEN_EXTRAS})
    for unit in units:
        first = unit[0]
        prompt = first.encoded.input_ids[: first.prompt_len]
        if any(r.encoded.input_ids[: r.prompt_len] != prompt for r in unit[1:]):
            raise ValueError(f"the rows of group {first.group} do not share one prompt")
        ids += prompt
        for key in token_keys:
            value = first.encoded.extras.get(key)
            part = (value[: first.prompt_len] if value is not None
                    else torch.zeros(first.prompt_len, dtype=torch.long))
            per_token.setdefault(key, []).append(part)
        for row in unit:
            ids += row.completion.token_ids
            for key in token_keys:
                per_token[key].append(torch.zeros(row.completion_len, dtype=torch.long))
        for key, value in first.encoded.extras.items():
            if key not in PER_TOKEN_EXTRAS:
                media.setdefault(key, []).append(value)
    extras = {k: torch.cat(v).unsqueeze(0) for k, v in per_token.items()}
    extras.update({k: torch.cat(v, dim=0) for k, v in media.items()})
    layout = SharedPromptLayout.build(
        [(u[0].prompt_len, [r.completion_len for r in u]) for u in units], width - 1)
    batch[SHARED_PROMPT_KEY] = SharedPromptInputs(torch.tensor([ids], dtype=torch.long),
                                                  layout, extras)
    _add_row_tensors(batch, rows, width - 1)
    return rows, batch


def _add_row_tensors(batch: Any, rows: Sequence[PolicyRow], width: int) -> None:
    """The per-row tensors a policy loss reads (see :func:`collate_policy_rows`)."""
    batch["advantages"] = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    batch["engine_logprobs"] = aligned(
        rows, [torch.tensor(r.completion.logprobs) for r in rows], width
    )
    batch["completion_mask"] = aligned(
        rows, [torch.tensor(generated_mask(r.completion), dtype=torch.float32) for r in rows],
        width)
    for key in ("old_logprobs", "ref_logprobs"):
        values = [getattr(r, key) for r in rows]
        if all(v is not None for v in values):
            batch[key] = aligned(rows, values, width)


def generated_mask(completion: Completion) -> list[int]:
    """1 for each token the policy generated, 0 for tokens an environment appended."""
    if completion.loss_mask is None:
        return [1] * len(completion.token_ids)
    if len(completion.loss_mask) != len(completion.token_ids):
        raise ValueError(f"a completion has {len(completion.token_ids)} tokens but a loss mask "
                         f"of {len(completion.loss_mask)}")
    return [int(m) for m in completion.loss_mask]


def aligned(rows: Sequence[PolicyRow], values: Sequence[Any], width: int) -> torch.Tensor:
    """Per-completion-token values placed at their ``[B, T-1]`` log-prob positions."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, value) in enumerate(zip(rows, values, strict=True)):
        out[i, row.completion_span] = value
    return out


def store_completion_logprobs(rows: Sequence[PolicyRow], outputs: TokenOutputs, key: str) -> None:
    """Keep each row's completion log-probs from ``outputs`` (a batch of exactly ``rows``)
    as ``row.old_logprobs`` (``key="old_logprobs"``) or ``row.ref_logprobs``."""
    if key not in ("old_logprobs", "ref_logprobs"):
        raise ValueError(f"key must be 'old_logprobs' or 'ref_logprobs', not {key!r}")
    for i, row in enumerate(rows):
        setattr(row, key, outputs.logprobs[i, row.completion_span].detach().float().cpu())


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    """``items`` in consecutive chunks of ``size`` (the last may be shorter)."""
    if size <= 0:
        raise ValueError(f"chunk size must be positive (got {size})")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _extend_per_token(extras: dict[str, Any], length: int) -> dict[str, Any]:
    """Prompt extras for prompt + completion: per-token ones (token types) padded with 0."""
    out = dict(extras)
    for key in PER_TOKEN_EXTRAS & out.keys():
        value = out[key]
        out[key] = torch.cat([value, value.new_zeros(length - value.shape[-1])])
    return out
