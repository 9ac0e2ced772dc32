"""The ``llava`` dataset format: LLaVA instruction data (a JSON array or JSON Lines).

Each row has ``conversations`` (turns ``{"from": "human"|"gpt"|"system", "value": ...}``)
and optionally ``image`` / ``images`` / ``video`` / ``videos`` (a path or a list of
paths). ``<image>`` and ``<video>`` tags in the text mark where each file goes, in order;
without tags the files go before the first human turn. Relative media paths resolve
against ``media_root`` (default: the annotation file's directory). Other keys, such as
``id``, are kept in ``Sample.meta``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from reasonctl.core.config import InputPath
from reasonctl.data.formats.media_options import MediaOptions

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.types import Sample
    from reasonctl.data.datasets import ListDataset
    from reasonctl.data.messages import MediaResolver


class LlavaConfig(MediaOptions):
    """``[data.llava]``: the annotation file(s) and media defaults."""

    path: Annotated[str | list[str] | None, InputPath("file", required=True)] = Field(
        default=None, description="LLaVA annotation file (JSON array or JSONL), or a list."
    )


def build_llava_dataset(
    config: LlavaConfig | None, *, ctx: RunContext | None = None
) -> ListDataset:
    """LLaVA-style conversations with ``<image>``/``<video>`` tags."""
    from reasonctl.core.errors import ConfigError
    from reasonctl.data.rows import RowOptions, as_path_list, build_samples, read_json_rows

    config = config or LlavaConfig()
    if config.path is None:
        raise ConfigError(["data.llava.path: not set; point it at the LLaVA annotation JSON "
                           "(data.format = 'llava')"])
    paths = as_path_list(config.path, "data.llava.path")
    resolvers = {path: config.resolver(path.parent, "llava") for path in paths}
    rows = (row for path in paths for row in read_json_rows(path))
    return build_samples(
        rows,
        lambda row: llava_sample(row.value, resolvers[row.file]),
        RowOptions.from_context(ctx),
    )


def llava_sample(record: Any, media: MediaResolver) -> Sample:
    """One LLaVA row as a sample (``conversations`` is required)."""
    from reasonctl.data.messages import RowProblem, sample_from_record

    if not isinstance(record, dict) or "conversations" not in record:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise RowProblem(f"LLaVA rows need a 'conversations' list (found: {keys})")
    return sample_from_record(record, media)

