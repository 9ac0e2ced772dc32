"""CSV question/answer data, a keyword reward and a preview command for reasonctl."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import reasonctl
from reasonctl import ContentPart, DataError, Message, Sample


class CsvQaConfig(BaseModel):
    """``[data.csvqa]``: where the CSV file is and which columns to read."""

    model_config = ConfigDict(extra="forbid")
    path: str
    question_column: str = "question"
    answer_column: str = "answer"


class CsvQaDataset:
    """Rows of a CSV file as single-turn question/answer samples."""

    def __init__(self, config: CsvQaConfig, on_bad_row: str = "error") -> None:
        self.samples: list[Sample] = []
        self.skipped_rows = 0
        path = Path(config.path)
        if not path.is_file():
            raise DataError(f"{path}: CSV file not found (set data.csvqa.path)")
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            for line, row in enumerate(reader, start=2):
                question = (row.get(config.question_column) or "").strip()
                answer = (row.get(config.answer_column) or "").strip()
                if not question or not answer:
                    if on_bad_row == "skip":
                        self.skipped_rows += 1
                        continue
                    raise DataError(f"{path}:{line}: empty question or answer column")
                self.samples.append(Sample(
                    messages=[Message("user", [ContentPart("text", text=question)]),
                              Message("assistant", [ContentPart("text", text=answer)])],
                    reference=answer,
                    meta={"source": row.get("source") or path.stem},
                    source=f"{path}:{line}",
                ))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


class KeywordConfig(BaseModel):
    """Options of the ``keyword`` reward."""

    model_config = ConfigDict(extra="forbid")
    keywords: list[str] = Field(min_length=1)
    case_sensitive: bool = False


class KeywordReward:
    """1.0 when a completion contains every keyword, else 0.0."""

    def __init__(self, config: KeywordConfig) -> None:
        self.config = config

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        def norm(text: str) -> str:
            return text if self.config.case_sensitive else text.lower()

        keywords = [norm(k) for k in self.config.keywords]
        return [float(all(k in norm(c) for k in keywords)) for c in completions]


def build_csvqa_dataset(config: CsvQaConfig, ctx: reasonctl.RunContext) -> CsvQaDataset:
    """CSV file with question,answer columns."""
    return CsvQaDataset(config, ctx.config.data.on_bad_row)


@reasonctl.hookimpl
def register_datasets(register: Any) -> None:
    """Register the ``csvqa`` format."""
    register("csvqa", build_csvqa_dataset, config_model=CsvQaConfig)


@reasonctl.hookimpl
def register_rewards(register: Any) -> None:
    """Register the ``keyword`` reward."""
    register("keyword", KeywordReward, config_model=KeywordConfig)


@reasonctl.hookimpl
def register_commands(app: Any) -> None:
    """Add ``reasonctl csvqa-preview``."""

    @app.command("csvqa-preview")
    def preview(path: str, rows: int = 3) -> None:
        """Print the first ROWS samples of a csvqa file."""
        dataset = CsvQaDataset(CsvQaConfig(path=path))
        for sample in list(dataset.samples)[:rows]:
            print(f"{sample.source}: {sample.messages[0].text!r} -> {sample.reference!r}")
        print(f"{len(dataset)} samples")
