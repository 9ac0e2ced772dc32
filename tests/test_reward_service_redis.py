"""The reward service on a Redis queue (Debian's redis-server on 127.0.0.1): replicas share
the queue, and a service killed mid-queue and started again finishes the pending work."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service_support import AUTH, RedisServer, ServiceProcess, service_config
from tests.test_reward_service import text_body

pytestmark = pytest.mark.redis

NAME = "tests.service_rewards:slow_length"
ENQUEUE = "/api/reward/enqueue"


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    pytest.importorskip("redis")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def enqueue(url: str, text: str) -> str:
    response = httpx.post(url + ENQUEUE, content=text_body([NAME], [text]), headers=AUTH,
                          timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["uuid"])


def status(url: str, request_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/reward/result/{request_id}", headers=AUTH, timeout=30).json()


def wait_all(url: str, ids: dict[str, str], timeout: float) -> dict[str, dict[str, Any]]:
    end = time.monotonic() + timeout
    results: dict[str, dict[str, Any]] = {}
    while len(results) < len(ids) and time.monotonic() < end:
        for request_id in ids:
            if request_id not in results:
                answer = status(url, request_id)
                if answer["status"] != "pending":
                    results[request_id] = answer
        time.sleep(0.1)
    assert len(results) == len(ids), f"{len(ids) - len(results)} still pending"
    return results


def test_a_service_killed_mid_queue_finishes_the_pending_work_after_a_restart(
        redis_server: RedisServer, tmp_path: Path) -> None:
    config = service_config([{"name": NAME, "max_batch": 1, "max_wait_ms": 0}],
                            queue={"lease_s": 2.0})
    service = ServiceProcess(config, tmp_path / "service", redis=redis_server.url,
                             env={"SERVICE_TEST_DELAY_S": "0.4"}).start()
    try:
        ids = {enqueue(service.url, "x" * (i + 1)): "x" * (i + 1) for i in range(8)}
        end = time.monotonic() + 60
        while not any(status(service.url, i)["status"] == "done" for i in ids):
            assert time.monotonic() < end
            time.sleep(0.05)
        service.kill()  # mid-queue: one request being scored, others waiting
        import redis

        client = redis.Redis.from_url(redis_server.url)
        pending = client.zcard("reasonctl:rewards:pending")
        assert 0 < pending < 8, pending
        service.start()
        results = wait_all(service.url, ids, timeout=120)
    finally:
        service.stop()
    for request_id, text in ids.items():
        assert results[request_id]["status"] == "done", results[request_id]
        assert results[request_id]["scores"][NAME] == [float(len(text))]
    assert client.zcard("reasonctl:rewards:pending") == 0
    assert not client.keys("reasonctl:rewards:body:*"), "finished payloads are deleted"


def test_replicas_share_one_queue_without_scoring_twice(
        redis_server: RedisServer, tmp_path: Path) -> None:
    config = service_config([{"name": NAME, "max_batch": 1, "max_wait_ms": 0}])
    env = {"SERVICE_TEST_DELAY_S": "0.2"}
    first = ServiceProcess(config, tmp_path / "a", redis=redis_server.url, env=env).start()
    second = ServiceProcess(config, tmp_path / "b", redis=redis_server.url, env=env).start()
    try:
        ids = {enqueue(first.url, "y" * (i + 1)): "y" * (i + 1) for i in range(10)}
        results = wait_all(second.url, ids, timeout=120)  # pulled from the other replica
        metrics = [httpx.get(f"{s.url}/metrics", headers=AUTH, timeout=30).json()
                   for s in (first, second)]
    finally:
        first.stop()
        second.stop()
    assert all(results[i]["scores"][NAME] == [float(len(t))] for i, t in ids.items())
    scored = [m["rewards"].get(NAME, {}).get("completions", 0) for m in metrics]
    assert sum(scored) == 10, scored
    assert all(count > 0 for count in scored), f"both replicas take work: {scored}"
