"""Reference-policy weights for KL penalties, kept beside the trained parameters.

A backend saves a frozen copy of its parameters (in their own layout, sharded or not) and,
to score a batch under the reference policy, swaps the copy into the parameters for one
forward pass and swaps it back. The swap goes one parameter at a time, so it costs the
memory of one parameter beyond the copy itself, and needs no second model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


class ReferenceWeights:
    """A frozen copy of parameters that can be swapped into them temporarily.

    ``parameters`` returns the live parameters in a fixed order each time it is called;
    ``before_swap`` runs before each swap (e.g. FSDP resharding, so the next forward pass
    gathers the swapped values).
    """

    def __init__(self, parameters: Callable[[], Iterator[torch.Tensor]],
                 before_swap: Callable[[], None] | None = None) -> None:
        self._parameters = parameters
        self._before_swap = before_swap or (lambda: None)
        self._before_swap()
        with torch.no_grad():
            self.saved = [p.detach().clone() for p in parameters()]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within this block the parameters hold the reference weights."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        self._before_swap()
        with torch.no_grad():
            for param, reference in zip(self._parameters(), self.saved, strict=True):
                held = param.detach().clone()
                param.copy_(reference)
                reference.copy_(held)
