"""The ``webdataset`` format: tar shards written here, read locally and from moto's S3 server.

Every sample is seen once per epoch across data-parallel ranks, a position taken after any
sample continues with the very next one (shuffle buffer and reader threads included), a
corrupt shard is named (or skipped), and an SFT run on S3 shards resumes to the same losses.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.errors import DataError
from reasonctl.data.formats.webdataset import WebDatasetConfig
from reasonctl.data.tar_shards import expand_braces
from reasonctl.data.webdataset_stream import WebDatasetStream, build_webdataset
from tests.storage_servers import Bucket, S3Server, use_server

SIZES = (5, 3, 4, 6, 2, 5)
"""Samples per shard (uneven on purpose)."""


def write_shard(path: Path, shard: int, count: int) -> list[str]:
    """A tar of ``count`` samples (``.json`` row, ``.txt`` caption); returns their keys."""
    keys = []
    with tarfile.open(path, "w") as tar:
        for index in range(count):
            key = f"s{shard:02d}/k{index:03d}"
            members = {"json": json.dumps({"prompt": f"what is {shard}-{index}?"}).encode(),
                       "txt": f"answer {shard}-{index}".encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            keys.append(key)
    return keys


@pytest.fixture
def shards(tmp_path: Path) -> tuple[list[Path], list[str]]:
    paths, keys = [], []
    for shard, count in enumerate(SIZES):
        path = tmp_path / f"shard-{shard:06d}.tar"
        keys += write_shard(path, shard, count)
        paths.append(path)
    return paths, keys


def stream(paths: list[Any], **options: Any) -> WebDatasetStream:
    shuffle = options.pop("shuffle", True)
    config = WebDatasetConfig(shards=[str(p) for p in paths], **options)
    dataset = build_webdataset(config)
    dataset.shuffle, dataset.seed = shuffle, 3
    return dataset


def one_epoch(dataset: Any, rank: int, world_size: int, epoch: int = 0) -> list[str]:
    out = []
    for sample, position in dataset.iterate(rank, world_size, None):
        if position["epoch"] > epoch:
            break
        if position["epoch"] == epoch:
            out.append(sample.meta["key"])
    return out


def test_brace_ranges_keep_zero_padding() -> None:
    assert expand_braces("s3://b/{000008..000011}.tar") == [
        "s3://b/000008.tar", "s3://b/000009.tar", "s3://b/000010.tar", "s3://b/000011.tar"]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]


@pytest.mark.parametrize("workers,buffer", [(1, 0), (2, 5)])
def test_every_sample_once_per_epoch_across_two_ranks(
    shards: tuple[list[Path], list[str]], workers: int, buffer: int
) -> None:
    paths, keys = shards
    dataset = stream(paths, workers=workers, shuffle_buffer=buffer)
    seen = [one_epoch(dataset, rank, 2) for rank in range(2)]
    assert sorted(seen[0] + seen[1]) == sorted(keys)
    assert not set(seen[0]) & set(seen[1])
    # the stream goes on: the next epoch deals the shards in another order
    again = [one_epoch(dataset, rank, 2, epoch=1) for rank in range(2)]
    assert sorted(again[0] + again[1]) == sorted(keys)
    assert again != seen
    sample = next(dataset.iterate(0, 1, None))[0]
    assert sample.messages[-1].role == "assistant" and sample.reference.startswith("answer")


def test_position_resumes_at_the_next_sample(shards: tuple[list[Path], list[str]]) -> None:
    paths, _ = shards
    dataset = stream(paths, workers=2, shuffle_buffer=4)
    full = []
    positions = []
    for sample, position in dataset.iterate(1, 2, None):
        full.append(sample.meta["key"])
        positions.append(json.loads(json.dumps(position)))  # what a checkpoint stores
        if len(full) == 30:  # past the end of rank 1's first epoch
            break
    for cut in (0, 3, 7, len(full) - 12):
        resumed = dataset.iterate(1, 2, positions[cut])
        after = [next(resumed)[0].meta["key"] for _ in range(10)]
        resumed.close()
        assert after == full[cut + 1 : cut + 11], cut


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[4096:4608] = b"\xff" * 512  # the third sample's first header (2 KiB a sample)
    path.write_bytes(bytes(data))


def test_corrupt_shard_named_or_skipped(shards: tuple[list[Path], list[str]],
                                        caplog: pytest.LogCaptureFixture) -> None:
    paths, keys = shards
    corrupt(paths[3])
    with pytest.raises(DataError, match=rf"{paths[3].name}.*on_bad_shard"):
        one_epoch(stream(paths, shuffle=False), 0, 1)
    dataset = stream(paths, shuffle=False, on_bad_shard="skip")
    with caplog.at_level(logging.WARNING, logger="reasonctl.data.webdataset"):
        seen = one_epoch(dataset, 0, 1)
    assert str(paths[3]) in caplog.text
    bad = [k for k in keys if k.startswith("s03/")]
    # the first sample is kept; the second, last before the damage, may miss members
    assert set(seen) == set(keys) - set(bad[1:])


def test_missing_shard_and_unmappable_sample_are_reported(tmp_path: Path,
                                                          shards: tuple[list[Path], list[str]]
                                                          ) -> None:
    paths, _ = shards
    with pytest.raises(DataError, match="shard not found"):
        stream([*paths, tmp_path / "nope.tar"])
    odd = tmp_path / "odd.tar"
    with tarfile.open(odd, "w") as tar:
        info = tarfile.TarInfo("x/1.bin")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"\0"))
    with pytest.raises(DataError, match=r"odd.tar:x/1: no text to train on.*json_ext"):
        next(stream([odd]).iterate(0, 1, None))
    skipping = stream([odd, paths[1]], shuffle=False)
    skipping.skip_bad_rows = True
    positions = skipping.iterate(0, 1, None)
    skipped = [next(positions)[1]["skipped"] for _ in range(9)]
    assert skipped == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # one per epoch, counted over the run


# --- S3 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as s3:
        yield s3


@pytest.fixture
def bucket(server: S3Server, monkeypatch: pytest.MonkeyPatch,
           shards: tuple[list[Path], list[str]]) -> Bucket:
    s3 = use_server(server, monkeypatch)
    client = s3.client()
    for index, path in enumerate(shards[0]):
        client.upload_file(str(path), s3.name, f"train/{index:06d}.tar")
    return s3


def s3_stream(bucket: Bucket, count: int = len(SIZES), **options: Any) -> WebDatasetStream:
    from reasonctl.storage.s3.client import S3Storage
    from reasonctl.storage.s3.config import S3StorageConfig

    config = WebDatasetConfig(
        shards=f"s3://{bucket.name}/train/{{000000..{count - 1:06d}}}.tar", **options)
    from reasonctl.data.tar_shards import expand_shards

    storage = S3Storage(S3StorageConfig(max_attempts=2, backoff_s=0))
    shards = expand_shards(config.shards, list_remote=storage.list, option="shards")
    return WebDatasetStream(shards, config, storage_for=lambda uri: storage, seed=5,
                            shuffle=True)


def test_s3_shards_split_over_two_ranks_and_resume(
    bucket: Bucket, shards: tuple[list[Path], list[str]]
) -> None:
    dataset = s3_stream(bucket, workers=2, shuffle_buffer=3)
    seen = [one_epoch(dataset, rank, 2) for rank in range(2)]
    assert sorted(seen[0] + seen[1]) == sorted(shards[1])
    stream0 = dataset.iterate(0, 2, None)
    taken = [next(stream0) for _ in range(9)]
    stream0.close()
    resumed = dataset.iterate(0, 2, json.loads(json.dumps(taken[4][1])))
    assert [next(resumed)[0].meta["key"] for _ in range(4)] == \
        [s.meta["key"] for s, _ in taken[5:9]]
    resumed.close()


def test_s3_corrupt_shard_is_named(bucket: Bucket, shards: tuple[list[Path], list[str]]
                                   ) -> None:
    with pytest.raises(DataError, match=rf"s3://{bucket.name}/train/000006.tar: no such"):
        one_epoch(s3_stream(bucket, count=7), 0, 1)
    corrupt(shards[0][2])
    bucket.client().upload_file(str(shards[0][2]), bucket.name, "train/000002.tar")
    with pytest.raises(DataError, match=rf"s3://{bucket.name}/train/000002.tar"):
        one_epoch(s3_stream(bucket), 0, 1)


@pytest.mark.slow
def test_grpo_prompts_from_shards_resume_like_an_uninterrupted_run(tmp_path: Path,
                                                                   tiny_model_dir: Path
                                                                   ) -> None:
    import reasonctl

    for shard in range(3):
        with tarfile.open(tmp_path / f"p{shard}.tar", "w") as tar:
            for index in range(4):
                letter = "AB"[(shard + index) % 2]
                data = json.dumps({"prompt": f"Item {shard}.{index}. Reply with {letter}.",
                                   "reference": letter}).encode()
                info = tarfile.TarInfo(f"p{shard}_{index}.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    def parity(completion: str, sample: Any) -> float:
        return float(len(completion.encode()) % 2 == 0)

    def config(name: str, steps: int, **run_section: Any) -> dict[str, Any]:
        return {
            "run": {"output_dir": str(tmp_path / name), "seed": 0, **run_section},
            "model": {"name_or_path": str(tiny_model_dir), "max_length": 64},
            "data": {"format": "webdataset", "shuffle": True,
                     "webdataset": {"shards": str(tmp_path / "p*.tar"), "shuffle_buffer": 3}},
            "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2}},
            "rollout": {"n": 4, "max_new_tokens": 6, "temperature": 1.0},
            "train": {"lr": 1e-2, "max_steps": steps, "micro_batch_size": 4},
            "backend": {"name": "single", "device": "cpu"},
            "checkpoint": {"export_final": False, "every_steps": 2, "keep": 2},
            "logging": {"loggers": ["jsonl"]},
        }

    def metrics(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    reasonctl.run(config("full", 4), rewards=[parity])
    step_2 = str(tmp_path / "full" / "checkpoints" / "step_2")
    reasonctl.run(config("resumed", 4, resume=step_2), rewards=[parity])
    expected, got = metrics("full")[2:], metrics("resumed")
    assert [r["step"] for r in got] == [3, 4]
    for key in ("reward/mean", "response_length/mean", "loss"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5)


def test_streamed_order_checkpoints_and_refuses_other_layouts(
    shards: tuple[list[Path], list[str]]
) -> None:
    from reasonctl.algorithms.sample_order import sample_order, steps_per_epochs
    from reasonctl.core.errors import ConfigError

    dataset = stream(shards[0], workers=2)
    order = sample_order(dataset, seed=0, shuffle=True, rank=0, world_size=1)
    first = [s.load().meta["key"] for s in order.draw(4).items]
    saved = json.loads(json.dumps(order.checkpoint_state(order.state_dict())))
    following = [s.load().meta["key"] for s in order.draw(4).items]
    order.close()
    again = sample_order(dataset, seed=0, shuffle=True, rank=0, world_size=1)
    again.load_state_dict(saved)
    assert [s.load().meta["key"] for s in again.draw(4).items] == following
    assert first != following
    again.close()
    with pytest.raises(ConfigError, match="1 data-parallel rank.*this run has 2"):
        sample_order(dataset, seed=0, shuffle=True, rank=0, world_size=2).load_state_dict(saved)
    with pytest.raises(ConfigError, match="not a stream position"):
        again.load_state_dict({"epoch": 0, "index": 3})
    with pytest.raises(ConfigError, match="train.max_steps"):
        steps_per_epochs(again, 1, 4, format_name="webdataset")


class FlakyStorage:
    """Serves local shards as ``flaky://<n>``; the first reads of each break off midway."""

    def __init__(self, paths: list[Path], breaks: int, after: int) -> None:
        self.paths = paths
        self.after = after
        self.breaks = {index: breaks for index in range(len(paths))}

    def open_read(self, uri: str, start: int = 0) -> Any:
        index = int(uri.rsplit("/", 1)[-1])
        data = self.paths[index].read_bytes()[start:]
        if self.breaks[index] <= 0:
            return io.BytesIO(data)
        self.breaks[index] -= 1
        after = self.after

        class Broken(io.BytesIO):
            def read(self, size: int = -1) -> bytes:
                if self.tell() > after:
                    raise ConnectionResetError("connection reset by peer")
                return super().read(min(size, 1024) if size > 0 else 1024)

        return Broken(data)


