"""Load: 32 concurrent clients x 50 requests against ``reasonctl serve-rewards`` on
127.0.0.1. Nothing is lost or duplicated (each score names its completion); the p50/p99
latency is printed as one JSON line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from reasonctl.reward_service.client import RewardServiceClient
from reasonctl.reward_service.metrics import percentiles
from reasonctl.reward_service.wire import encode_request
from tests.service_support import AUTH, TOKEN, ServiceProcess, service_config
from tests.test_reward_service import sample

pytestmark = pytest.mark.load

CLIENTS = 32
REQUESTS = 50
PER_REQUEST = 2
NAME = "tests.service_rewards:number"


def test_32_clients_x_50_requests_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    config = service_config([{"name": NAME, "max_batch": 64, "max_wait_ms": 5}],
                            limits={"max_pending": 256})
    config["server"]["log_format"] = "json"
    service = ServiceProcess(config, tmp_path / "service").start()
    latencies: list[float] = []
    scores: dict[str, list[float]] = {}
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 420  # the whole test is bounded in time

    def client_loop(index: int) -> None:
        client = RewardServiceClient(service.url, TOKEN)
        try:
            for i in range(REQUESTS):
                if time.monotonic() > stop_at:
                    raise TimeoutError("the load test ran out of time")
                first = (index * REQUESTS + i) * PER_REQUEST
                texts = [str(first + j) for j in range(PER_REQUEST)]
                body = encode_request({NAME: 1.0}, texts, [sample(t) for t in texts])
                started = time.monotonic()
                deadline = min(stop_at, started + 120)
                request_id = client.enqueue(body, deadline=deadline)
                answer = client.wait(request_id, deadline=deadline)
                elapsed = time.monotonic() - started
                with lock:
                    if request_id in scores:
                        errors.append(f"id {request_id} returned twice")
                    if answer["status"] != "done":
                        errors.append(f"{request_id}: {answer}")
                        continue
                    scores[request_id] = answer["scores"][NAME]
                    latencies.append(elapsed)
                    if scores[request_id] != [float(t) for t in texts]:
                        errors.append(f"{request_id}: {scores[request_id]} for {texts}")
        except Exception as exc:
            with lock:
                errors.append(f"client {index}: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    try:
        started = time.monotonic()
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - started
        metrics = httpx.get(f"{service.url}/metrics", headers=AUTH, timeout=30).json()
    finally:
        service.stop()
    assert not errors, errors[:5]
    total = CLIENTS * REQUESTS
    assert len(scores) == total
    every = sorted(v for values in scores.values() for v in values)
    assert every == [float(i) for i in range(total * PER_REQUEST)], "lost or duplicated scores"
    assert metrics["requests"]["accepted"] == metrics["requests"]["done"] == total
    assert metrics["requests"]["failed"] == 0
    assert metrics["rewards"][NAME]["completions"] == total * PER_REQUEST
    client_side = percentiles(latencies)
    report = {"load": f"{CLIENTS}x{REQUESTS}", "requests": total, "wall_s": round(wall, 2),
              "requests_per_s": round(total / wall, 1),
              "client_p50_s": round(client_side["p50"], 4),
              "client_p99_s": round(client_side["p99"], 4),
              "server_p50_s": round(metrics["latency_s"]["p50"], 4),
              "server_p99_s": round(metrics["latency_s"]["p99"], 4),
              "mean_batch": round(metrics["rewards"][NAME]["mean_batch"], 2),
              "rejected_full": metrics["requests"]["rejected_full"]}
    print(json.dumps(report))
    assert client_side["p99"] < 60
    log_lines = [json.loads(line) for line in service.log().splitlines()
                 if line.startswith("{")]
    assert sum(1 for line in log_lines if line.get("event") == "done") == total
    assert TOKEN not in service.log()
