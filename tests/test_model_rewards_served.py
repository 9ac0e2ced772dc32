"""The model rewards served by a real ``reasonctl serve-rewards`` process over HTTP, in
worker processes: the same scores as in the trainer's process, requests batched together,
unparseable verdicts counted, a wrong token refused, deadlines, and a judge worker killed
while it judges (its request fails with the reason, the worker comes back)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reasonctl.core.errors import ReasonctlError
from reasonctl.reward_service.wire import encode_request
from reasonctl.rewards.judge import JudgeConfig, JudgeReward
from reasonctl.rewards.remote import RemoteConfig, remote_reward
from reasonctl.rewards.reward_model import RewardModelConfig, RewardModelReward
from tests.judge_support import (
    JUDGE_OPTIONS,
    SCORES,
    question,
    tiny_reward_model_dir,
    trained_judge_dir,
)
from tests.service_support import AUTH, TOKEN, ServiceProcess, service_config

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow  # a service with two model worker processes: a minute to start

ENQUEUE = "/api/reward/enqueue"


@pytest.fixture(scope="session")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_judge_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_reward_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def service(judge_dir: Path, reward_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    config = service_config(
        [{"name": "judge", "model": str(judge_dir), **JUDGE_OPTIONS, "max_wait_ms": 300},
         {"name": "reward_model", "model": str(reward_model_dir), "device": "cpu",
          "batch_size": 4, "max_wait_ms": 300}],
        workers={"kind": "process"}, limits={"deadline_s": 120})
    # started before the suite's autouse fixtures switch Triton's interpreter off
    process = ServiceProcess(config, tmp_path_factory.mktemp("service"),
                             env={"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"})
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)


def remote(url: str, **options: Any) -> Any:
    return remote_reward(RemoteConfig(url=url, **options))


def metrics(service: ServiceProcess) -> dict[str, Any]:
    return httpx.get(f"{service.url}/metrics", headers=AUTH, timeout=10).json()


def result(service: ServiceProcess, request_id: str, timeout: float = 120) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        response = httpx.get(f"{service.url}/api/reward/result/{request_id}", headers=AUTH,
                             timeout=10)
        if response.status_code != 202:
            return response.json()  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise TimeoutError(request_id)


def test_served_rewards_score_as_in_process_batched_across_requests(
        service: ServiceProcess, judge_dir: Path, reward_model_dir: Path) -> None:
    completions = list(SCORES)
    samples = [question()] * len(completions)
    judge = JudgeReward(JudgeConfig(model=str(judge_dir), **JUDGE_OPTIONS))
    model = RewardModelReward(RewardModelConfig(model=str(reward_model_dir), device="cpu"))
    in_process = {"judge": judge(completions, samples),
                  "reward_model": model(completions, samples)}
    assert in_process["judge"] == list(SCORES.values())

    before = metrics(service)["rewards"]
    served: dict[int, dict[str, list[float | None]]] = {}

    def send(index: int) -> None:  # four trainers at once
        served[index] = {name: remote(service.url, rewards={name: 1.0})(completions, samples)
                         for name in ("judge", "reward_model")}

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(served) == 4
    for scores in served.values():
        assert scores["judge"] == in_process["judge"]  # the unparseable verdict is None
        assert scores["reward_model"] == pytest.approx(in_process["reward_model"], abs=1e-5)
    after = metrics(service)["rewards"]
    judged = after["judge"]["completions"] - before.get("judge", {}).get("completions", 0)
    batches = after["judge"]["batches"] - before.get("judge", {}).get("batches", 0)
    assert judged == 4 * len(completions)
    assert batches < 4, "requests that wait together are judged in one generation"
    reasons = after["judge"]["reasons"]
    assert reasons["unparseable"] >= 4 and reasons["judged"] >= 20
    assert after["reward_model"]["reasons"]["scored"] >= 4 * len(completions)


def test_a_wrong_token_is_refused(service: ServiceProcess,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    body = encode_request({"judge": 1.0}, ["4"], [question()])
    wrong = httpx.post(service.url + ENQUEUE, content=body, timeout=10,
                       headers={"Authorization": "Bearer not-the-token-0123456789"})
    assert wrong.status_code == 401
    assert metrics(service)["requests"]["accepted"] >= 1
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", "not-the-token-0123456789")
    with pytest.raises(ReasonctlError, match="REASONCTL_REWARD_TOKEN"):
        remote(service.url, rewards={"judge": 1.0})(["4"], [question()])


def test_a_judgment_past_its_deadline_fails_and_the_trainer_goes_on(
        service: ServiceProcess) -> None:
    many = [f"banana {i} " * 8 for i in range(200)]
    started = time.monotonic()
    skipped = remote(service.url, rewards={"judge": 1.0}, timeout=1.0, on_error="skip")(
        many, [question()] * len(many))
    assert skipped == [None] * len(many)
    assert time.monotonic() - started < 20
    end = time.monotonic() + 60
    while metrics(service)["failures"].get("deadline", 0) < 1:
        assert time.monotonic() < end, metrics(service)
        time.sleep(0.2)
    # the service judges again once that batch is done
    assert remote(service.url, rewards={"judge": 1.0})(["4", "5"], [question()] * 2) == [
        1.0, 0.0]


def test_a_judge_worker_killed_while_judging_fails_its_request_and_comes_back(
        service: ServiceProcess) -> None:
    assert service.process is not None
    idle = {pid: _cpu_seconds(pid) for pid in _children(service.process.pid)}
    many = [f"banana {i} " * 8 for i in range(800)]
    body = encode_request({"judge": 1.0}, many, [question()] * len(many))
    request_id = httpx.post(service.url + ENQUEUE, content=body, headers=AUTH,
                            timeout=30).json()["uuid"]
    busy = None
    end = time.monotonic() + 60
    while busy is None:  # the judge's worker is the child that starts working
        assert time.monotonic() < end, "no worker process started judging"
        time.sleep(0.1)
        busy = next((pid for pid, cpu in idle.items() if _cpu_seconds(pid) - cpu > 0.3), None)
    os.kill(busy, signal.SIGKILL)
    failed = result(service, request_id)
    assert failed["status"] == "failed", failed
    assert "crashed while scoring" in failed["error"] and "restarted" in failed["error"]
    after = remote(service.url, rewards={"judge": 1.0})(list(SCORES),
                                                         [question()] * len(SCORES))
    assert after == list(SCORES.values())
    stats = metrics(service)
    assert stats["rewards"]["judge"]["worker_restarts"] == 1
    assert stats["failures"].get("worker_crash") == 1


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its worker processes and helpers)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(child) for child in text]
    return children


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
