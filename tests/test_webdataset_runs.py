"""WebDataset shards as a user meets them in runs: a malformed sample skipped under
``data.on_bad_row = "skip"`` is named in ``skipped_rows.jsonl`` (SFT and GRPO draw through
the same stream order), and ``reasonctl data check`` reads a stream's first epoch."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest


def write_rows(path: Path, rows: dict[str, bytes]) -> Path:
    """A tar whose sample ``key`` has one ``.json`` member holding ``rows[key]``."""
    with tarfile.open(path, "w") as tar:
        for key, data in rows.items():
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def good(i: int) -> bytes:
    return json.dumps({"prompt": f"what is {i}?", "response": f"it is {i}"}).encode()


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    root = tmp_path / "shards"
    root.mkdir()
    write_rows(root / "000000.tar", {f"a{i}": good(i) for i in range(4)})
    write_rows(root / "000001.tar", {"b0": good(10), "b1": b"not json", "b2": good(12),
                                     "b3": b'{"other": 1}', "b4": good(14)})
    return root


def sft_config(out: Path, shards: Path, model: Path) -> dict[str, Any]:
    return {
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": str(model), "max_length": 64},
        "data": {"format": "webdataset", "on_bad_row": "skip",
                 "webdataset": {"shards": str(shards) + "/"}},
        "algorithm": {"name": "sft"},
        "train": {"lr": 1e-3, "max_steps": 3, "global_batch_size": 2, "micro_batch_size": 2},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }


def test_skipped_samples_are_named_in_the_skipped_rows_file(tmp_path: Path, shards: Path,
                                                            tiny_model_dir: Path) -> None:
    import reasonctl

    result = reasonctl.run(sft_config(tmp_path / "run", shards, tiny_model_dir))
    assert result.status == "completed" and result.skipped_rows == 2
    listed = [json.loads(line) for line in
              (tmp_path / "run" / "skipped_rows.jsonl").read_text().splitlines()]
    assert [r["row"] for r in listed] == [f"{shards}/000001.tar:b1", f"{shards}/000001.tar:b3"]
    assert "invalid JSON" in listed[0]["reason"]
    assert "no text to train on" in listed[1]["reason"]


def test_a_streamed_order_hands_out_the_names_of_what_it_skipped(shards: Path) -> None:
    """What GRPO's prompt draws record (they go through the same order as SFT's)."""
    from reasonctl.algorithms.sample_order import sample_order
    from reasonctl.data.formats.webdataset import WebDatasetConfig
    from reasonctl.data.streams import StreamView
    from reasonctl.data.webdataset_stream import build_webdataset

    dataset = build_webdataset(WebDatasetConfig(shards=str(shards) + "/"))
    dataset.skip_bad_rows = True
    order = sample_order(StreamView(dataset), seed=0, shuffle=False, rank=0, world_size=1)
    draws = [order.draw(2) for _ in range(4)]
    order.close()
    assert [d.skipped for d in draws] == [0, 0, 1, 1]
    assert [w for d in draws for w, _ in d.reports] == [f"{shards}/000001.tar:b1",
                                                        f"{shards}/000001.tar:b3"]


def test_data_check_reads_one_epoch_of_a_stream(tmp_path: Path, shards: Path,
                                                tiny_model_dir: Path) -> None:
    import tomli_w

    from reasonctl.core.config import load_config
    from reasonctl.core.plugins import PluginHost
    from reasonctl.data.check import check_data

    config = tmp_path / "sft.toml"
    values = sft_config(tmp_path / "run", shards, tiny_model_dir)
    values["data"]["on_bad_row"] = "error"  # the check reads on, naming every bad sample
    config.write_text(tomli_w.dumps(values))
    registry = PluginHost.load().registry
    report = check_data(load_config(str(config), registry=registry), registry)
    assert (report.rows, report.samples) == (9, 7)
    assert report.bad == [(f"{shards}/000001.tar:b1", "member .json: invalid JSON: "
                           "Expecting value"),
                          (f"{shards}/000001.tar:b3", report.bad[1][1])]
    assert "no text to train on" in report.bad[1][1]
    assert any("streams its samples: read one epoch" in note for note in report.notes)


@pytest.mark.parametrize("on_bad_shard", ["error", "skip"])
def test_an_unusable_bucket_is_named_once_not_skipped_shard_by_shard(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        on_bad_shard: str) -> None:
    """A missing bucket (or credentials, or endpoint) is no single shard's fault: neither
    "skip the shard" advice nor skipping every shard in turn, but one error naming it."""
    import reasonctl
    from reasonctl.core.errors import DataError
    from tests.storage_servers import S3Server, use_server

    with S3Server() as server:
        use_server(server, monkeypatch)
        config = sft_config(tmp_path / "run", tmp_path, tiny_model_dir)
        config["data"]["webdataset"] = {"shards": "s3://no-such-bucket/{000000..000003}.tar",
                                        "on_bad_shard": on_bad_shard}
        with pytest.raises(DataError) as caught:
            reasonctl.run(config)
    message = str(caught.value)
    assert message.startswith("data.webdataset.shards: ")
    assert "bucket 'no-such-bucket' does not exist" in message
    assert "on_bad_shard" not in message


@pytest.mark.slow
@pytest.mark.distributed
def test_a_corrupt_shard_on_one_rank_ends_both_processes(tmp_path: Path, shards: Path,
                                                         tiny_model_dir: Path) -> None:
    """Rank 0 stops on the corrupt shard while rank 1 waits in the step's all-reduce: the
    failed rank no longer waits for its peer at a barrier (both hung until killed), so
    the launch ends naming the shard."""
    import os
    import subprocess
    import sys

    import tomli_w

    write_rows(shards / "000001.tar", {f"b{i}": good(10 + i) for i in range(6)})
    bad = shards / "000002.tar"
    bad.write_bytes(b"\xff" * 2048)
    values = sft_config(tmp_path / "run", shards, tiny_model_dir)
    values["data"].update(on_bad_row="error", shuffle=False)
    values["backend"]["name"] = "fsdp"
    values["train"].update(max_steps=5, micro_batch_size=1)
    config = tmp_path / "sft.toml"
    config.write_text(tomli_w.dumps(values))
    proc = subprocess.run([sys.executable, "-m", "reasonctl", "run", "--nproc-per-node", "2",
                           "--config", str(config)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{bad}: not a readable tar file" in proc.stderr, proc.stderr[-3000:]
