"""The reward service over real HTTP on 127.0.0.1: auth, limits, malformed payloads,
batching, failures, worker crashes, media, deadlines and expiry; the remote reward against it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import reasonctl
from reasonctl.core.errors import ConfigError, RewardError, UsageError
from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.reward_service.wire import WireError, encode_request
from tests import service_rewards
from tests.service_support import AUTH, TOKEN, InProcessService, service_config

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ENQUEUE = "/api/reward/enqueue"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def registry() -> Any:
    return reasonctl.plugin_host([service_rewards]).registry


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
    return "REASONCTL_REWARD_TOKEN"


def sample(text: str = "q", reference: Any = None) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=text)])], reference=reference,
                  source=f"test:{text}")


def text_body(rewards: Any, completions: list[str], **header: Any) -> bytes:
    data = {"rewards": rewards, "completions": completions,
            "prompts": ["q"] * len(completions), **header}
    return json.dumps(data).encode() + b"\n"


def npy(array: np.ndarray, **options: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **options)
    return buffer.getvalue()


def wait_result(url: str, request_id: str, timeout: float = 60) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        response = httpx.get(f"{url}/api/reward/result/{request_id}", headers=AUTH, timeout=10)
        if response.status_code != 202:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.02)
    raise TimeoutError(request_id)


def remote(url: str, **options: Any) -> Any:
    from reasonctl.rewards.remote import RemoteConfig, remote_reward

    return remote_reward(RemoteConfig(url=url, **options))


def test_every_route_but_health_needs_the_token(registry: Any) -> None:
    config = service_config([{"name": "choice"}])
    with InProcessService(config, registry) as service:
        health = httpx.get(f"{service.url}/health")
        assert health.status_code == 200 and health.json()["rewards"] == {"choice": "text"}
        body = text_body(["choice"], ["A"])
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"}):
            for method, path, content in (("POST", ENQUEUE, body),
                                          ("GET", "/api/reward/result/x", None),
                                          ("POST", "/api/reward/pull", b'{"uuid": "x"}'),
                                          ("GET", "/metrics", None)):
                response = httpx.request(method, service.url + path, content=content,
                                         headers=headers)
                assert response.status_code == 401, (headers, path)
                assert response.headers["www-authenticate"].startswith("Bearer")
                assert TOKEN not in response.text
        assert service.metrics()["requests"]["accepted"] == 0
        ok = httpx.post(service.url + ENQUEUE, content=body, headers=AUTH)
        assert ok.status_code == 200


def test_requests_are_batched_across_clients_and_pulled_like_cosmos_rl(
        registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVICE_TEST_DELAY_S", "0.2")
    config = service_config([{"name": "tests.service_rewards:slow_length", "max_batch": 64,
                              "max_wait_ms": 100}])
    name = "tests.service_rewards:slow_length"
    with InProcessService(config, registry) as service:
        ids: dict[str, list[str]] = {}

        def send(i: int) -> None:
            texts = ["x" * (i + 1), "y" * (10 + i)]
            response = httpx.post(service.url + ENQUEUE, content=text_body({name: 2.0}, texts),
                                  headers=AUTH, timeout=30)
            ids[response.json()["uuid"]] = texts

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(ids) == 6
        for request_id, texts in ids.items():
            result = wait_result(service.url, request_id)
            assert result["status"] == "done"
            assert result["scores"][name] == [float(len(t)) for t in texts]
            assert result["total"] == [2.0 * len(t) for t in texts]
        stats = service.metrics()["rewards"][name]
        assert stats["completions"] == 12
        assert stats["batches"] < 6, "requests waiting together are scored in one call"
        # cosmos-rl's pull: POST a form with uuid and type
        first = next(iter(ids))
        pulled = httpx.post(f"{service.url}/api/reward/pull", headers=AUTH,
                            data={"uuid": first, "type": name})
        assert pulled.status_code == 200 and pulled.json()["type"] == name
        missing = httpx.post(f"{service.url}/api/reward/pull", headers=AUTH,
                             json={"uuid": "no-such-id"})
        assert missing.status_code == 404 and missing.json()["status"] == "unknown"


def test_oversized_bodies_get_413(registry: Any) -> None:
    config = service_config([{"name": "choice"}], limits={"max_body_mb": 0.01})
    with InProcessService(config, registry) as service:
        big = text_body(["choice"], ["A" * 20_000])
        response = httpx.post(service.url + ENQUEUE, content=big, headers=AUTH)
        assert response.status_code == 413 and "max_body_mb" in response.json()["error"]

        def chunks() -> Any:  # no Content-Length: counted while it streams
            for _ in range(20):
                yield b"x" * 1024

        streamed = httpx.post(service.url + ENQUEUE, content=chunks(), headers=AUTH)
        assert streamed.status_code == 413
        assert service.metrics()["requests"]["accepted"] == 0


def test_malformed_arrays_and_pickles_get_400_and_nothing_runs(
        registry: Any, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self) -> Any:
            return (os.mkdir, (str(marker),))

    config = service_config([{"name": "mean_brightness"}, {"name": "choice"}])
    header = json.dumps({"rewards": ["mean_brightness"], "media_type": "image",
                         "prompts": ["a"]}).encode() + b"\n"
    objects = np.empty(1, dtype=object)
    objects[0] = Exploit()
    bad = {
        "raw pickle": header + pickle.dumps(Exploit()),
        "pickled object array": header + npy(objects, allow_pickle=True),
        "garbage": header + b"\x93NUMPY garbage",
        "float image": header + npy(np.zeros((1, 4, 4, 3), dtype=np.float32)),
        "no channel axis": header + npy(np.zeros((1, 4, 4), dtype=np.uint8)),
        "batch mismatch": header + npy(np.zeros((2, 4, 4, 3), dtype=np.uint8)),
        "no array": header,
        "not json": b"{rewards: mean_brightness}\n",
        "unknown header key": text_body(["choice"], ["A"], rewardz=1),
        "unknown reward": text_body(["choise"], ["A"]),
        "text to an image reward": text_body(["mean_brightness"], ["A"]),
    }
    with InProcessService(config, registry) as service:
        for case, body in bad.items():
            response = httpx.post(service.url + ENQUEUE, content=body, headers=AUTH)
            assert response.status_code == 400, case
            assert response.json()["error"], case
        assert not marker.exists(), "request bytes were unpickled"
        errors = {case: httpx.post(service.url + ENQUEUE, content=body, headers=AUTH).json()
                  ["error"] for case, body in bad.items()}
        assert "allow_pickle" in errors["pickled object array"]
        assert "did you mean 'choice'" in errors["unknown reward"]
        assert "rewardz" in errors["unknown header key"]
        assert "scores image" in errors["text to an image reward"]
        assert service.metrics()["requests"]["accepted"] == 0


def test_full_queue_answers_429_and_the_client_retries_until_accepted(
        registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.reward_service.client import RewardServiceClient

    monkeypatch.setenv("SERVICE_TEST_DELAY_S", "2.0")
    name = "tests.service_rewards:slow_length"
    config = service_config([{"name": name, "max_wait_ms": 0}],
                            limits={"max_pending": 1, "retry_after_s": 1})
    with InProcessService(config, registry) as service:
        first = httpx.post(service.url + ENQUEUE, content=text_body([name], ["ab"]), headers=AUTH)
        assert first.status_code == 200
        full = httpx.post(service.url + ENQUEUE, content=text_body([name], ["abc"]), headers=AUTH)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        client = RewardServiceClient(service.url, TOKEN)
        request_id = client.enqueue(text_body([name], ["abcd"]),
                                    deadline=time.monotonic() + 30)
        assert client.retries >= 1
        answer = client.wait(request_id, deadline=time.monotonic() + 30)
        assert answer["status"] == "done" and answer["scores"][name] == [4.0]
        assert wait_result(service.url, first.json()["uuid"])["scores"][name] == [2.0]
        assert service.metrics()["requests"]["rejected_full"] >= 2


def test_a_raising_reward_fails_only_its_request_and_the_client_applies_on_error(
        registry: Any, token_env: str) -> None:
    name = "tests.service_rewards:fails_on_boom"
    config = service_config([{"name": name, "max_wait_ms": 300}])
    with InProcessService(config, registry) as service:
        good = httpx.post(service.url + ENQUEUE, content=text_body([name], ["fine"]),
                          headers=AUTH).json()["uuid"]
        bad = httpx.post(service.url + ENQUEUE, content=text_body([name], ["ok", "boom"]),
                         headers=AUTH).json()["uuid"]
        assert wait_result(service.url, good)["scores"][name] == [1.0]
        failed = wait_result(service.url, bad)
        assert failed["status"] == "failed" and "goes boom" in failed["error"]
        assert failed["error"].startswith(
            f"reward {name!r} failed on sample prompts[1]: ValueError")
        assert "rewards.on_error" not in failed["error"]
        assert "scores" not in failed

        samples = [sample("a"), sample("b")]
        raising = remote(service.url, rewards={name: 1.0})
        with pytest.raises(RewardError, match="goes boom"):
            raising(["fine", "boom"], samples)
        assert remote(service.url, rewards={name: 1.0}, on_error="zero")(
            ["fine", "boom"], samples) == [0.0, 0.0]
        assert remote(service.url, rewards={name: 1.0}, on_error="skip")(
            ["boom", "boom"], samples) == [None, None]
        assert remote(service.url, rewards={name: 0.5})(["fine", "ok"], samples) == [0.5, 0.5]
        # through the run's reward set: rewards.on_error = "zero" scores the batch 0
        rewards = RewardSet([RewardTerm("remote", raising)], on_error="zero")
        scores = rewards.score(["fine", "boom"], samples)
        assert scores.totals == [0.0, 0.0] and scores.metrics["reward/errors"] == 2.0
        assert service.metrics()["failures"] == {"reward_error": 5}


def test_a_crashed_worker_process_fails_its_requests_and_is_restarted(registry: Any) -> None:
    name = "tests.service_rewards:crash_on_crash"
    pinned = "tests.service_rewards:visible_device"
    config = service_config([{"name": name, "max_wait_ms": 0},
                             {"name": pinned, "devices": ["cuda:3"]}],
                            workers={"kind": "process"})
    with InProcessService(config, registry) as service:
        on_device = httpx.post(service.url + ENQUEUE, content=text_body([pinned], ["a"]),
                               headers=AUTH).json()["uuid"]
        assert wait_result(service.url, on_device)["scores"][pinned] == [3.0]
        crashed = httpx.post(service.url + ENQUEUE, content=text_body([name], ["crash"]),
                             headers=AUTH).json()["uuid"]
        result = wait_result(service.url, crashed)
        assert result["status"] == "failed" and "crashed" in result["error"]
        assert "exit code 3" in result["error"]
        after = httpx.post(service.url + ENQUEUE, content=text_body([name], ["fine"]),
                           headers=AUTH).json()["uuid"]
        assert wait_result(service.url, after)["scores"][name] == [2.0]
        stats = service.metrics()["rewards"][name]
        assert stats["worker_restarts"] == 1


def test_media_rewards_score_images_and_latents_through_the_remote_reward(
        registry: Any, token_env: str) -> None:
    config = service_config([{"name": "mean_brightness"}, {"name": "latent_norm"}])
    with InProcessService(config, registry) as service:
        images = [np.full((4, 6, 3), value, dtype=np.uint8) for value in (0, 51, 255)]
        reward = remote(service.url, rewards={"mean_brightness": 1.0}, media_type="image",
                        chunk_size=2)
        assert isinstance(reward, reasonctl.ScoresMedia) and reward.media_type == "image"
        assert reward(images, [sample()] * 3) == pytest.approx([0.0, 0.2, 1.0])
        latents = [np.full((2, 3, 4), -0.5, dtype=np.float16), np.ones((2, 3, 4), np.float16)]
        reward = remote(service.url, rewards={"latent_norm": 1.0}, media_type="latent")
        assert reward(latents, [sample()] * 2) == pytest.approx([0.5, 1.0])
        # a reward of another medium is refused when the remote reward is built
        with pytest.raises(UsageError, match="'mean_brightness' scores image there, and this "
                                             "reward sends video"):
            remote(service.url, rewards={"mean_brightness": 1.0}, media_type="video")
        with pytest.raises(WireError, match=r"videos are uint8 \[T, H, W, 3\]"):
            encode_request({"mean_brightness": 1.0}, [np.zeros((4, 6, 3), np.uint8)],
                           [sample()], media_type="video")
        image_header = json.dumps({"rewards": ["mean_brightness"], "media_type": "image",
                                   "prompts": ["a"]}).encode() + b"\n"
        ok = httpx.post(service.url + ENQUEUE, headers=AUTH,
                        content=image_header + npy(np.full((1, 2, 2, 3), 255, np.uint8)))
        assert wait_result(service.url, ok.json()["uuid"])["scores"]["mean_brightness"] == [1.0]


def test_deadlines_fail_late_requests_and_results_expire(
        registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVICE_TEST_DELAY_S", "1.5")
    name = "tests.service_rewards:slow_length"
    config = service_config([{"name": name, "max_wait_ms": 0}],
                            limits={"deadline_s": 0.5, "result_ttl_s": 1.0})
    with InProcessService(config, registry) as service:
        late = httpx.post(service.url + ENQUEUE, content=text_body([name], ["ab"]),
                          headers=AUTH).json()["uuid"]
        result = wait_result(service.url, late)
        assert result["status"] == "failed" and "deadline exceeded" in result["error"]
        time.sleep(3.0)  # the scoring finishes after the deadline: ignored; then it expires
        gone = httpx.get(f"{service.url}/api/reward/result/{late}", headers=AUTH)
        assert gone.status_code == 404
        assert service.metrics()["failures"] == {"deadline": 1}


def test_service_config_reports_every_problem(registry: Any) -> None:
    from reasonctl.reward_service.config import validate_service_config

    with pytest.raises(ConfigError) as info:
        validate_service_config({
            "server": {"prot": 80},
            "limits": {"max_pending": 0},
            "queue": {"backend": "redis"},
            "rewards": {"components": [
                {"name": "choise"}, {"name": "length", "max_lenght": 3, "weight": 2.0},
                {"name": "choice", "devices": ["gpu0"]},
            ]},
        }, registry)
    problems = "\n".join(info.value.problems)
    for expected in ("server.prot: unknown key; did you mean 'port'",
                     "limits.max_pending: Input should be greater than 0",
                     "queue: Value error, backend = \"redis\" needs redis_url",
                     "rewards.components.0.name: Unknown reward 'choise'",
                     "rewards.components.1.max_lenght: unknown key; did you mean 'max_length'",
                     "rewards.components.1.weight: weights are chosen by each client",
                     "rewards.components.2.devices.0: a device is \"cpu\" or \"cuda:N\"",
                     "rewards.components.2.devices: devices pin worker processes"):
        assert expected in problems, problems


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reasonctl", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_serve_rewards_cli_checks_the_config_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "service.toml"
    config.write_text('[[rewards.components]]\nname = "choice"\n')
    env = {k: v for k, v in os.environ.items() if k != "REASONCTL_REWARD_TOKEN"}
    missing = _run("serve-rewards", "--config", str(config), "--check", env=env)
    assert missing.returncode == 2 and "auth.token_env: environment variable " \
        "REASONCTL_REWARD_TOKEN is not set" in missing.stderr
    # the hint survives the redaction of printed errors
    assert "`export REASONCTL_REWARD_TOKEN=$(openssl rand -hex 32)`" in \
        "".join(missing.stderr.split("\n"))
    ok = _run("serve-rewards", "--config", str(config), "--check",
              env={**env, "REASONCTL_REWARD_TOKEN": TOKEN})
    assert ok.returncode == 0, ok.stderr
    assert "serves choice" in ok.stdout and TOKEN not in ok.stdout + ok.stderr
    config.write_text('[limits]\nmax_body = 3\n[[rewards.components]]\nname = "math"\nbad = 1\n')
    bad = _run("serve-rewards", "--config", str(config), "--check",
               env={**env, "REASONCTL_REWARD_TOKEN": TOKEN})
    assert bad.returncode == 2
    assert "limits.max_body: unknown key; did you mean 'max_body_mb'" in bad.stderr
    assert "rewards.components.0.bad: unknown key" in bad.stderr


def test_the_example_service_config_is_valid(registry: Any) -> None:
    from reasonctl.reward_service.config import load_service_config

    config = load_service_config(REPO / "examples/configs/reward_service.toml", registry)
    assert [r.name for r in config.rewards.components] == ["math", "format", "choice"]
    assert config.rewards.components[1].options == {"answer_tag": "answer"}
