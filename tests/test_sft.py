"""The sft algorithm end to end on the tiny model: learning, data order, batch splitting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reasonctl import hookimpl
from reasonctl.algorithms.sampling import BatchLayout, EpochSampler
from reasonctl.core.config import TrainSection
from reasonctl.core.errors import ConfigError
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.sdk.api import run


def chat(question: str, answer: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=question)]),
                   Message("assistant", [ContentPart("text", text=answer)])])


def arithmetic(n: int) -> list[Sample]:
    return [chat(f"{i}+{i}?", f"<think>{i}+{i}={2 * i}</think><answer>{2 * i}</answer>")
            for i in range(n)]


class StepRecorder:
    """Collects every step's metrics through the on_step_end hook."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append(dict(metrics))

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def sft_config(output_dir: Path, **train: Any) -> dict[str, Any]:
    values = {"lr": 1e-2, "max_steps": 6, "global_batch_size": 4, "micro_batch_size": 2}
    values.update(train)
    return {
        "run": {"output_dir": str(output_dir), "seed": 0},
        "train": values,
        "backend": {"name": "single", "device": "cpu"},
        "logging": {"loggers": []},
        "checkpoint": {"export_final": False},
    }


def test_loss_falls_well_below_its_start_on_memorisable_data(tmp_path: Path) -> None:
    recorder = StepRecorder()
    result = run(sft_config(tmp_path, max_steps=40, global_batch_size=8, warmup_steps=2,
                            schedule="cosine", min_lr_ratio=0.1),
                 datasets=arithmetic(8), plugins=[recorder])
    assert result.status == "completed" and result.steps == 40
    losses = recorder.losses
    assert len(losses) == 40
    assert sum(losses[-3:]) / 3 < 0.4 * losses[0]
    first = recorder.metrics[0]
    assert first["lr"] == pytest.approx(1e-2 / 2)  # first warmup step
    assert recorder.metrics[-1]["lr"] < 1e-2
    assert first["grad_norm"] > 0 and first["tokens_per_s"] > 0 and first["loss_tokens"] > 0
    assert first["truncated"] == 0


def test_global_batch_split_does_not_change_the_update(tmp_path: Path) -> None:
    """One sample per micro-batch or the whole batch at once: same loss and gradient."""
    runs = {}
    for micro in (1, 4):
        recorder = StepRecorder()
        run(sft_config(tmp_path / f"m{micro}", max_steps=3, micro_batch_size=micro),
            datasets=arithmetic(8), plugins=[recorder])
        runs[micro] = recorder.metrics
    for split, whole in zip(runs[1], runs[4], strict=True):
        assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)


def test_sample_reduction_weights_each_sample_equally(tmp_path: Path) -> None:
    data = [chat("a?", "x"), chat("b?", "a much longer answer " * 4)]
    token, sample = StepRecorder(), StepRecorder()
    base = sft_config(tmp_path / "t", max_steps=1, global_batch_size=2)
    run(base, datasets=data, plugins=[token])
    per_sample = sft_config(tmp_path / "s", max_steps=1, global_batch_size=2)
    per_sample["algorithm"] = {"name": "sft", "sft": {"loss_reduction": "sample"}}
    run(per_sample, datasets=data, plugins=[sample])
    assert token.losses[0] != pytest.approx(sample.losses[0], rel=1e-3)
    assert token.losses[0] > 0 and sample.losses[0] > 0


def test_epochs_set_the_number_of_steps_and_truncation_is_counted(tmp_path: Path) -> None:
    recorder = StepRecorder()
    config = sft_config(tmp_path, max_steps=None, epochs=2, global_batch_size=4)
    del config["train"]["max_steps"]
    config["model"] = {"max_length": 24}
    result = run(config, datasets=arithmetic(6), plugins=[recorder])
    assert result.steps == 2 * 6 // 4
    assert recorder.metrics[-1]["epoch"] == pytest.approx(3 * 4 / 6)
    assert all(m["truncated"] == 4 for m in recorder.metrics)


def test_bad_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    no_answer = Sample([Message("user", [ContentPart("text", text="no reply")])], source="x:3")
    config = sft_config(tmp_path, max_steps=2, global_batch_size=4)
    config["data"] = {"on_bad_row": "skip", "shuffle": False}
    result = run(config, datasets=[*arithmetic(3), no_answer])
    assert result.status == "completed"
    # the bad sample is drawn once per step; it is one bad row, counted and listed once
    assert result.skipped_rows == 1
    listed = (tmp_path / "skipped_rows.jsonl").read_text().splitlines()
    assert len(listed) == 1 and '"row": "x:3"' in listed[0]


def test_bad_row_stops_the_run_by_default(tmp_path: Path) -> None:
    no_answer = Sample([Message("user", [ContentPart("text", text="no reply")])], source="x:3")
    with pytest.raises(Exception, match="x:3"):
        run(sft_config(tmp_path, max_steps=1), datasets=[*arithmetic(3), no_answer])


def test_too_small_dataset_names_the_setting(tmp_path: Path) -> None:
    config = sft_config(tmp_path, global_batch_size=8)
    del config["train"]["max_steps"]
    with pytest.raises(ConfigError, match="global_batch_size"):
        run(config, datasets=arithmetic(3))


def test_sampler_stream_resumes_exactly_and_reshuffles_each_epoch() -> None:
    full = EpochSampler(10, seed=3)
    stream = full.take(7) + full.take(7) + full.take(7)
    first = EpochSampler(10, seed=3)
    head = first.take(7) + first.take(7)
    resumed = EpochSampler(10, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert head + resumed.take(7) == stream
    assert sorted(stream[:10]) == list(range(10)) and stream[:10] != stream[10:20]
    assert EpochSampler(5, seed=0, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(10, seed=4).load_state_dict(first.state_dict())


def test_batch_layout_splits_ranks_and_micro_batches() -> None:
    layout = BatchLayout.from_train(TrainSection(global_batch_size=8, micro_batch_size=2), 2)
    assert (layout.per_rank, layout.grad_accum) == (4, 2)
    items = list(range(8))
    assert layout.rank_slice(items, 1) == [4, 5, 6, 7]
    assert layout.micro_chunks(layout.rank_slice(items, 0)) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="multiple of world size"):
        BatchLayout.from_train(TrainSection(global_batch_size=6, micro_batch_size=4), 1)


REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("quickstart_sft", "qwen2_5_sft", "qwen2_5_vl_video_sft", "llava_sft")


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_configs_validate(name: str) -> None:
    from reasonctl import load_config

    config = load_config(REPO / "examples" / "configs" / f"{name}.toml")
    assert config.algorithm.name == "sft"


@pytest.mark.slow
def test_quickstart_learns_the_bundled_data(tmp_path: Path, monkeypatch: Any) -> None:
    from reasonctl import load_config
    from reasonctl.runtime.runner import run as run_config

    monkeypatch.chdir(REPO)  # the config's data path is relative to the repository root
    recorder = StepRecorder()
    config = load_config(REPO / "examples" / "configs" / "quickstart_sft.toml", [
        f"run.output_dir={tmp_path}", "logging.loggers=[]", "backend.device=cpu",
    ])
    from reasonctl.core.plugins import PluginHost

    host = PluginHost.load()
    host.add_plugin(recorder, name="recorder")
    result = run_config(config, host=host)
    assert result.status == "completed" and result.export_dir is not None
    assert recorder.losses[-1] < 0.5 * recorder.losses[0]
