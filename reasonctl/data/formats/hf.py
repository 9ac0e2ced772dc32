"""The ``hf`` dataset format: Hugging Face ``datasets`` by name, local directory or files.

Where the data comes from, in order of precedence:

- ``data_files``: local JSON/JSONL/CSV/Parquet/Arrow files (the builder follows the
  extension);
- ``name`` pointing at a directory written by ``Dataset.save_to_disk`` (or
  ``DatasetDict.save_to_disk``), or at one data file (read as ``data_files``);
- ``name`` pointing at any other local directory of data files, or a dataset on the Hub
  (``subset`` picks its configuration; downloads use the usual Hugging Face cache).

``split`` accepts slicing such as ``train[:100]``, ``train[10:20]`` or ``train[:5%]``.
Rows use the layouts of :mod:`reasonctl.data.messages` (Cosmos-Reason1 SFT rows with
``conversations`` stored as JSON text, Cosmos-Reason1 RL rows with ``qa_pairs``);
``columns`` maps those names to the dataset's columns, e.g. ``columns = {prompt =
"question", reference = "label", video = "video_path"}``, and ``prompt``/``answer``
templates build samples from other columns
(:mod:`reasonctl.data.formats.row_mapping`). Image columns stored as images (bytes) are
written once to the reasonctl cache so the sample can refer to a file. Errors name rows as
``<dataset>[<split>]:<index>``. The format's factory is
:func:`reasonctl.data.formats.hf_dataset.build_hf_dataset`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from reasonctl.data.formats.row_mapping import RowMappingOptions

if TYPE_CHECKING:
    from reasonctl.core.types import Sample

MEDIA_FIELDS = ("image", "images", "video", "videos")
BUILDERS = {
    ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
    ".arrow": "arrow",
}
SPLIT_PATTERN = re.compile(
    r"^(?P<name>[\w.-]+)(\[(?P<start>-?\d+%?)?:(?P<end>-?\d+%?)?\])?$"
)


class HfConfig(RowMappingOptions):
    """``[data.hf]``: which dataset, split and columns to read."""

    name: str | None = Field(
        default=None,
        description="Hub dataset name, a save_to_disk directory or a folder of data files.",
    )
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        default=None, description="Local data files (JSON/JSONL/CSV/Parquet/Arrow)."
    )
    subset: str | None = Field(default=None, description="Dataset configuration name.")
    split: str = Field(default="train", description="Split, with optional slicing.")
    revision: str | None = Field(default=None, description="Hub revision to load.")
    streaming: bool = Field(
        default=False,
        description="Stream the rows (datasets' IterableDataset) instead of loading the split: "
        "split over ranks by datasets.distributed, resumable positions in checkpoints.",
    )
    shuffle_buffer: int = Field(
        default=0, ge=0,
        description="With streaming and data.shuffle: rows mixed in datasets' shuffle buffer "
        "(a resumed run skips the rows that were in it; 0 resumes exactly).",
    )
    samples_per_epoch: int | None = Field(
        default=None, gt=0,
        description="With streaming: rows of one epoch, to turn train.epochs into steps.",
    )

    @field_validator("split")
    @classmethod
    def _check_split(cls, split: str) -> str:
        if not SPLIT_PATTERN.match(split):
            raise ValueError(
                f"{split!r} is not a split name with optional slicing, e.g. 'train', "
                "'train[:100]', 'test[10:20]' or 'train[:5%]'"
            )
        return split


def row_sample(row: dict[str, Any], config: HfConfig, media: Any) -> Sample:
    """The sample of one dataset row: columns renamed through ``columns``, media values
    turned into files."""
    from reasonctl.data.messages import sample_from_record

    record = config.map_row(row)
    for field in MEDIA_FIELDS:
        if record.get(field) is not None:
            record[field] = _media_paths(record[field])
    return sample_from_record(record, media)


def _load_split(datasets: Any, config: HfConfig) -> tuple[Any, str, Path, int]:
    """The selected split, a label for errors, the media base and the first row's index."""
    from reasonctl.core.errors import DataError

    split_name = SPLIT_PATTERN.match(config.split).group("name")  # type: ignore[union-attr]
    if config.data_files is None and config.name is not None \
            and Path(config.name).expanduser().is_file():
        # a data file given as the name (also `reasonctl eval --data file` of an hf run)
        config = config.model_copy(update={"data_files": config.name, "name": None})
    if config.data_files is not None:
        files = _file_list(config.data_files)
        suffixes = {Path(f).suffix.lower() for f in files}
        builders = {BUILDERS.get(s) for s in suffixes}
        if len(builders) != 1 or None in builders:
            raise DataError(
                f"data.hf.data_files: cannot pick a loader for {sorted(suffixes)}; use one "
                f"file type among {', '.join(sorted(BUILDERS))}"
            )
        for file in files:
            if not Path(file).expanduser().is_file():
                raise DataError(f"data.hf.data_files: file not found: {Path(file).absolute()}")
        data_files = config.data_files
        if not isinstance(data_files, dict):
            data_files = {split_name: data_files}
        table = datasets.load_dataset(builders.pop(), data_files=data_files, split=config.split)
        label = f"{files[0]}[{split_name}]"
        return table, label, Path(files[0]).expanduser().parent, _split_start(config.split)
    assert config.name is not None
    local = Path(config.name).expanduser()
    if local.is_dir() and _is_saved_dataset(local):
        saved = datasets.load_from_disk(str(local))
        if isinstance(saved, datasets.DatasetDict):
            if split_name not in saved:
                raise DataError(
                    f"data.hf.split: {local} has no split {split_name!r}; available: "
                    f"{', '.join(saved)}"
                )
            saved = saved[split_name]
        start, end = _bounds(config.split, len(saved))
        if (start, end) != (0, len(saved)):
            saved = saved.select(range(start, max(start, end)))
        return saved, f"{local}[{split_name}]", local, start
    try:
        table = datasets.load_dataset(
            config.name, config.subset, split=config.split, revision=config.revision
        )
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        raise DataError(
            f"data.hf: cannot load dataset {config.name!r} (subset {config.subset!r}, split "
            f"{config.split!r}): {exc}; a local dataset is a save_to_disk directory, a "
            "folder of data files or a file (data_files)"
        ) from exc
    base = local if local.is_dir() else Path.cwd()
    return table, f"{config.name}[{split_name}]", base, _split_start(config.split)


