"""``reasonctl eval --config``: several video multiple-choice benchmarks on the tiny VLM,
one JSON per sample, resumable, accuracy table, CSV and bar chart; verdicts are the
rewards' verdicts."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.data_factories import write_chat_jsonl, write_tiny_mp4

OPTIONS = ["a red ball", "a blue box", "a green cone", "nothing"]


def _benchmark(root: Path, name: str, count: int) -> Path:
    rows = []
    for i in range(count):
        clip = write_tiny_mp4(root / name / "clips" / f"{i}.mp4", frames=6 + 2 * i, fps=4,
                              size=(32, 32))
        rows.append({"prompt": [{"type": "video", "video": f"clips/{clip.name}"},
                                {"type": "text", "text": f"Clip {i}: what moves?"}],
                     "choices": OPTIONS, "reference": "ABCD"[i % 4]})
    return write_chat_jsonl(root / name / "questions.jsonl", rows)


def _llava_benchmark(root: Path, name: str, count: int) -> Path:
    """LLaVA rows: options in the question, the answer in the final gpt turn."""
    rows = []
    for i in range(count):
        clip = write_tiny_mp4(root / name / "clips" / f"{i}.mp4", frames=8, fps=4,
                              size=(32, 32))
        lettered = "\n".join(f"{letter}. {text}"
                              for letter, text in zip("ABCD", OPTIONS, strict=True))
        rows.append({"id": f"{name}-{i}", "video": f"clips/{clip.name}", "conversations": [
            {"from": "human", "value": f"<video>\nWhat moves?\n{lettered}"},
            {"from": "gpt", "value": "ABCD"[(i + 1) % 4]}]})
    path = root / name / "questions.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    root = tmp_path_factory.mktemp("bench")
    model = make_tiny_qwen2_5_vl_dir(root / "tiny-vl", seed=0)
    config = root / "eval.toml"
    config.write_text(f"""
[model]
name_or_path = "{model}"
max_length = 1024

[data]
format = "jsonl"

[eval]
answer_format = "letter"
temperature = 0.0
max_new_tokens = 6
repetition_penalty = 1.2
seed = 1
fps = 2.0
batch_size = 2
results_dir = "{root / 'results'}"

[[eval.datasets]]
name = "robo"
path = "{_benchmark(root, 'robo', 3)}"

[[eval.datasets]]
name = "drive"
path = "{_llava_benchmark(root, 'drive', 3)}"
format = "llava"
answer_format = "reasoning"
max_samples = 2
max_pixels = 3136
""")
    return {"root": root, "config": config, "results": root / "results"}


def _app() -> Any:
    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    return build_app(PluginHost.load())


def _eval(config: Path, *extra: str) -> Any:
    result = CliRunner().invoke(_app(), ["eval", "--config", str(config), *extra])
    assert result.exit_code == 0, result.output
    return result


def _records(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def test_benchmarks_write_results_resume_and_agree_with_the_rewards(
        workspace: dict[str, Path]) -> None:
    from reasonctl.core.types import Sample
    from reasonctl.rewards.choice import ChoiceConfig, choice_judgement

    results = workspace["results"]
    first = _eval(workspace["config"])
    assert "robo: 3 samples, 0 already scored, 3 to generate" in first.output
    for word in ("robo", "drive", "overall", "letter", "reasoning"):
        assert word in first.output
    robo, drive = _records(results / "robo"), _records(results / "drive")
    assert sorted(robo) == ["000000.json", "000001.json", "000002.json"]
    assert len(drive) == 2  # max_samples
    assert robo["000000.json"]["settings"]["fps"] == 2.0
    assert drive["000000.json"]["settings"]["max_pixels"] == 3136
    assert robo["000000.json"]["settings"]["sampling"]["repetition_penalty"] == 1.2
    assert robo["000001.json"]["prompt"].endswith("D. nothing")  # options lettered in
    # LLaVA rows are judged against their final gpt turn
    assert [r["reference"] for r in drive.values()] == ["B", "C"]
    assert drive["000000.json"]["prompt"].endswith("D. nothing")
    # the verdicts are the choice reward's (with require_tag for "reasoning")
    for records, config, meta in ((robo, ChoiceConfig(), {"choices": OPTIONS}),
                                  (drive, ChoiceConfig(require_tag=True), {})):
        for record in records.values():
            sample = Sample([], reference=record["reference"], meta=meta)
            expected = choice_judgement(record["response"], sample, config).score == 1.0
            assert record["correct"] is expected
    with (results / "accuracy.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["dataset"] for r in rows] == ["robo", "drive", "overall"]
    correct = sum(r["correct"] for r in robo.values())
    assert int(rows[0]["correct"]) == correct and int(rows[2]["samples"]) == 5
    summary = json.loads((results / "summary.json").read_text())
    assert summary["overall"]["samples"] == 5
    assert sum(summary["overall"]["reasons"].values()) == 5
    assert summary["benchmarks"][0]["reasons"] == dict(
        Counter(r["reason"] for r in robo.values()).most_common())
    assert all(record["correct"] == (record["reason"] == "correct") for record in robo.values())
    from PIL import Image

    with Image.open(results / "accuracy.png") as chart:
        assert chart.format == "PNG" and chart.size[0] > 300

    # a second run reuses every saved sample and rewrites none
    stamps = {p: p.stat().st_mtime_ns for p in (results / "robo").glob("*.json")}
    again = _eval(workspace["config"])
    assert "robo: 3 samples, 3 already scored, 0 to generate" in again.output
    assert {p: p.stat().st_mtime_ns for p in (results / "robo").glob("*.json")} == stamps

    # a missing and a torn file are generated again, with the same greedy answers
    (results / "robo" / "000001.json").unlink()
    (results / "robo" / "000002.json").write_text('{"index": 2, "respo')
    resumed = _eval(workspace["config"])
    assert "robo: 3 samples, 1 already scored, 2 to generate" in resumed.output
    after = _records(results / "robo")
    assert [r["response"] for r in after.values()] == [r["response"] for r in robo.values()]

    # a record made with other generation settings is not reused
    from reasonctl.evaluation.benchmark import _saved

    settings = after["000000.json"]["settings"]
    assert len(_saved(results / "robo", settings)) == 3
    other = {**settings, "sampling": {**settings["sampling"], "max_new_tokens": 4}}
    assert _saved(results / "robo", other) == {}


def test_benchmark_media_settings_reach_the_samples(workspace: dict[str, Path]) -> None:
    from reasonctl.core.plugins import PluginHost
    from reasonctl.evaluation.benchmark import _samples
    from reasonctl.evaluation.standalone import evaluation_context
    from reasonctl.sdk.api import load_config

    config = load_config(workspace["config"])
    ctx = evaluation_context(config, PluginHost.load().registry)
    robo = _samples(ctx, config.eval.datasets[0], 0, None)
    drive = _samples(ctx, config.eval.datasets[1], 1, None)
    video = robo[0].messages[0].content[0]
    assert (video.type, video.fps, video.max_pixels) == ("video", 2.0, None)
    assert drive[0].messages[0].content[0].max_pixels == 3136 and len(drive) == 2


def test_eval_without_data_or_benchmarks_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["eval", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "eval.datasets" in result.output and "--data" in result.output
    config = tmp_path / "eval.toml"
    config.write_text('[[eval.datasets]]\nname = "x"\npath = "missing.jsonl"\n')
    result = CliRunner().invoke(_app(), ["eval", "--config", str(config)])
    assert result.exit_code == 2
    assert "eval.datasets.0.path: missing.jsonl does not exist" in result.output
