"""The console, jsonl, tensorboard and wandb loggers and the training-curve plot."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.config import RunConfig, load_config
from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.protocols import Logger, RunContext

STAND_IN = "loggers-test"


class _StandIns:
    """Components under the config's selector keys, so configs validate on their own.

    Their factories are only called by the end-to-end runner test.
    """

    @hookimpl
    def register_algorithms(self, register: Any) -> None:
        register(STAND_IN, lambda cfg: _CountdownAlgorithm())

    @hookimpl
    def register_backends(self, register: Any) -> None:
        register(STAND_IN, lambda cfg: _NullBackend())

    @hookimpl
    def register_datasets(self, register: Any) -> None:
        register(STAND_IN, lambda cfg, **kwargs: [])

    @hookimpl
    def register_rollout_engines(self, register: Any) -> None:
        register(STAND_IN, lambda cfg, **kwargs: None)


class _CountdownAlgorithm:
    """Ten steps whose loss halves each step."""

    def setup(self, ctx: RunContext) -> None:
        ctx.total_steps = 10

    def step(self, ctx: RunContext) -> dict[str, float]:
        return {"loss": 2.0 ** -ctx.step, "lr": 1e-5, "grad_norm": 1.0, "tokens": 512.0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _NullBackend:
    """One CPU process with nothing to train (what the loop never calls raises)."""

    rank, world_size, is_main, device = 0, 1, True, "cpu"

    def setup(self, ctx: RunContext) -> None:
        pass

    def _unused(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the logger tests never train, save or export")

    token_outputs = train_step = save_checkpoint = load_checkpoint = export = _unused
    full_state_dict = all_reduce_mean = _unused

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def host() -> PluginHost:
    """Installed plugins plus the stand-in components."""
    host = PluginHost.load()
    host.add_plugin(_StandIns(), name="loggers-test-stand-ins")
    return host


def make_config(host: PluginHost, output_dir: Path, *overrides: str) -> RunConfig:
    """A validated run config writing to ``output_dir``."""
    selectors = {
        "algorithm": {"name": STAND_IN},
        "backend": {"name": STAND_IN},
        "data": {"format": STAND_IN},
        "rollout": {"engine": STAND_IN},
        "run": {"name": "logger-test", "output_dir": str(output_dir)},
    }
    return load_config(registry=host.registry, values=selectors, overrides=overrides)


def make_ctx(host: PluginHost, tmp_path: Path, *overrides: str, step: int = 0,
             total_steps: int = 10) -> RunContext:
    """A run context as the runner has it after ``algorithm.setup`` (and resuming)."""
    config = make_config(host, tmp_path / "run", *overrides)
    return RunContext(config=config, registry=host.registry, hooks=host.hooks,
                      output_dir=Path(config.run.output_dir), total_steps=total_steps, step=step)


def build_logger(ctx: RunContext, name: str) -> Logger:
    """Build a logger exactly as the runner does."""
    spec = ctx.registry.get("logger", name)
    return spec.build(ctx.component_config("logging", name), ctx=ctx)


def metrics_at(step: int) -> dict[str, float]:
    return {"loss": 1.0 / step, "lr": 1e-5 * step, "reward/mean": 0.1 * step}


# --- registration and config ------------------------------------------------------------


def test_loggers_register_typed_config_sections(host: PluginHost, tmp_path: Path) -> None:
    assert {"console", "jsonl", "tensorboard", "wandb"} <= set(host.registry.names("logger"))
    config = make_config(host, tmp_path, "logging.jsonl.filename=m.jsonl",
                         "logging.wandb.tags=['a','b']", "logging.console.every_steps=3")
    assert config.component_config("logging", "jsonl").filename == "m.jsonl"
    assert config.component_config("logging", "wandb").tags == ["a", "b"]
    assert config.component_config("logging", "tensorboard").log_dir == "tensorboard"
    with pytest.raises(ConfigError) as info:
        make_config(host, tmp_path, "logging.jsonl.file=m.jsonl", "logging.wandb.mode=cloud")
    message = str(info.value)
    assert "logging.jsonl.file: unknown key; did you mean 'filename'?" in message
    assert "logging.wandb.mode" in message


# --- jsonl ------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_appends_one_flushed_record_per_step(host: PluginHost, tmp_path: Path) -> None:
    ctx = make_ctx(host, tmp_path, "logging.plot=false")
    logger = build_logger(ctx, "jsonl")
    path = ctx.output_dir / "metrics.jsonl"
    logger.log({"loss": 0.5, "count": 3, "step_time_s": 0.25}, 1)
    assert read_lines(path)[0]["loss"] == 0.5  # visible before close
    logger.log({"loss": math.nan, "kl": math.inf, "entropy": -math.inf}, 2)
    logger.close()

    records = read_lines(path)  # strict JSON: no bare NaN/Infinity tokens
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["count"] == 3 and records[0]["step_time_s"] == 0.25
    assert all(isinstance(r["time"], float) and r["time"] > 1.6e9 for r in records)
    assert records[1] == {"step": 2, "time": records[1]["time"], "loss": "NaN",
                          "kl": "Infinity", "entropy": "-Infinity"}

    from reasonctl.loggers.metrics_file import read_metrics

    decoded = read_metrics(path)[1]
    assert math.isnan(decoded["loss"]) and decoded["kl"] == math.inf
    assert decoded["entropy"] == -math.inf
    assert not (ctx.output_dir / "training_curves.png").exists()


def test_jsonl_resume_drops_steps_after_the_checkpoint(host: PluginHost, tmp_path: Path) -> None:
    first = make_ctx(host, tmp_path, "logging.plot=false")
    logger = build_logger(first, "jsonl")
    for step in range(1, 7):
        logger.log({"loss": float(step)}, step)
    logger.close()
    path = first.output_dir / "metrics.jsonl"
    with path.open("a") as handle:  # the crash tore the next line
        handle.write('{"step": 7, "lo')

    resumed = make_ctx(host, tmp_path, "logging.plot=false", step=4)
    logger = build_logger(resumed, "jsonl")
    assert [r["step"] for r in read_lines(path)] == [1, 2, 3, 4]
    for step in (5, 6, 7):
        logger.log({"loss": 10.0 * step}, step)
    logger.close()

    records = read_lines(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 4.0, 50.0, 60.0, 70.0]


def test_jsonl_resume_keeps_a_file_that_is_consistent(host: PluginHost, tmp_path: Path) -> None:
    ctx = make_ctx(host, tmp_path, "logging.plot=false")
    logger = build_logger(ctx, "jsonl")
    for step in (1, 2):
        logger.log({"loss": 1.0}, step)
    logger.close()
    path = ctx.output_dir / "metrics.jsonl"
    before = path.read_bytes()
    build_logger(make_ctx(host, tmp_path, "logging.plot=false", step=2), "jsonl").close()
    assert path.read_bytes() == before


def test_jsonl_new_run_moves_previous_metrics_aside(host: PluginHost, tmp_path: Path) -> None:
    ctx = make_ctx(host, tmp_path, "logging.plot=false")
    for run in range(3):
        logger = build_logger(ctx, "jsonl")
        logger.log({"run": float(run)}, 1)
        logger.close()
    out = ctx.output_dir
    assert read_lines(out / "metrics.jsonl")[0]["run"] == 2
    assert read_lines(out / "metrics.1.jsonl")[0]["run"] == 0
    assert read_lines(out / "metrics.2.jsonl")[0]["run"] == 1


# --- training curves --------------------------------------------------------------------


def test_jsonl_close_draws_training_curves(host: PluginHost, tmp_path: Path) -> None:
    from PIL import Image

    ctx = make_ctx(host, tmp_path, "logging.jsonl.filename=logs/m.jsonl")
    assert ctx.config.logging.plot
    logger = build_logger(ctx, "jsonl")
    for step in range(1, 81):
        logger.log({
            "loss": 2.0 / step, "reward/mean": 1 - 1 / step, "reward/std": 0.1, "lr": 1e-5,
            "grad_norm": 1.0 + (step % 3), "kl": 0.01 * step, "step_time_s": 0.2,
            "loss/extra_term": 0.0,
        }, step)
    logger.log({"loss": math.nan, "kl": math.inf}, 81)
    logger.close()

    png = ctx.output_dir / "training_curves.png"
    assert png.stat().st_size > 10_000
    with Image.open(png) as image:
        assert image.format == "PNG"
        # Five key metrics (loss, reward, lr, grad_norm, kl) on a 3-column grid of 2 rows.
        assert image.size == (1380, 640)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50  # curves drawn, not a blank canvas


def test_panels_follow_key_metrics_or_fall_back(tmp_path: Path) -> None:
    from reasonctl.loggers.plot import choose_panels, plot_training_curves

    records = [{"step": 1, "time": 1.0, "loss": 1.0, "entropy/mean": 2.0, "response_length": 9,
                "note": "text", "step_time_s": 0.1}]
    assert choose_panels(records) == [("loss", "loss"), ("entropy", "entropy/mean"),
                                      ("response length (tokens)", "response_length")]
    other = [{"step": 1, "time": 1.0, "accuracy": 0.5, "step_time_s": 0.1}]
    assert choose_panels(other) == [("accuracy", "accuracy")]

    empty = tmp_path / "m.jsonl"
    empty.write_text('{"step": 1, "time": 1.0, "note": "no numbers"}\n')
    assert plot_training_curves(empty, tmp_path / "curves.png") is None
    assert not (tmp_path / "curves.png").exists()


# --- tensorboard ------------------------------------------------------------------------


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_writes_scalars_and_purges_on_resume(host: PluginHost,
                                                         tmp_path: Path) -> None:
    ctx = make_ctx(host, tmp_path)
    logger = build_logger(ctx, "tensorboard")
    for step in range(1, 6):
        logger.log({**metrics_at(step), "note": "not a number"}, step)
    logger.close()
    log_dir = ctx.output_dir / "tensorboard"
    written = scalars(log_dir)
    assert set(written) == {"loss", "lr", "reward/mean"}
    assert [s for s, _ in written["loss"]] == [1, 2, 3, 4, 5]
    assert written["loss"][3][1] == pytest.approx(0.25)

    resumed = build_logger(make_ctx(host, tmp_path, step=3), "tensorboard")
    resumed.log({"loss": 40.0}, 4)
    resumed.close()
    loss = scalars(log_dir)["loss"]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 40.0)]


# --- wandb ------------------------------------------------------------------------------


def wandb_records(run_file: Path) -> list[Any]:
    """Decode the records of an offline ``run-*.wandb`` file (LevelDB log framing)."""
    from wandb.proto import wandb_internal_pb2

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_records_when_complete(run_file: Path, timeout_s: float = 60.0) -> list[Any]:
    """Records of an offline run file once its exit record is on disk.

    ``run.finish()`` returns when wandb's service has handled the exit; on a busy machine
    its writer may flush the file a moment later.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = wandb_records(run_file)
        except Exception:  # a record still being written decodes as garbage
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            kinds = sorted({r.WhichOneof("record_type") for r in records})
            raise AssertionError(f"{run_file} has no exit record after {timeout_s}s: {kinds}")
        time.sleep(0.2)


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    """History rows of an offline wandb run file, in order."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_metrics_and_no_secrets(
    host: PluginHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, cli_secret = "hf_loggersTestSecret123", "s3SecretOnTheCommandLine"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setattr(sys, "argv", ["reasonctl", "run", "--set",
                                      f"storage.s3.secret_access_key={cli_secret}"])
    ctx = make_ctx(host, tmp_path, f"model.name_or_path=org/{secret}",
                   "logging.wandb.tags=['ci']")
    logger = build_logger(ctx, "wandb")
    assert logger.mode == "offline"
    for step in range(1, 4):
        logger.log(metrics_at(step), step)
    logger.close()

    runs = list((ctx.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and logger.run_dir is not None
    assert runs[0].resolve() == logger.run_dir.resolve()
    records = wandb_records_when_complete(next(runs[0].glob("run-*.wandb")))
    history = wandb_history(records)
    if history:
        assert [h["_step"] for h in history] == [1, 2, 3]
        assert [h["loss"] for h in history] == pytest.approx([1.0, 0.5, 1 / 3])
        assert history[2]["reward/mean"] == pytest.approx(0.3)
    else:  # a busy machine may leave wandb's history requests unmerged: the summary remains
        summary = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for r in records if r.WhichOneof("record_type") == "summary"
                   for item in r.summary.update}
        assert summary["loss"] == pytest.approx(1 / 3) and summary["_step"] == 3
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "logger-test" and run.project == "reasonctl"
    assert list(run.tags) == ["ci"]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
              for item in run.config.update}
    assert config["model"]["name_or_path"] == "org/***"
    assert config["logging"]["loggers"] == ["console", "jsonl"]

    for path in ctx.output_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and cli_secret.encode() not in data, path


def test_wandb_mode_and_argv_redaction() -> None:
    from reasonctl.loggers.wandb import redact_argv, resolve_mode

    assert resolve_mode(None, {}) == "offline"
    assert resolve_mode(None, {"WANDB_API_KEY": "k" * 40}) == "online"
    assert resolve_mode(None, {"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_mode("offline", {"WANDB_API_KEY": "k" * 40}) == "offline"
    assert redact_argv(["--set", "storage.s3.secret_key=abc", "--set", "rollout.max_new_tokens=64",
                        "--hub-token", "xyz", "--config", "a.toml", "--token=q"]) == [
        "--set", "storage.s3.secret_key=***", "--set", "rollout.max_new_tokens=64",
        "--hub-token", "***", "--config", "a.toml", "--token=***"]


# --- console ----------------------------------------------------------------------------


def test_console_prints_periodic_lines_without_a_terminal(
    host: PluginHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = make_ctx(host, tmp_path, total_steps=40)
    logger = build_logger(ctx, "console")
    for step in range(1, 40):
        logger.log({**metrics_at(step), "tokens": 1000.0, "step_time_s": 0.5}, step)
    logger.close()  # step 39 was not due: close shows it
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert [line.split(" ")[1] for line in lines] == (
        ["1/40"] + [f"{s}/40" for s in range(2, 40, 2)] + ["39/40"]
    )
    assert lines[1].startswith("step 2/40 (5%) | loss 0.5 | lr 2.00e-05 | tok/s 2.0k | "
                               "reward 0.2 | elapsed 0:00:00 | eta 0:00:00")


def test_console_every_steps_and_final_step(host: PluginHost, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ctx = make_ctx(host, tmp_path, "logging.console.every_steps=4", step=2, total_steps=10)
    logger = build_logger(ctx, "console")
    for step in range(3, 11):
        logger.log({"loss": 1.0, "tokens_per_s": 950.0}, step)
    logger.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" ")[1] for line in lines] == ["3/10", "4/10", "8/10", "10/10"]
    assert "tok/s 950" in lines[0] and "eta" not in lines[-1]


def test_console_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    from reasonctl.loggers.console import ConsoleLogger

    logger = ConsoleLogger(5, interactive=True)
    for step in range(1, 6):
        logger.log({"loss": 0.125, "lr": 3e-4, "reward/mean": 0.75}, step)
    logger.close()
    err = capsys.readouterr().err
    assert "5/5" in err and "loss 0.125 · lr 3.00e-04 · reward 0.75" in err


def test_console_shows_each_evaluation_on_a_line_of_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    from reasonctl.loggers.console import ConsoleLogger

    for interactive in (False, True):
        logger = ConsoleLogger(40, every_steps=20, interactive=interactive)
        for step in range(1, 41):
            metrics: dict[str, float] = {"loss": 1.0 / step}
            if step % 10 == 0:  # not every evaluation falls on a printed step
                metrics.update({"eval/accuracy": step / 80, "eval/gsm/accuracy": step / 40,
                                "eval/math/accuracy": 0.0, "time/eval_s": 1.0})
            if step == 15:  # a diffusion model's evaluation
                metrics.update({"eval/reward/mean": 0.4375, "eval/reward/std": 0.1})
            logger.log(metrics, step)
        logger.close()
        lines = [line for line in capsys.readouterr().err.splitlines() if " eval: " in line]
        assert lines == [
            "step 10/40 eval: accuracy 0.125 · gsm 0.25 · math 0",
            "step 15/40 eval: reward 0.4375",
            "step 20/40 eval: accuracy 0.25 · gsm 0.5 · math 0",
            "step 30/40 eval: accuracy 0.375 · gsm 0.75 · math 0",
            "step 40/40 eval: accuracy 0.5 · gsm 1 · math 0",
        ], interactive


def test_evaluation_gets_a_panel_with_each_source(tmp_path: Path) -> None:
    from PIL import Image

    from reasonctl.loggers.plot import choose_panels, plot_training_curves

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "time": 1.0, "loss": 1 / s} for s in range(1, 21)]
    for row in rows[4::5]:
        row.update({"eval/accuracy": row["step"] / 20, "eval/gsm/accuracy": 0.5,
                    "eval/math/accuracy": row["step"] / 40})
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert choose_panels(rows) == [("loss", "loss"), ("evaluation", "eval/accuracy")]
    png = plot_training_curves(metrics, tmp_path / "curves.png")
    assert png is not None
    with Image.open(png) as image:
        assert image.size == (920, 320)  # two panels
    diffusion = [{"step": 3, "time": 1.0, "loss": 1.0, "eval/reward/mean": 0.2}]
    assert ("evaluation", "eval/reward/mean") in choose_panels(diffusion)


def test_number_formats() -> None:
    from reasonctl.loggers.console import (
        format_count,
        format_duration,
        format_lr,
        format_number,
    )

    assert (format_lr(1e-5), format_lr(0.0), format_lr(3e-4)) == ("1.00e-05", "0", "3.00e-04")
    assert (format_number(1.23456), format_number(math.nan)) == ("1.235", "nan")
    assert (format_count(950), format_count(3100), format_count(1.24e7)) == ("950", "3.1k",
                                                                             "12.4M")
    assert format_duration(3725.7) == "1:02:05"


# --- through the runner -----------------------------------------------------------------


def test_runner_drives_the_loggers(host: PluginHost, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from reasonctl.runtime.runner import run

    config = make_config(host, tmp_path / "run", "logging.every_steps=3",
                         "logging.loggers=['console', 'jsonl', 'tensorboard']",
                         "checkpoint.export_final=false")
    result = run(config, host=host)
    assert result.status == "completed" and result.steps == 10
    records = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 6, 9, 10]
    assert records[0]["loss"] == pytest.approx(0.25) and "step_time_s" in records[0]
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 0
    assert [s for s, _ in scalars(tmp_path / "run" / "tensorboard")["loss"]] == [3, 6, 9, 10]
    assert "step 10/10 (100%) | loss 0.001953 | lr 1.00e-05" in capsys.readouterr().err


def test_logger_registration_loads_each_logger_only_when_its_hook_runs() -> None:
    """Importing the registration modules loads no logger; their hooks register factories and
    config models from ``reasonctl.loggers`` without importing wandb, matplotlib or torch."""
    script = """
import json, sys
from reasonctl.plugins.loggers import console, jsonl, tensorboard, wandb
before = sorted(m for m in sys.modules if m.startswith("reasonctl.loggers"))
seen = {}
def register(name, factory, *, config_model=None, description=""):
    seen[name] = [factory.__module__, config_model.__module__]
for module in (console, jsonl, tensorboard, wandb):
    module.register_loggers(register)
heavy = [m for m in ("wandb", "matplotlib", "torch") if m in sys.modules]
print(json.dumps({"before": before, "seen": seen, "heavy": heavy}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["before"] == []
    assert report["seen"] == {
        name: [f"reasonctl.loggers.{name}"] * 2
        for name in ("console", "jsonl", "tensorboard", "wandb")
    }
    assert report["heavy"] == []
