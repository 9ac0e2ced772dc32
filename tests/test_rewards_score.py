"""``reasonctl rewards score`` and ``reasonctl.score``: a config's rewards on saved
completions, offline, exactly as training builds and applies them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import reasonctl

ROWS = [
    {"prompt": "What is 6*7?", "reference": "42",
     "completion": "<think>6 times 7</think><answer>42</answer>"},
    {"prompt": "Which vehicle?", "options": ["a car", "a bus", "a truck"], "reference": "B",
     "completion": "The answer is B. Option C is a truck."},
    {"prompt": "What is 6*7?", "reference": "Six sevens.\n#### 42",
     "completion": "<think>hmm</think><answer>41</answer>"},
    {"prompt": "Which vehicle?", "choices": ["a car", "a bus"], "reference": "A",
     "completion": "(A) or (B)"},
]
CONFIG = """
[[rewards.components]]
name = "math"

[[rewards.components]]
name = "choice"
weight = 2.0

[[rewards.components]]
name = "format"
weight = 0.5
"""


def _write(tmp_path: Path, rows: list[Any]) -> Path:
    path = tmp_path / "completions.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _app() -> Any:
    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    return build_app(PluginHost.load())


def test_cli_prints_means_and_writes_per_row_scores(tmp_path: Path) -> None:
    data = _write(tmp_path, ROWS)
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    out = tmp_path / "scores.jsonl"
    result = CliRunner().invoke(_app(), ["rewards", "score", "--config", str(config),
                                         "--data", str(data), "--output", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("math", "choice", "format", "total"):
        assert name in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # choice compares a non-letter reference as text when the row has no options
    assert [r["scores"]["choice"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert [r["scores"]["format"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert rows[0]["scores"]["math"] == 1.0 and rows[2]["scores"]["math"] == 0.0
    assert rows[1]["total"] == pytest.approx(rows[1]["scores"]["math"] + 2.0)
    assert rows[3]["source"].endswith("completions.jsonl:4")
    assert "0.5000" in result.output  # the choice mean


def test_cli_names_a_bad_row_and_exits_nonzero(tmp_path: Path) -> None:
    data = _write(tmp_path, [ROWS[0], {"prompt": "q", "reference": "1"}])
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(_app(), ["rewards", "score", "--config", str(config),
                                         "--data", str(data)])
    assert result.exit_code == 1
    assert "completions.jsonl:2" in result.output and "'completion'" in result.output


def test_cli_without_rewards_is_a_config_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["rewards", "score", "--data",
                                         str(_write(tmp_path, ROWS))])
    assert result.exit_code == 2
    assert "rewards.components" in result.output


def test_sdk_scores_a_file_or_objects_with_python_rewards(tmp_path: Path) -> None:
    data = _write(tmp_path, ROWS)
    config = {"rewards": {"components": [{"name": "math"}]}}

    def short(completion: str, sample: reasonctl.Sample) -> float:
        return 1.0 if len(completion) < 30 else 0.0

    report = reasonctl.score(config, data, rewards=[short])
    assert isinstance(report, reasonctl.ScoreReport)
    assert report.scores.components["short"] == [0.0, 0.0, 0.0, 1.0]
    assert report.means()["short"] == pytest.approx(0.25)
    assert report.metrics["reward/math/coverage"] == 1.0

    samples = [reasonctl.Sample([], reference="1/2"), reasonctl.Sample([], reference="3")]
    direct = reasonctl.score(config, completions=[r"\boxed{0.5}", "<answer>4</answer>"],
                             samples=samples, overrides=["rewards.on_error='zero'"])
    assert direct.scores.components["math"] == [1.0, 0.0]
    with pytest.raises(ValueError, match="either data"):
        reasonctl.score(config)


def test_cli_explains_what_each_reward_read_and_counts_rows_per_reason(tmp_path: Path) -> None:
    rows = [*ROWS,
            {"prompt": "What is 6*7?", "reference": "42", "completion": r"\boxed{41} \boxed{42}"},
            {"prompt": "What is 6*7?", "reference": "42", "completion": "so 42 it is"}]
    data = _write(tmp_path, rows)
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    out = tmp_path / "scores.jsonl"
    result = CliRunner().invoke(_app(), ["rewards", "score", "--config", str(config),
                                         "--data", str(data), "--output", str(out),
                                         "--explain"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    math = [row["explanations"]["math"] for row in written]
    assert math[0] == {"extracted": "42", "reason": "correct"}
    assert math[2] == {"extracted": "41", "reason": "wrong"}
    assert math[4] == {"extracted": "41 | 42", "reason": "several_answers"}
    assert math[5] == {"extracted": None, "reason": "no_answer"}
    choice = [row["explanations"]["choice"] for row in written]
    assert choice[1] == {"extracted": "B", "reason": "correct"}
    assert choice[3] == {"extracted": "A or B", "reason": "hedge"}
    assert {row["explanations"]["format"]["reason"] for row in written} == {
        "well_formed", "malformed"}
    assert "rows per reason" in result.output
    for reason in ("several_answers", "no_answer", "hedge", "well_formed"):
        assert reason in result.output
    # the explained scores are the scores
    plain = reasonctl.score(reasonctl.load_config(config), data)
    assert [row["scores"] for row in written] == [r["scores"] for r in plain.rows()]
    assert plain.reason_counts() == {}
    counts = reasonctl.score(reasonctl.load_config(config), data, explain=True).reason_counts()
    assert counts["math"] == {"correct": 2, "no_answer": 2, "several_answers": 1, "wrong": 1}


def test_reward_set_explains_rewards_that_cannot_and_failures() -> None:
    from reasonctl.core.reward_set import RewardSet, RewardTerm

    def flaky(completions: list[str], samples: list[Any]) -> list[float | None]:
        if any("boom" in c for c in completions):
            raise ValueError("boom")
        return [None if c == "skip" else 1.0 for c in completions]

    rewards = RewardSet([RewardTerm("flaky", flaky)], on_error="zero")
    samples = [reasonctl.Sample([]) for _ in range(3)]
    scores = rewards.score(["ok", "skip", "boom"], samples, explain=True)
    assert scores.components["flaky"] == [1.0, None, 0.0]
    assert [e.reason for e in scores.explanations["flaky"]] == [
        "scored", "not_applicable", "error"]
    assert rewards.score(["ok"], samples[:1]).explanations == {}


AGREE_ROWS = [  # completion, reference, human label, class
    ("<answer>42</answer>", "42", 1, "tagged"),
    (r"\boxed{42}", "42", 1, "boxed"),
    (r"\boxed{41}", "42", 0, "boxed"),
    (r"\boxed{41} \boxed{42}", "42", 0, "boxing-every-candidate"),
    ("I tried 40, 41 and then 42", "42", 0, "last-number"),
    ("So she has 42 apples in total.", "42", 1, "last-number"),  # a human would accept it
    ("The answer is 42.", "42", 1, "statement"),
]


def test_rewards_agree_reports_agreement_per_class_with_a_confusion_table(
        tmp_path: Path) -> None:
    data = _write(tmp_path, [{"prompt": "q", "reference": ref, "completion": text}
                             for text, ref, _, _ in AGREE_ROWS])
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"label": label, "class": group}) + "\n"
                              for _, _, label, group in AGREE_ROWS))
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    out = tmp_path / "agreement.json"
    result = CliRunner().invoke(_app(), [
        "rewards", "agree", "--config", str(config), "--data", str(data), "--labels",
        str(labels), "--reward", "math", "--output", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    (math,) = report["rewards"]
    assert math["reward"] == "math" and math["rows"] == 7 and math["agree"] == 6
    assert math["confusion"] == {"1": {"1": 3, "0": 1, "none": 0},
                                 "0": {"1": 0, "0": 3, "none": 0}}
    assert math["by_class"]["last-number"] == {"agree": 1, "rows": 2, "agreement": 0.5}
    assert math["by_class"]["boxing-every-candidate"]["agreement"] == 1.0
    (miss,) = math["disagreements"]
    assert (miss["row"], miss["label"], miss["score"], miss["reason"]) == (6, 1, 0.0,
                                                                           "no_answer")
    # kappa: observed 6/7 against chance (4/7 * 3/7 + 3/7 * 4/7)
    chance = 2 * (4 / 7) * (3 / 7)
    assert math["kappa"] == pytest.approx((6 / 7 - chance) / (1 - chance))
    assert "agreement 6/7" in result.output and "last-number" in result.output

    # the same with plain labels checks every reward of the config
    labels.write_text("".join(f"{label}\n" for _, _, label, _ in AGREE_ROWS))
    every = CliRunner().invoke(_app(), [
        "rewards", "agree", "--config", str(config), "--data", str(data), "--labels",
        str(labels), "--output", str(out)])
    assert every.exit_code == 0, every.output
    assert [r["reward"] for r in json.loads(out.read_text())["rewards"]] == [
        "math", "choice", "format"]


@pytest.mark.parametrize(("labels", "message"), [
    ("1\n0\n", "2 labels for 7 completions"),
    ("1\n" * 6 + "yes\n", "labels.jsonl:7: not JSON"),
    ("1\n" * 6 + "2\n", "labels.jsonl:7: a label is 1, 0, true or false (got 2)"),
    ('{"lable": 1}\n', "labels.jsonl:1: a label object has 'label'"),
])
def test_rewards_agree_names_bad_labels(tmp_path: Path, labels: str, message: str) -> None:
    data = _write(tmp_path, [{"prompt": "q", "reference": ref, "completion": text}
                             for text, ref, _, _ in AGREE_ROWS])
    path = tmp_path / "labels.jsonl"
    path.write_text(labels)
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(_app(), ["rewards", "agree", "--config", str(config),
                                         "--data", str(data), "--labels", str(path)],
                                env={"COLUMNS": "300"})
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_rewards_agree_with_an_unknown_reward_is_a_usage_error(tmp_path: Path) -> None:
    data = _write(tmp_path, [{"prompt": "q", "reference": "1", "completion": "1"}])
    labels = tmp_path / "labels.jsonl"
    labels.write_text("1\n")
    config = tmp_path / "rewards.toml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(_app(), ["rewards", "agree", "--config", str(config),
                                         "--data", str(data), "--labels", str(labels),
                                         "--reward", "maths"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert "did you mean 'math'" in result.output
