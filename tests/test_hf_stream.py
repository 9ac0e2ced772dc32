"""The ``hf`` format with ``streaming = true``: rows split over ranks, positions resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reasonctl.core.errors import ConfigError, DataError
from reasonctl.core.protocols import streams_samples
from reasonctl.data.formats.hf import HfConfig
from reasonctl.data.formats.hf_dataset import build_hf_dataset
from tests.data_factories import write_chat_jsonl

ROWS = 11


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_chat_jsonl(tmp_path / "rows.jsonl",
                            [{"question": f"q{i}", "response": f"a{i}"} for i in range(ROWS)])


def stream(data: Path, **options: object) -> object:
    config = HfConfig(data_files=str(data), streaming=True, columns={"prompt": "question"},
                      **options)
    dataset = build_hf_dataset(config)
    assert streams_samples(dataset)
    return dataset


def prompts(pairs: list) -> list[str]:
    return [s.messages[0].content[0].text for s, _ in pairs]


def test_rows_split_over_ranks_once_per_epoch(data: Path) -> None:
    dataset = stream(data)
    seen = []
    for rank in range(2):
        it = dataset.iterate(rank, 2, None)
        pairs = [next(it) for _ in range(ROWS)]  # more than one epoch's share
        it.close()
        seen.append(prompts([p for p in pairs if p[1]["epoch"] == 0]))
        assert any(p[1]["epoch"] == 1 for p in pairs)
    assert sorted(seen[0] + seen[1]) == sorted(f"q{i}" for i in range(ROWS))
    assert not set(seen[0]) & set(seen[1])


def test_position_resumes_at_the_next_row(data: Path) -> None:
    dataset = stream(data)
    it = dataset.iterate(0, 1, None)
    full = [next(it) for _ in range(15)]
    it.close()
    for cut in (0, 4, 10):  # 10: the last row of epoch 0
        state = json.loads(json.dumps(full[cut][1]))
        resumed = dataset.iterate(0, 1, state)
        assert prompts([next(resumed) for _ in range(4)]) == prompts(full[cut + 1 : cut + 5])
        resumed.close()


def test_bad_rows_and_sliced_splits_are_reported(tmp_path: Path, data: Path) -> None:
    with pytest.raises(ConfigError, match="slices the split"):
        stream(data, split="train[:5]")
    bad = write_chat_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "response": "a"},
                                                    {"other": 1}])
    it = stream(bad).iterate(0, 1, None)
    next(it)
    with pytest.raises(DataError, match=r"rows.jsonl|bad.jsonl"):
        next(it)
