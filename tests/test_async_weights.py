"""Weight sync from the trainer to rollout workers: per-replica gloo broadcast (CPU) and
safetensors files, with versions stamped, a replica that never joins blocking nobody."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from redis_support import needs_redis, redis_server, redis_url  # noqa: F401

from reasonctl.async_rl.messages import WeightVersion

pytestmark = [pytest.mark.redis, needs_redis]


def _weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    embed = torch.randn(7, 3) * scale
    return [("model.embed_tokens.weight", embed), ("lm_head.weight", embed),  # tied
            ("model.norm.weight", torch.ones(3) * scale),
            ("model.rotary.inv_freq", torch.arange(3, dtype=torch.int64))]


def _transport(url: str):
    from reasonctl.async_rl.transport import Transport

    transport = Transport.open(url, "w1", timeout_s=5)
    transport.create_run("", 1)
    return transport


def _assert_equal(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]
                  ) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == (torch.bfloat16 if b.is_floating_point() else b.dtype)
        assert torch.equal(a, b.to(a.dtype))


def test_broadcast_sends_each_staged_version_and_a_silent_replica_blocks_nobody(
    redis_url: str,
) -> None:
    from reasonctl.async_rl.broadcast_sync import BroadcastPublisher, BroadcastReceiver

    transport = _transport(redis_url)
    publisher = BroadcastPublisher(transport, device=torch.device("cpu"),
                                   wire_dtype=torch.bfloat16, address="127.0.0.1", timeout_s=30)
    try:
        stats = publisher.stage(iter(_weights(1.0)), WeightVersion(1, 0))
        assert stats.bytes == 7 * 3 * 2 * 2 + 3 * 2 + 3 * 8
        # a replica that asks and never joins: its group set-up times out in its own thread
        transport.push_sync_request(json.dumps({"replica": "ghost", "nonce": "n"}))
        receiver = BroadcastReceiver(transport, name="r1", device=torch.device("cpu"),
                                     timeout_s=20)
        started = time.monotonic()
        version, tensors = receiver.fetch(transport.weights())
        # well within the ghost's 30 s set-up timeout: its set-up holds nobody else's
        assert version == WeightVersion(1, 0) and time.monotonic() - started < 15
        _assert_equal(tensors, _weights(1.0))
        publisher.stage(iter(_weights(2.0)), WeightVersion(1, 1))  # while ghost still hangs
        version, tensors = receiver.fetch(transport.weights())  # the same group again
        assert version == WeightVersion(1, 1)
        _assert_equal(tensors, _weights(2.0))
        deadline = time.monotonic() + 10
        while publisher.groups["r1"].sends < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the sender finishes its last wait just after the receiver
        assert publisher.groups["r1"].sends == 2 and "ghost" not in publisher.groups
    finally:
        publisher.close()


def test_file_sync_writes_versions_and_keeps_the_newest(redis_url: str, tmp_path: Path
                                                        ) -> None:
    from reasonctl.async_rl.weight_sync import FilePublisher, FileReceiver

    transport = _transport(redis_url)
    publisher = FilePublisher(transport, tmp_path / "w", torch.bfloat16, keep=2)
    receiver = FileReceiver(torch.device("cpu"))
    for step in range(4):
        publisher.stage(iter(_weights(float(step + 1))), WeightVersion(3, step))
        version, tensors = receiver.fetch(transport.weights())
        assert version == WeightVersion(3, step)
        order = [name for name, _ in _weights(1.0)]
        _assert_equal(sorted(tensors, key=lambda t: order.index(t[0])),
                      _weights(float(step + 1)))
    names = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert names == ["weights-3-2.safetensors", "weights-3-3.safetensors"]