@pytest.mark.parametrize("breaks,after,survives", [(2, 3000, True), (5, 0, False)])
def test_dropped_reads_reopen_at_the_next_sample(shards: tuple[list[Path], list[str]],
                                                 breaks: int, after: int, survives: bool
                                                 ) -> None:
    paths, keys = shards
    storage = FlakyStorage(paths, breaks, after)
    config = WebDatasetConfig(shards=[f"flaky://host/{i}" for i in range(len(paths))])
    dataset = WebDatasetStream(list(config.shards), config, storage_for=lambda uri: storage)
    if survives:
        assert one_epoch(dataset, 0, 1) == keys  # nothing lost, nothing twice
    else:
        with pytest.raises(DataError, match=r"flaky://host/0: reading broke off 3 times"):
            one_epoch(dataset, 0, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_on_s3_record_both_positions_and_resume_like_uninterrupted(
    bucket: Bucket, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SFT on 2 processes reading shards from S3 (the AWS_* environment of the bucket
    fixture reaches the launched processes): the checkpoint holds both ranks' positions
    and a run resumed from it trains the same steps as the uninterrupted one."""
    import subprocess
    import sys

    from reasonctl.loggers.metrics_file import read_metrics

    config = tmp_path / "sft.toml"
    config.write_text(f"""
[run]
seed = 3
[model]
name_or_path = "{tiny_model_dir}"
max_length = 64
[data]
format = "webdataset"
shuffle = true
[data.webdataset]
shards = "s3://{bucket.name}/train/"
workers = 2
shuffle_buffer = 3
[train]
lr = 5e-3
max_steps = 4
global_batch_size = 4
micro_batch_size = 2
[backend]
name = "fsdp"
device = "cpu"
[checkpoint]
every_steps = 2
keep = 2
export_final = false
[logging]
loggers = ["jsonl"]
plot = false
""")

    def launch(output: Path, *extra: str) -> dict[int, float]:
        command = [sys.executable, "-m", "reasonctl", "run", "--nproc-per-node", "2",
                   "--config", str(config), "--output-dir", str(output), *extra]
        proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return {r["step"]: r["loss"] for r in read_metrics(output / "metrics.jsonl")}

    full = launch(tmp_path / "full")
    step_2 = tmp_path / "full" / "checkpoints" / "step_2"
    manifest = json.loads((step_2 / "manifest.json").read_text())
    stream_state = manifest["algorithm"]["sampler"]["stream"]
    assert stream_state["world_size"] == 2
    first, second = stream_state["positions"]
    assert first["emitted"] == second["emitted"] == 4  # 2 steps x 2 samples per rank
    assert first["workers"] != second["workers"]  # each rank reads its own shards
    resumed = launch(tmp_path / "resumed", "--set", f'run.resume="{step_2}"')
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step
