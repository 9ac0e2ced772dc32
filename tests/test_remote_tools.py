"""Tools run on the reward service's machine (``[tools]`` of ``reasonctl serve-rewards``),
called by the ``tools`` environment's ``[environment.tools.remote]``: a real HTTP service,
the same bearer tokens, the service's own sandbox."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.environments.config import ToolsEnvironmentConfig
from reasonctl.environments.tools_factory import build_tools_environment
from tests.service_support import AUTH, TOKEN, InProcessService, service_config

SANDBOX = {"cpu_seconds": 1.0, "wall_seconds": 3.0, "memory_mb": 256, "max_output_bytes": 4096}


@pytest.fixture(scope="module")
def service() -> Any:
    config = service_config([{"name": "exact_match"}],
                            tools={"serve": ["python", "calculator"], "sandbox": SANDBOX})
    with InProcessService(config, PluginHost.load().registry) as running:
        yield running


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _environment(service: Any, monkeypatch: pytest.MonkeyPatch, **remote: Any) -> Any:
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
    return build_tools_environment(ToolsEnvironmentConfig.model_validate({
        "tools": ["calculator", "python"], "remote": {"url": service.url, **remote}}))


def test_episodes_run_code_on_the_service(service: Any, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Any) -> None:
    environment = _environment(service, monkeypatch, timeout=20)
    assert [s["function"]["name"] for s in environment.tool_schemas()] == ["calculator",
                                                                           "python"]
    episode = environment.start(Sample([Message("user", [ContentPart("text", text="go")])]))
    marker = tmp_path / "written-by-the-tool"
    observation = episode.step(
        _call("python", {"code": "import os\nprint(os.getuid() != 0, 6 * 7)"})
        + _call("calculator", {"expression": "2 ** 10"})
        + _call("python", {"code": f"open({str(marker)!r}, 'w').write('x')"})
        + _call("python", {"code": "while True:\n    pass"}))
    results = [m.text for m in observation.messages]
    assert results[0].strip() == "True 42" and results[1] == "1024"
    assert results[2].startswith("error: exit status 1") and not marker.exists()
    assert results[3].startswith("error: killed after")
    assert episode.metrics()["tool_calls"] == 4 and episode.metrics()["tool_errors"] == 2


def test_a_misconfigured_remote_stops_the_run_before_it_starts(
        service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTHER_TOKEN", "not-the-token")
    with pytest.raises(ConfigError, match="refuses the token in OTHER_TOKEN"):
        _environment(service, monkeypatch, token_env="OTHER_TOKEN")
    with pytest.raises(ConfigError, match="environment variable UNSET_TOKEN is not set"):
        _environment(service, monkeypatch, token_env="UNSET_TOKEN")
    with pytest.raises(ConfigError, match="no tool service answers"):
        _environment(service, monkeypatch, url="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="not in environment.tools.tools"):
        monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
        build_tools_environment(ToolsEnvironmentConfig.model_validate({
            "tools": ["calculator"], "remote": {"url": service.url, "tools": ["python"]}}))


def test_the_tool_route_checks_its_requests(service: Any) -> None:
    url = f"{service.url}/api/tools/run"
    assert httpx.post(url, json={"tool": "python", "arguments": {"code": "1"}}).status_code == 401
    bad = httpx.post(url, content=b"[1, 2]", headers=AUTH)
    assert bad.status_code == 400 and "arguments" in bad.json()["error"]
    missing = httpx.post(url, json={"tool": "pyton", "arguments": {}}, headers=AUTH)
    assert missing.status_code == 404 and "did you mean 'python'?" in missing.json()["error"]
    wrong = httpx.post(url, json={"tool": "calculator", "arguments": {"code": "1"}},
                       headers=AUTH, timeout=30)
    assert wrong.status_code == 200 and "calculator takes" in wrong.json()["error"]
    assert httpx.get(f"{service.url}/health").json()["tools"] == ["calculator", "python"]


def test_a_service_of_tools_only_is_a_valid_config() -> None:
    from reasonctl.reward_service.config import validate_service_config

    registry = PluginHost.load().registry
    config = validate_service_config({"tools": {"serve": ["python"]}}, registry)
    assert config.tools.serve == ["python"] and config.rewards.components == []
    with pytest.raises(ConfigError, match="no reward to serve"):
        validate_service_config({}, registry)
    with pytest.raises(ConfigError, match="tools.serve"):
        validate_service_config({"tools": {"serve": ["shell"]}}, registry)
