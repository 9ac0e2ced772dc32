"""Stops a GRPO run in which no row of the data set encodes as a prompt.

Under ``data.on_bad_row = "skip"`` a prompt whose media cannot be read or that is longer
than ``model.max_length`` is skipped; when that is every row, each step would update
nothing and the run would "complete" with the starting weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl.core.errors import DataError
from reasonctl.core.protocols import streams_samples

if TYPE_CHECKING:
    from reasonctl.core.protocols import Backend, RunContext


class PromptsEncode:
    """Until the first prompt encodes on any rank, the ranks add up what they drew and
    encoded (one small all-reduce a round, the same rounds on every rank); once a whole
    data set's worth of rows is drawn without one, :meth:`check` raises a
    :class:`~reasonctl.core.errors.DataError` naming the skipped-row list."""

    def __init__(self) -> None:
        self.drawn = 0.0
        self.encoded = 0.0
        self.some = False

    def check(self, ctx: RunContext, backend: Backend, *, drawn: int, encoded: int) -> None:
        """Count this round's ``drawn`` and ``encoded`` prompts of this rank."""
        if self.some:
            return
        self.drawn += drawn
        self.encoded += encoded
        totals = backend.all_reduce_mean({"drawn": self.drawn, "encoded": self.encoded})
        if totals["encoded"] > 0:
            self.some = True
            return
        dataset = ctx.dataset
        if dataset is None or streams_samples(dataset):
            return
        rows = len(dataset)  # type: ignore[arg-type]
        if totals["drawn"] * backend.world_size >= rows:
            raise DataError(
                f"no prompt of the data set could be encoded (all {rows} rows read were "
                "skipped as bad), so there is nothing to train on; every bad row is listed in "
                f"{ctx.skipped_rows_file} (`reasonctl data check` names them too)"
            )
