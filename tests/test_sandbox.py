"""The Python sandbox: escapes tried on purpose are contained and reported as tool errors
while this process (the trainer) keeps running; code rewards run in the same sandbox; a host
that cannot confine makes the run refuse to start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.environments.config import SandboxConfig, ToolsEnvironmentConfig
from reasonctl.environments.sandbox import Sandbox
from reasonctl.environments.tools_factory import build_tools_environment

LIMITS = SandboxConfig(cpu_seconds=1, wall_seconds=3, memory_mb=256, max_processes=8,
                       max_output_bytes=4096, max_file_mb=1, disk_mb=8)
SECRET = "s3cret-token-do-not-leak"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox.checked(LIMITS)


def _call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + \
        "</tool_call>"


def _tool_result(environment: Any, code: str) -> tuple[str, dict[str, float]]:
    episode = environment.start(Sample([Message("user", [ContentPart("text", text="go")])]))
    observation = episode.step(_call(code))
    assert not observation.done and len(observation.messages) == 1
    return observation.messages[0].text, episode.metrics()


@pytest.fixture(scope="module")
def environment() -> Any:
    return build_tools_environment(ToolsEnvironmentConfig(tools=["python"], sandbox=LIMITS))


def test_code_runs_and_prints(environment: Any) -> None:
    result, metrics = _tool_result(environment,
                                   "import sys\nprint(sum(range(10)), sys.flags.isolated)")
    assert result.strip() == "45 1"
    assert metrics["tool_calls"] == 1 and metrics["tool_errors"] == 0
    failing, metrics = _tool_result(environment, "print('partial')\nraise ValueError('bad input')")
    assert failing.startswith("error: exit status 1") and "ValueError: bad input" in failing
    assert "output before that:\npartial" in failing and metrics["tool_errors"] == 1


ATTACKS = {
    "read outside": ("print(open({secret_file!r}).read())", "FileNotFoundError"),
    "read host files": ("print(open('/etc/hostname').read(), open('/root/.bashrc').read())",
                        "FileNotFoundError"),
    "write outside": ("open({outside!r}, 'w').write('pwned')", "Error"),
    "write system files": ("open('/usr/pwned', 'w').write('x')", "Read-only file system"),
    "write the root": ("open('/pwned', 'w').write('x')", "Read-only file system"),
    "open a socket": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                      "timeout=2)\nprint('connected')", "OSError"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass", "killed after"),
    "allocate too much": ("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", "MemoryError"),
    "infinite loop": ("while True:\n    pass", "killed after the CPU time limit"),
    "gigabytes of output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
                            "output exceeded 4096 bytes"),
    "kill its parent": ("import os, signal\nfor pid in (os.getppid(), {trainer}, -1):\n"
                        "    try:\n        os.kill(pid, signal.SIGKILL)\n"
                        "    except OSError as exc:\n        print(pid, exc)\n"
                        "raise SystemExit(3)", ""),
    "read the trainer's environment": (
        "import os, glob\nprint(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ') + ['/proc/{trainer}/environ']:\n"
        "    try:\n        print(path, open(path).read())\n"
        "    except OSError as exc:\n        print(path, exc)\n"
        "print(os.listdir('/proc/self/fd'))\nraise SystemExit(3)", ""),
    "fill the disk": ("import os\nfor i in range(100):\n"
                      "    open(f'big{{i}}', 'wb').write(bytes(900 * 1024))", "No space"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_escapes_are_contained_and_reported_as_tool_errors(
        attack: str, environment: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REASONCTL_TEST_SECRET", SECRET)  # inherited by children, were it not
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET)
    outside = tmp_path / "pwned.txt"
    inherited = os.open(secret_file, os.O_RDONLY)
    os.set_inheritable(inherited, True)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    template, expected = ATTACKS[attack]
    code = template.format(secret_file=str(secret_file), outside=str(outside),
                           port=server.getsockname()[1], trainer=os.getpid())
    try:
        result, metrics = _tool_result(environment, code)
        with pytest.raises(TimeoutError):  # nothing got through to the host's network
            server.accept()
    finally:
        server.close()
        os.close(inherited)
    assert result.startswith("error: "), result
    assert expected in result, result
    assert metrics["tool_errors"] == 1
    assert SECRET not in result
    assert not outside.exists() and not Path("/usr/pwned").exists()
    assert secret_file.read_text() == SECRET
    if attack == "read the trainer's environment":
        assert "['0', '1', '2', '3']" in result  # stdin, stdout, stderr, the listing itself
    if attack in ("fork bomb", "kill its parent"):
        assert _sandbox_processes() == []


def _sandbox_processes() -> list[str]:
    """Processes still running the sandboxed program (none may outlive a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"main.py" in command and any(b"python" in part for part in command[:1]):
            found.append(entry.name)
    return found


def test_a_failing_sandbox_keeps_the_episode_going(environment: Any) -> None:
    episode = environment.start(Sample([Message("user", [ContentPart("text", text="go")])]))
    for code in ("while True:\n    pass", "print(6 * 7)"):
        observation = episode.step(_call(code))
    assert observation.messages[0].text.strip() == "42"
    assert episode.metrics()["tool_calls"] == 2 and episode.metrics()["tool_errors"] == 1
    assert episode.step("The answer is 42.").done


def test_code_tests_reward_runs_completions_against_their_tests() -> None:
    from reasonctl.rewards.code_tests import CodeTestsConfig, CodeTestsReward

    reward = CodeTestsReward(CodeTestsConfig(sandbox=LIMITS, workers=2))
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
    sample = Sample([Message("user", [ContentPart("text", text="Write add(a, b).")])],
                    meta={"tests": tests})
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    escape = "```python\nimport os\nos._exit(0) if False else None\ndef add(a, b):\n" \
             "    return open('/etc/hostname').read()\n```"
    untested = Sample([Message("user", [ContentPart("text", text="Hi")])])
    scores = reward([right, wrong, escape, "def add(a, b): return a + b", right],
                    [sample, sample, sample, sample, untested])
    assert scores == [1.0, pytest.approx(1 / 3), 0.0, 1.0, None]
    strict = CodeTestsReward(CodeTestsConfig(sandbox=LIMITS, partial_credit=False))
    assert strict([wrong], [sample]) == [0.0]


def test_sandbox_limits_are_configurable(sandbox: Sandbox) -> None:
    result = Sandbox(SandboxConfig(max_output_bytes=100_000)).run("print('y' * 50_000)")
    assert result.ok and len(result.stdout) == 50_001
    net = sandbox.run("import socket\nprint(socket.if_nameindex())")
    assert net.ok and net.stdout.strip() == "[(1, 'lo')]"  # only a (down) loopback


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_host_without_user_namespaces_refuses_to_start(tmp_path: Path) -> None:
    """The run is started where no more user namespaces may be created (a nested user
    namespace whose limit is used up): it must refuse, naming why, not run unconfined."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], check=False)
    if probe.returncode != 0:
        pytest.skip("this host cannot create user namespaces at all")
    config = tmp_path / "run.toml"
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "reference": "4"}) + "\n")
    config.write_text(textwrap.dedent(f"""
        [run]
        output_dir = "{tmp_path / 'out'}"
        [model]
        name_or_path = "tiny-random"
        [data.jsonl]
        path = "{data}"
        [algorithm]
        name = "grpo"
        [algorithm.grpo]
        prompts_per_step = 1
        [rollout]
        n = 2
        max_new_tokens = 4
        [environment]
        name = "tools"
        [backend]
        device = "cpu"
        [[rewards.components]]
        name = "exact_match"
    """))
    command = f"{sys.executable} -m reasonctl run --config {config}"
    script = ("echo 1 > /proc/sys/user/max_user_namespaces && "
              f"unshare --user --map-user=65534 --map-group=65534 sh -c '{command}'")
    env = {**os.environ, "REASONCTL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert "environment.tools.sandbox" in output and "user namespaces" in output
    assert "(user, PID, network, mount)" in output and "rather than run code unconfined" in output
    assert "step 1" not in output.lower()


def test_a_killed_run_leaves_nothing_behind(sandbox: Sandbox) -> None:
    """Killing the starter (as the wall-clock limit does) takes the code's processes down."""
    result = sandbox.run("import os, time\nfor _ in range(2):\n    os.fork()\ntime.sleep(60)")
    assert result.timed_out and not result.ok
    assert _sandbox_processes() == []
