"""The Redis transport of separate rollout workers, against a real redis-server: consumer
groups, the janitor's take-over of a dead worker's batch, dead letters, atomic completion,
lossless messages and bounded failures when Redis is unreachable."""

from __future__ import annotations

import time

import pytest
import torch
from redis_support import needs_redis, redis_server, redis_url  # noqa: F401

from reasonctl.async_rl.messages import PromptBatch, RolloutBatch, WeightVersion
from reasonctl.core.errors import ReasonctlError
from reasonctl.core.types import Completion

pytestmark = [pytest.mark.redis, needs_redis]


def _transport(url: str, world_size: int = 1):
    from reasonctl.async_rl.transport import Transport

    transport = Transport.open(url, "t1", timeout_s=5)
    transport.create_run("[run]\nname = 't1'\n", world_size)
    return transport


def _prompt(step: int = 0, rank: int = 0) -> PromptBatch:
    return PromptBatch(step=step, rank=rank, seed=7, indices=[3, 1],
                       prompts=[{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])


def test_prompt_batch_and_rollouts_round_trip_exactly() -> None:
    pixels = torch.randn(4, 6)
    prompt = PromptBatch(step=3, rank=1, seed=11, indices=[5], attempt=2,
                         prompts=[{"input_ids": [9, 8], "pixel_values": pixels,
                                   "image_grid_thw": torch.tensor([[1, 2, 2]])}])
    back = PromptBatch.from_fields(prompt.to_fields())
    assert (back.step, back.rank, back.seed, back.indices, back.attempt) == (3, 1, 11, [5], 2)
    assert back.prompts[0]["input_ids"] == [9, 8]
    assert torch.equal(back.prompts[0]["pixel_values"], pixels)
    assert back.group_ids() == ["s3-r1-g0"]
    logprobs = torch.randn(5).tolist()  # float32 values as an engine records them
    completions = [[Completion("ab", [1, 2], logprobs[:2], "stop"),
                    Completion("c", [3, 4, 5], logprobs[2:], "length")], []]
    rollouts = RolloutBatch(step=3, rank=1, attempt=2, version=WeightVersion(2, 1),
                            worker="w", completions=completions, deliveries=2,
                            generate_s=0.5, sync_ms=12.0)
    again = RolloutBatch.from_fields(rollouts.to_fields())
    assert again.completions == completions
    assert (again.version, again.deliveries, again.tokens) == (WeightVersion(2, 1), 2, 5)


def test_a_dead_workers_batch_is_taken_over_and_dead_lettered_after_max_deliveries(
    redis_url: str,
) -> None:
    transport = _transport(redis_url)
    transport.publish_prompts(_prompt().to_fields())
    first = transport.read_prompt("a", block_ms=100)
    assert first is not None and first.deliveries == 1
    assert transport.read_prompt("b", block_ms=100) is None  # delivered once, to a
    assert transport.reclaim_prompt("b", min_idle_ms=500) is None  # a is not idle yet
    time.sleep(0.3)
    transport.keep_alive("a", first.id)  # a live worker refreshes its batch
    time.sleep(0.3)
    assert transport.reclaim_prompt("b", min_idle_ms=500) is None
    time.sleep(0.6)  # a died: nobody refreshes
    taken = transport.reclaim_prompt("b", min_idle_ms=500)
    assert taken is not None and taken.id == first.id and taken.deliveries == 2
    assert PromptBatch.from_fields(taken.fields).indices == [3, 1]
    assert transport.pending_by_consumer() == {"a": 0, "b": 1}
    transport.record_error(taken.id, "Traceback ... CUDA out of memory")
    transport.dead_letter(taken, "delivered 2 times")
    dead = transport.dead_letters()
    assert len(dead) == 1 and b"out of memory" in dead[0].fields["error"]
    assert transport.pending_by_consumer()["b"] == 0
    assert transport.dead_letters(dead[0].id) == []


def test_completing_a_batch_moves_it_to_the_ranks_stream_atomically(redis_url: str
                                                                    ) -> None:
    transport = _transport(redis_url, world_size=2)
    transport.publish_prompts(_prompt(rank=1).to_fields())
    entry = transport.read_prompt("w", block_ms=100)
    assert entry is not None
    result = RolloutBatch(step=0, rank=1, attempt=0, version=WeightVersion(1, 0), worker="w",
                          completions=[[Completion("x", [1], [-0.5])]] * 2)
    transport.complete_prompt(entry.id, 1, result.to_fields())
    assert transport.pending_by_consumer() == {"w": 0}
    assert transport.client.xlen(transport.key("prompts")) == 0
    assert transport.read_results(0, block_ms=10) == []
    got = transport.read_results(1, block_ms=10)
    assert [RolloutBatch.from_fields(e.fields).batch_id for e in got] == ["s0-r1"]
    # read but not dropped: a restarted trainer reads it again first
    assert [e.id for e in transport.read_results(1, block_ms=0, pending=True)] == [got[0].id]
    transport.drop_results(1, [got[0].id])
    assert transport.read_results(1, block_ms=0, pending=True) == []


def test_heartbeats_expire(redis_url: str) -> None:
    transport = _transport(redis_url)
    transport.beat("worker", "w1", 0.3)
    transport.beat("worker", "w2", 5)
    transport.beat("trainer", "0", 0.3)
    assert transport.live_workers() == ["w1", "w2"] and transport.trainer_alive()
    time.sleep(0.5)
    assert transport.live_workers() == ["w2"] and not transport.trainer_alive()


def test_unreachable_redis_is_a_clear_error_within_the_timeout() -> None:
    from reasonctl.async_rl.processes import free_port
    from reasonctl.async_rl.transport import Transport

    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(ReasonctlError, match="cannot reach Redis at") as info:
        Transport.open(url, "x", timeout_s=1.5)
    assert time.monotonic() - started < 6
    assert "hunter2" not in str(info.value) and "rollout.workers.redis_url" in str(info.value)


def test_redis_going_away_mid_run_is_a_clear_error(redis_server) -> None:
    transport = _transport(redis_server.url)
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(ReasonctlError, match="lost the connection to Redis"):
        transport.read_results(0, block_ms=1000)
    assert time.monotonic() - started < 30