def _file_list(data_files: str | list[str] | dict[str, str | list[str]]) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
    return list(data_files)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _bounds(split: str, length: int) -> tuple[int, int]:
    """``[start, end)`` rows of ``split`` (e.g. ``train[10:-5]``) in a split of ``length``."""
    match = SPLIT_PATTERN.match(split)
    assert match is not None

    def position(text: str | None, default: int) -> int:
        if text is None:
            return default
        value = int(text.rstrip("%"))
        if text.endswith("%"):
            value = round(length * value / 100)
        return max(0, min(length, value + length if value < 0 else value))

    return position(match.group("start"), 0), position(match.group("end"), length)


def _split_start(split: str) -> int:
    """Row index of the first loaded row within its split (for error locations)."""
    match = SPLIT_PATTERN.match(split)
    start = match.group("start") if match else None
    if start is None or start.startswith("-") or start.endswith("%"):
        return 0
    return int(start)


def _undecoded_media(datasets: Any, table: Any, config: HfConfig) -> Any:
    """Cast image/video feature columns so rows hold paths/bytes instead of decoded media."""
    columns = {config.columns.get(f, f) for f in MEDIA_FIELDS}  # type: ignore[call-overload]
    for column in columns & set(table.column_names):
        feature = table.features[column]
        undecoded = _undecoded_feature(datasets, feature)
        if undecoded is not None:
            table = table.cast_column(column, undecoded)
    return table


def _undecoded_feature(datasets: Any, feature: Any) -> Any:
    for kind in ("Image", "Video"):
        cls = getattr(datasets, kind, None)
        if cls is not None and isinstance(feature, cls):
            return cls(decode=False)
    inner = getattr(feature, "feature", None)
    if inner is not None and isinstance(feature, (datasets.Sequence, datasets.List)):
        undecoded = _undecoded_feature(datasets, inner)
        if undecoded is not None:
            return datasets.List(undecoded)
    return None


def _media_paths(value: Any) -> Any:
    """Paths for media values: strings pass, ``{"path", "bytes"}`` dicts become files."""
    if isinstance(value, (list, tuple)):
        return [_media_path(v) for v in value]
    return _media_path(value)


def _media_path(value: Any) -> Any:
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        path, data = value.get("path"), value.get("bytes")
        if data is None:
            return path
        if path and Path(path).is_file():
            return path
        return str(_cached_media_file(data, Path(path or "").suffix or ".png"))
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return str(_cached_media_file(buffer.getvalue(), ".png"))
    return value


def _cached_media_file(data: bytes, suffix: str) -> Path:
    """Write embedded media bytes once under the reasonctl cache; return the file."""
    from reasonctl.models.tiny import cache_root

    digest = hashlib.sha256(data).hexdigest()[:32]
    target = cache_root() / "hf-media" / f"{digest}{suffix}"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        partial.replace(target)
    return target

