"""The cluster recipes of ``examples/cluster/`` (``docs/multi-node.md``) hold together.

- The Kubernetes JobSet parses (PyYAML), its commands parse with reasonctl's own CLI, and
  what must agree does: ``--nnodes`` and the trainer pods, node ranks from the pod index,
  the rendezvous and Redis host names JobSet gives the pods.
- The SLURM batch scripts run here as SLURM would run them on two nodes: their own
  commands under ``bash``, with the variables SLURM sets, ``scontrol`` and ``srun`` played by
  stand-ins that print this machine's address and start one task per "node" with
  ``SLURM_NODEID`` set. The training script trains SFT on two launchers (gloo); the rollout
  workers script trains GRPO with a trainer node and a worker node through the
  redis-server it starts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from tests.test_fsdp import write_run_files

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"
JOBSET = CLUSTER / "k8s_jobset.yaml"
SLURM_TRAIN = CLUSTER / "slurm_train.sbatch"
SLURM_ROLLOUT = CLUSTER / "slurm_rollout_workers.sbatch"


def cli_params(*args: str) -> dict[str, Any]:
    """``reasonctl args...`` parsed by the CLI's own parser (an unknown flag fails)."""
    from reasonctl.cli.app import build_app
    from reasonctl.cli.common import init_host

    command: Any = typer.main.get_command(build_app(init_host(strict=False)))
    words, name = list(args), "reasonctl"
    while hasattr(command, "commands"):  # the group, then a sub-group (worker rollout)
        name = words.pop(0)
        command = command.commands[name]
    return dict(command.make_context(name, words).params)


def shell_words(script: str, **values: str) -> list[list[str]]:
    """The ``reasonctl`` commands of a shell snippet, variables replaced by ``values``."""
    commands = []
    for part in re.split(r";|\n", script):
        if not re.search(r"(^|\s)reasonctl\s", part):
            continue
        words = shlex.split(part)
        if "reasonctl" in words:
            words = words[words.index("reasonctl") + 1:]
            commands.append([re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)),
                                    w) for w in words])
    return commands


def test_the_jobset_parses_and_its_commands_agree() -> None:
    (jobset,) = list(yaml.safe_load_all(JOBSET.read_text()))
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/") and jobset["kind"] == "JobSet"
    name = jobset["metadata"]["name"]
    jobs = {job["name"]: job["template"]["spec"] for job in jobset["spec"]["replicatedJobs"]}
    assert set(jobs) == {"redis", "trainer", "rollout"}
    assert jobset["spec"]["successPolicy"]["targetReplicatedJobs"] == ["trainer"]

    trainer = jobs["trainer"]
    (container,) = trainer["template"]["spec"]["containers"]
    (train,) = shell_words(container["args"][0], JOB_COMPLETION_INDEX="1", REDIS_PASSWORD="pw")
    params = cli_params(*train)
    assert trainer["completionMode"] == "Indexed"
    assert int(params["nnodes"]) == trainer["parallelism"] == trainer["completions"]
    assert params["node_rank"] == 1  # from the pod's index
    assert params["rdzv_endpoint"] == f"{name}-trainer-0-0.{name}:29400"
    assert params["max_restarts"] > 0 and params["resume"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == params["nproc_per_node"]
    redis_url = f"redis://:pw@{name}-redis-0-0.{name}:6379/0"
    assert f'rollout.workers.redis_url="{redis_url}"' in params["set_"]
    assert "rollout.workers.count=0" in params["set_"]

    rollout = jobs["rollout"]
    (container,) = rollout["template"]["spec"]["containers"]
    (work,) = shell_words(container["args"][0], REDIS_PASSWORD="pw", run_id="r1")
    params = cli_params(*work)
    assert work[:2] == ["worker", "rollout"] and params["redis"] == redis_url
    rules = rollout["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [2]  # a usage error is not started again

    (redis,) = jobs["redis"]["template"]["spec"]["containers"]
    assert "--port 6379" in redis["args"][0] and "--requirepass" in redis["args"][0]
    outputs = {c["name"]: [m["mountPath"] for m in c["volumeMounts"]]
               for job in jobs.values() for c in job["template"]["spec"]["containers"]}
    assert all("/outputs" in mounts for mounts in outputs.values())


def sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.MULTILINE))


SRUN = """#!{python}
# srun on one machine: each task of --ntasks is a "node" (SLURM_NODEID), all started at once
import os, subprocess, sys
args = sys.argv[1:]
ntasks = 1
while args and args[0].startswith("-"):
    option = args.pop(0)
    key, _, value = option.partition("=")
    if key == "--ntasks":
        ntasks = int(value)
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                      "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}})
         for i in range(ntasks)]
codes = [task.wait() for task in tasks]
sys.exit(next((code for code in codes if code), 0))
"""
SCONTROL = """#!/bin/sh
# scontrol show hostnames: both "nodes" are this machine
printf '127.0.0.1\\n127.0.0.1\\n'
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def as_slurm_would(script: Path, tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ``bash`` as SLURM runs a batch script on the first of two nodes."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    options = sbatch_options(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                    os.environ["PATH"]]),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": options["job-name"], "SLURM_NNODES": "2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[001-002]",
           "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8", **variables}
    return subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)


def test_the_slurm_scripts_ask_for_one_launcher_per_node() -> None:
    for script in (SLURM_TRAIN, SLURM_ROLLOUT):
        options = sbatch_options(script)
        assert options["ntasks-per-node"] == "1" and options["signal"].startswith("TERM@")
        assert "--requeue" in script.read_text()
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_slurm_training_script_trains_on_two_nodes(tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    proc = as_slurm_would(SLURM_TRAIN, tmp_path, CONFIG=str(config), OUTPUT_DIR=str(out),
                          NPROC_PER_NODE="1", RDZV_PORT=str(free_port()))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "on cpu x2" in output  # one process on each of the two "nodes"
    assert "run completed: 6 steps" in output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]


GRPO = """
[run]
name = "cluster"
seed = 0
[model]
name_or_path = "{model}"
max_length = 64
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[algorithm]
name = "grpo"
[algorithm.grpo]
prompts_per_step = 2
[rollout]
n = 4
max_new_tokens = 4
placement = "separate"
[rollout.workers]
heartbeat_ttl_s = 2.0
max_staleness = 1
[train]
lr = 1e-2
max_steps = 3
micro_batch_size = 4
[backend]
device = "cpu"
[[rewards.components]]
name = "length"
max_length = 3
buffer = 3
[checkpoint]
export_final = false
[logging]
loggers = ["jsonl"]
"""


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.distributed
def test_the_slurm_rollout_script_trains_with_a_worker_node(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    from redis_support import NO_REDIS

    if NO_REDIS:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Item {i}. Reply with {'AB'[i % 2]}.",
                                        "reference": "AB"[i % 2]}) + "\n" for i in range(8)))
    config = tmp_path / "grpo.toml"
    config.write_text(GRPO.format(model=tiny_model_dir, data=data))
    out = tmp_path / "run"
    proc = as_slurm_would(SLURM_ROLLOUT, tmp_path, CONFIG=str(config), OUTPUT_DIR=str(out),
                          NPROC_PER_NODE="1", TRAINER_NODES="1", WORKER_DEVICES="cpu",
                          RDZV_PORT=str(free_port()), REDIS_PORT=str(free_port()))
    output = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, output[-6000:]
    assert "run completed: 3 steps" in output
    assert "rollout worker(s) joined: " in output and "-cpu (1 alive)" in output
    assert "prompt batches; the run finished (its trainer completed it)" in output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert (out / "redis" / "appendonlydir").is_dir()  # Redis kept its state for a requeue
