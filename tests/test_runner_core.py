"""The runner with components registered through the public plugin API."""

from __future__ import annotations

import json
import tomllib

import pytest

import reasonctl
from reasonctl.core.checkpoint import CheckpointManager
from tests.toy_components import ToyPlugin

BASE = ["algorithm.name=toy", "backend.name=toybackend", "logging.loggers=[]",
        "train.lr=0.1", "train.max_steps=12"]


def make_config(tmp_path, *extra, plugin):
    return reasonctl.load_config(
        [], [*BASE, f"run.output_dir='{tmp_path}'", *extra], plugins=[plugin]
    )


def run_toy(tmp_path, *extra):
    plugin = ToyPlugin()
    config = make_config(tmp_path, *extra, plugin=plugin)
    result = reasonctl.run(config, plugins=[plugin])
    return result, plugin


def test_loop_fires_hooks_and_writes_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "abcd1234secret")
    result, plugin = run_toy(tmp_path, "checkpoint.every_steps=5",
                             "run.name='job-abcd1234secret'")
    assert result.status == "completed" and result.steps == 12
    kinds = [e[0] for e in plugin.events]
    assert kinds[0] == "start" and kinds[-1] == "end" and plugin.events[-1][1] == "completed"
    losses = [e[2] for e in plugin.events if e[0] == "step"]
    assert losses[-1] < losses[0] / 100
    assert [e[1] for e in plugin.events if e[0] == "checkpoint"] == [5, 10]
    saved = (tmp_path / "config.toml").read_text()
    assert "abcd1234secret" not in saved
    assert tomllib.loads(saved)["train"]["max_steps"] == 12
    assert (tmp_path / "export" / "final" / "weight.txt").is_file()
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2, is_main=True)
    assert [c.step for c in manager.complete()] == [5, 10]
    assert manager.latest().manifest["algorithm"] == {"updates": 10}


def test_resume_equals_uninterrupted(tmp_path):
    full, _ = run_toy(tmp_path / "full")
    first, _ = run_toy(tmp_path / "split", "train.max_steps=7", "checkpoint.every_steps=7",
                       "checkpoint.export_final=false")
    assert first.steps == 7
    resumed, plugin = run_toy(tmp_path / "split", "run.resume=true")
    assert [e[1] for e in plugin.events if e[0] == "step"] == list(range(8, 13))
    assert (tmp_path / "split/export/final/weight.txt").read_text() == \
        (tmp_path / "full/export/final/weight.txt").read_text()


def test_torn_checkpoint_is_skipped(tmp_path, capsys):
    run_toy(tmp_path, "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep=5")
    torn = tmp_path / "checkpoints" / "step_9"
    (torn / "state").mkdir(parents=True)  # no manifest: a save that died half-way
    (tmp_path / "checkpoints" / ".tmp-step_12").mkdir()
    result, plugin = run_toy(tmp_path, "run.resume=true", "train.max_steps=8")
    assert [e[1] for e in plugin.events if e[0] == "step"] == [7, 8]
    err = capsys.readouterr().err
    assert "skipping incomplete checkpoint" in err and "step_9" in err


def test_sigterm_saves_checkpoint_and_stops(tmp_path):
    result, plugin = run_toy(tmp_path, "algorithm.toy.signal_at_step=4")
    assert result.status == "interrupted" and result.steps == 4
    assert (tmp_path / "checkpoints" / "step_4" / "manifest.json").is_file()
    assert not (tmp_path / "export").exists()
    assert plugin.events[-1] == ("end", "interrupted")
    # the signal knob is off now: a changed algorithm setting, applied on request
    resumed, _ = run_toy(tmp_path, "run.resume=true", "run.resume_with_changes=true")
    assert resumed.steps == 12 and resumed.status == "completed"


def test_failure_is_reported_to_hooks(tmp_path):
    class Exploding(ToyPlugin):
        @reasonctl.hookimpl
        def on_step_end(self, ctx, step, metrics):
            if step == 2:
                raise RuntimeError("step hook failed")

    plugin = Exploding()
    config = make_config(tmp_path, plugin=plugin)
    with pytest.raises(RuntimeError, match="step hook failed"):
        reasonctl.run(config, plugins=[plugin])
    assert plugin.events[-1] == ("end", "failed")


def test_sdk_runs_do_not_leak_components(tmp_path):
    run_toy(tmp_path / "a")
    assert "toy" not in reasonctl.list_components("algorithm")
    with pytest.raises(reasonctl.ConfigError, match="Unknown algorithm 'toy'"):
        reasonctl.load_config([], ["algorithm.name=toy", "backend.name=toybackend"])


def test_metrics_reach_loggers_through_the_registry(tmp_path):
    logged = []

    class ListLogger:
        def __init__(self, cfg, ctx):
            self.total = ctx.total_steps

        def log(self, metrics, step):
            logged.append((step, metrics["loss"], self.total))

        def close(self):
            logged.append("closed")

    class LoggerPlugin(ToyPlugin):
        @reasonctl.hookimpl
        def register_loggers(self, register):
            register("list", ListLogger)

    plugin = LoggerPlugin()
    config = make_config(tmp_path, "logging.loggers=['list']", "logging.every_steps=5",
                         plugin=plugin)
    reasonctl.run(config, plugins=[plugin])
    assert [e[0] for e in logged[:-1]] == [5, 10, 12] and logged[-1] == "closed"
    assert logged[0][2] == 12
    assert json.loads(json.dumps(logged[0][1])) == logged[0][1]
