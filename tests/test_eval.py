"""``reasonctl eval`` / ``infer``: answer parsing, predictions, accuracy table, streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.evaluation.scoring import parse_and_score


def _sample(reference: Any = None, **meta: Any) -> Sample:
    return Sample([Message("user", [ContentPart("text", text="q")])], reference=reference,
                  meta=meta)


@pytest.mark.parametrize(
    ("response", "fmt", "extracted", "correct"),
    [
        ("B", "letter", "B", True),
        ("The answer is (C).", "letter", "C", False),
        ("<think>hmm</think><answer>B</answer>", "letter", "B", True),
        ("<think>it is B</think><answer>B</answer>", "reasoning", "B", True),
        ("<think>it is B</think> B", "reasoning", None, False),  # no answer block
        ("dog", "letter", "B", True),  # the option text names the letter
        ("", "free", None, False),
    ],
)
def test_multiple_choice_parsing(response: str, fmt: str, extracted: str | None,
                                 correct: bool) -> None:
    sample = _sample("B", choices=["cat", "dog", "cow"])
    assert parse_and_score(response, sample, fmt) == (extracted, correct)


def test_qa_pairs_layout_and_free_answers() -> None:
    qa = _sample(None, qa_pairs=[{"question": "Which?", "index2ans": {"A": "x", "B": "y"},
                                  "answer": "A"}])
    assert parse_and_score("<answer>A</answer>", qa, "reasoning") == ("A", True)
    number = _sample("42")
    assert parse_and_score("so the answer is 42 apples", number, "math") == ("42 apples", True)
    assert parse_and_score("so the total is 42 apples", number, "math") == (None, False)
    assert parse_and_score("so the total is 42 apples", number, "free")[1] is False  # exact
    assert parse_and_score("<answer>41</answer>", number, "reasoning") == ("41", False)
    text = _sample("Paris")
    assert parse_and_score("<answer> paris </answer>", text, "reasoning") == ("paris", True)
    assert parse_and_score("anything", _sample(None), "free") == ("anything", False)
    assert parse_and_score("<answer>42</answer>", _sample("#### 42"), "free")[1] is False


def test_unknown_answer_format_is_a_config_error() -> None:
    from reasonctl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="not one of letter, reasoning, free, math"):
        parse_and_score("B", _sample("B"), "letters")


@pytest.fixture(scope="module")
def lively_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with large random weights, so greedy answers are not just whitespace."""
    from reasonctl.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("eval-model"), seed=3,
                               initializer_range=0.3)


def _app() -> Any:
    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    return build_app(PluginHost.load())


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_writes_predictions_and_scores_them(lively_model_dir: Path, tmp_path: Path) -> None:
    from reasonctl.core.plugins import PluginHost
    from reasonctl.evaluation.scoring import write_report
    from reasonctl.evaluation.standalone import evaluate
    from reasonctl.sdk.api import load_config

    registry = PluginHost.load().registry
    config = load_config(overrides=["rollout.max_new_tokens=6"])
    probe = _write(tmp_path / "probe.jsonl", [
        {"prompt": "Say hi", "reference": "x", "meta": {"source": "greet"}},
        {"prompt": "Pick one", "reference": "A", "choices": ["yes", "no"]},
    ])
    first = evaluate(config, registry, model=str(lively_model_dir), data=str(probe),
                     answer_format="free")
    assert first.predictions[0].response.strip()
    # the greedy answers become the references of a second file: all of them are correct
    echo = _write(tmp_path / "echo.jsonl", [
        {"prompt": "Say hi", "reference": first.predictions[0].response,
         "meta": {"source": "greet"}},
        {"prompt": "Say hi", "reference": first.predictions[0].response + "!",
         "meta": {"source": "greet"}},
        {"prompt": "Pick one", "reference": "A", "choices": ["yes", "no"]},
    ])
    report = evaluate(config, registry, model=str(lively_model_dir), data=str(echo),
                      answer_format="free")
    assert [p.correct for p in report.predictions[:2]] == [True, False]
    assert report.predictions[2].prompt == "Pick one\nA. yes\nB. no"
    assert report.by_source()["greet"] == (1, 2)
    assert "echo" in report.by_source()  # rows without meta source use the file name
    directory = write_report(report, tmp_path / "out")
    rows = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
    assert set(rows[0]) >= {"prompt", "response", "extracted", "reason", "reference",
                            "correct", "source"}
    assert [row["reason"] for row in rows[:2]] == ["correct", "wrong"]
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(report.accuracy)
    assert sum(summary["reasons"].values()) == len(rows)
    assert summary["reasons"]["correct"] == sum(row["correct"] for row in rows)
    assert summary["by_source"]["greet"]["accuracy"] == pytest.approx(0.5)


def test_eval_cli_is_repeatable_with_a_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "bench.jsonl", [
        {"prompt": f"Question {i}?", "reference": "A", "choices": ["p", "q"],
         "meta": {"source": "odd" if i % 2 else "even"}} for i in range(4)
    ])
    runner = CliRunner()
    outputs = []
    for name in ("a", "b"):
        result = runner.invoke(_app(), [
            "eval", "--model", str(tiny_model_dir), "--data", str(data), "--answer-format",
            "letter", "--output", str(tmp_path / name), "--max-samples", "3", "--seed", "5",
            "--set", "eval.temperature=1.0", "--set", "eval.max_new_tokens=5",
        ])
        assert result.exit_code == 0, result.output
        assert "overall" in result.output and "odd" in result.output
        outputs.append((tmp_path / name / "predictions.jsonl").read_text())
    assert outputs[0] == outputs[1]
    assert len(outputs[0].splitlines()) == 3


def test_eval_cli_reports_missing_data_as_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), [
        "eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "none.jsonl"),
    ])
    assert result.exit_code != 0
    assert "none.jsonl" in result.output


def test_infer_streams_the_greedy_completion(tiny_model_dir: Path) -> None:
    from reasonctl.core.plugins import PluginHost
    from reasonctl.core.types import SamplingParams
    from reasonctl.evaluation.standalone import load_engine
    from reasonctl.sdk.api import load_config

    result = CliRunner().invoke(_app(), [
        "infer", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens", "5",
    ])
    assert result.exit_code == 0, result.output
    engine, processor = load_engine(str(tiny_model_dir), load_config(),
                                     PluginHost.load().registry)
    encoded = processor.encode_prompt(_sample_with("hello"))
    expected = engine.generate([{"input_ids": encoded.input_ids}],
                               SamplingParams(temperature=0.0, max_new_tokens=5))[0][0].text
    assert result.stdout == expected + "\n"


def _sample_with(text: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=text)])])
