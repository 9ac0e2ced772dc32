"""Which checkpoints descend from which: write order and parents, from the manifests.

Every checkpoint's manifest holds ``lineage = {"id", "parent", "parent_step", "serial"}``:
its own id, the id and step of the checkpoint the run had written (or resumed from) before
it, and its place in the order checkpoints were written in this directory. The *current
lineage* of a checkpoint is the chain of its ancestors; pruning deletes only ancestors
beyond ``checkpoint.keep``, and resuming from a checkpoint retires (moves aside) every
checkpoint that is not one of its ancestors, so a later resume can never pick up an
abandoned branch.

Checkpoints written before manifests had a lineage are read as one straight line: the
parent of such a checkpoint is the next lower step among them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar


class HasManifest(Protocol):
    """A checkpoint as :mod:`reasonctl.core.checkpoint` describes it."""

    step: int
    manifest: dict[str, Any]


T = TypeVar("T", bound=HasManifest)


def lineage_of(info: HasManifest) -> dict[str, Any] | None:
    """The manifest's ``lineage`` record, or ``None`` for a checkpoint written before them."""
    record = info.manifest.get("lineage")
    return record if isinstance(record, dict) else None


def write_order(info: HasManifest) -> tuple[int, int]:
    """Sort key: checkpoints without a lineage first (by step), then by write serial."""
    record = lineage_of(info)
    serial = record.get("serial") if record else None
    return (int(serial) if isinstance(serial, int) else 0, info.step)


def ancestors(head: T, candidates: Iterable[T]) -> list[T]:
    """``head`` and its ancestors among ``candidates``, newest first."""
    pool = list(candidates)
    by_id = {r["id"]: c for c in pool if (r := lineage_of(c)) and r.get("id")}
    chain = [head]
    seen = {id(head)}
    current: T | None = head
    while current is not None:
        current = _parent(current, pool, by_id)
        if current is None or id(current) in seen:
            break
        seen.add(id(current))
        chain.append(current)
    return chain


def _parent(info: T, pool: Sequence[T], by_id: dict[str, T]) -> T | None:
    record = lineage_of(info)
    legacy = [c for c in pool if lineage_of(c) is None]
    if record is not None:
        parent, parent_step = record.get("parent"), record.get("parent_step")
        if parent:
            return by_id.get(parent)
        if parent_step is None:  # the start of a lineage
            return None
        # resumed from a checkpoint written before lineages
        return next((c for c in legacy if c.step == parent_step), None)
    older = [c for c in legacy if c.step < info.step]
    return max(older, key=lambda c: c.step) if older else None


def next_serial(infos: Iterable[HasManifest]) -> int:
    """The serial the next checkpoint written in this directory gets."""
    return max((write_order(info)[0] for info in infos), default=0) + 1
