"""Markers that config models put on their fields so pre-flight checks find them.

A plugin author marks the local paths a component reads::

    from typing import Annotated
    from reasonctl.core.config import InputFile, InputPath

    class MyDataConfig(BaseModel):
        path: Annotated[str | None, InputPath("file", required=True)] = None
        vocab: InputFile = "vocab.txt"

and ``reasonctl config validate`` (and ``reasonctl run`` before it loads a model) reports a
missing file, a directory where a file was expected, or an unset required path, for
first-party and third-party components alike. Only the sections of the components a
config selects are checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

PathKind = Literal["file", "dir", "any"]


@dataclass(frozen=True)
class InputPath:
    """A field holding local path(s) that must exist before a run starts.

    ``kind`` is what each path must be: a ``"file"``, a ``"dir"``ectory or ``"any"``.
    ``required`` makes an unset value (``None``) a problem when the component is used.
    The value may be a string, a list of strings or a mapping whose values are strings.
    """

    kind: PathKind = "file"
    required: bool = False


InputFile = Annotated[str, InputPath("file")]
"""A string field holding the path of an existing file."""

InputDir = Annotated[str, InputPath("dir")]
"""A string field holding the path of an existing directory."""
