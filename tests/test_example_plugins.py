"""The example plugins under ``examples/``: public API only, and the RLOO algorithm plugin
installed with pip trains, resumes exactly and runs on two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import reasonctl
from reasonctl import Sample
from tests.public_api import private_uses

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "configs" / "quickstart_grpo.toml"


# --- examples use only the public API ----------------------------------------------------------


def test_examples_import_only_the_public_api() -> None:
    files = sorted((ROOT / "examples").rglob("*.py"))
    assert any(f.parent.name == "reasonctl_rloo" for f in files)
    assert any(f.parent.name == "reasonctl_csvqa" for f in files)
    problems = [p for f in files
                for p in private_uses(f.read_text(encoding="utf-8"),
                                      filename=str(f.relative_to(ROOT)))]
    assert not problems, "examples must use only reasonctl.__all__:\n" + "\n".join(problems)


@pytest.mark.parametrize("source", [
    "import reasonctl.core.protocols",
    "from reasonctl.algorithms.grpo_loss import policy_loss",
    "from reasonctl import policy_loss, group_advantages, KINDS",
    "import reasonctl\nreasonctl.core.registry",
    "import reasonctl as rc\nrc.registry",
    "import importlib\nimportlib.import_module('reasonctl.data.datasets')",
])
def test_the_scan_reports_every_way_of_reaching_internals(source: str) -> None:
    assert len(private_uses(source)) == 1


def test_the_scan_accepts_public_names() -> None:
    source = ("import reasonctl\nimport reasonctl as rc\nfrom reasonctl import Sample, shard\n"
              "reasonctl.policy_loss, rc.RunContext, reasonctl.__version__\n"
              "from reasonctl.testing import build_component\n")
    assert private_uses(source, allowed_modules=["reasonctl.testing"]) == []
    assert private_uses(source) == ["<source>:5: from reasonctl.testing import ..."]


# --- the RLOO plugin, installed as a user would -------------------------------------------------


@pytest.fixture(scope="module")
def rloo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install examples/rloo_plugin`` into a directory to put on the path."""
    import shutil

    target = tmp_path_factory.mktemp("rloo-site")
    source = tmp_path_factory.mktemp("rloo-src") / "plugin"
    shutil.copytree(ROOT / "examples" / "rloo_plugin", source)  # builds stay out of the repo
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=300)
    return target


def _cli(*args: str, site: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "reasonctl", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _quickstart_args(out: Path, model_dir: Path, steps: int) -> list[str]:
    return ["--algo", "rloo", "--config", str(QUICKSTART), "--output-dir", str(out),
            "--set", f"model.name_or_path='{model_dir}'", "--set", f"train.max_steps={steps}",
            "--set", "algorithm.rloo.prompts_per_step=16", "--set", "eval.every_steps=10",
            "--set", "checkpoint.every_steps=0", "--set", "checkpoint.export_final=false",
            "--set", "logging.loggers=['jsonl']", "--set", "logging.plot=false"]


def _rise(steps: list[dict[str, Any]], window: int = 5) -> float:
    rewards = [row["reward/mean"] for row in steps]
    return sum(rewards[-window:]) / window - sum(rewards[:window]) / window


def test_rloo_is_listed_with_its_config_keys(rloo_site: Path) -> None:
    listing = json.loads(_cli("plugins", "--json", site=rloo_site, timeout=120).stdout)
    (rloo,) = [c for c in listing["components"]["algorithm"] if c["name"] == "rloo"]
    assert (rloo["distribution"], rloo["status"]) == ("reasonctl-rloo", "ok")
    assert {"prompts_per_step", "epsilon", "scale", "mask_truncated"} <= {
        key["key"] for key in rloo["config"]}
    misspelt = _cli("config", "validate", "--algo", "rloo", "--set",
                    "algorithm.rloo.epsilno=0.1", site=rloo_site, timeout=120)
    assert misspelt.returncode == 2
    assert "algorithm.rloo.epsilno: unknown key; did you mean 'epsilon'?" in misspelt.stderr
    one_completion = _cli("config", "validate", "--algo", "rloo", "--set", "rollout.n=1",
                          site=rloo_site, timeout=120)  # the config model's own check
    assert one_completion.returncode == 2
    assert "rollout.n: RLOO compares each completion" in one_completion.stderr


@pytest.mark.slow
def test_rloo_reward_rises_on_the_quickstart_task(rloo_site: Path, tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _cli("run", *_quickstart_args(out, tiny_model_dir, steps=20), site=rloo_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _metrics(out)
    assert [row["step"] for row in steps] == list(range(1, 21))
    assert _rise(steps) >= 0.2
    assert [row["step"] for row in steps if "eval/accuracy" in row] == [10, 20]
    assert "reward/choice/mean" in steps[-1] and "clip_frac/high" in steps[-1]


def byte_parity(completion: str, sample: Sample) -> float:
    """1 for an even number of UTF-8 bytes: a reward whose groups have spread."""
    return float(len(completion.encode()) % 2 == 0)


def _resume_config(tmp_path: Path, model_dir: Path, **overrides: Any) -> dict[str, Any]:
    data = tmp_path / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"Item {i}. Say something."}) + "\n"
                            for i in range(6)))
    config: dict[str, Any] = {
        "run": {"output_dir": str(tmp_path / "run"), "seed": 3},
        "model": {"name_or_path": str(model_dir), "max_length": 64},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "rloo", "rloo": {"prompts_per_step": 2, "scale": "group",
                                               "updates_per_rollout": 2}},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "train": {"lr": 1e-2, "max_steps": 4, "micro_batch_size": 3},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"export_final": True},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    for section, values in overrides.items():
        config[section] = {**config[section], **values}
    return config


@pytest.fixture
def one_torch_thread() -> Any:
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weights(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_rloo_resumed_run_equals_the_uninterrupted_one(
    rloo_site: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    one_torch_thread: None,
) -> None:
    monkeypatch.syspath_prepend(str(rloo_site))  # found through its entry point, as installed
    full = reasonctl.run(_resume_config(tmp_path / "full", tiny_model_dir),
                         rewards=[byte_parity])
    part = _resume_config(tmp_path / "part", tiny_model_dir, checkpoint={"every_steps": 2})
    stopped = dict(part, train={**part["train"], "max_steps": 2})
    reasonctl.run(stopped, rewards=[byte_parity])
    resumed = reasonctl.run(dict(part, run={**part["run"], "resume": True}),
                            rewards=[byte_parity])

    expected, got = _metrics(tmp_path / "full" / "run"), _metrics(tmp_path / "part" / "run")
    assert [row["step"] for row in got] == [1, 2, 3, 4]
    for key in ("reward/mean", "loss", "grad_norm", "ratio/mean"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5)
    assert any(row["loss"] != 0 for row in expected)  # the runs did learn something
    assert full.export_dir is not None and resumed.export_dir is not None
    before, after = _weights(tiny_model_dir), _weights(full.export_dir)
    assert any(not before[k].equal(after[k]) for k in before)
    resumed_weights = _weights(resumed.export_dir)
    assert all(resumed_weights[k].equal(after[k]) for k in after)


@pytest.mark.slow
@pytest.mark.distributed
def test_rloo_on_two_fsdp_processes_learns(rloo_site: Path, tiny_model_dir: Path,
                                           tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = _quickstart_args(out, tiny_model_dir, steps=20)
    proc = _cli("run", *args, "--backend", "fsdp", "--nproc-per-node", "2", site=rloo_site)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = _metrics(out)
    assert [row["step"] for row in steps] == list(range(1, 21))
    assert _rise(steps) >= 0.2
