"""Agreement of the ``math`` and ``choice`` rewards with hand labels, and one scorer for
training and evaluation: ``eval/accuracy`` equals ``reward/<name>/mean`` on the same
completions.

The corpora are hand-labelled: ``tests/data/math_pairs.jsonl`` (completion, reference,
label, case) covers symbolic equivalence, sets and intervals, exact integers, decimal
tolerance, money, units and ``\\text{}``, statements, ``<answer>`` tags, GSM8K ``####``
references, ``\\fbox``, thousands separators, empty boxes, hedges and pathological
expressions; ``tests/data/choice_answers.jsonl`` holds adversarial multiple-choice answers
(mentions after the answer, boxes, bold, option texts, hedges, negations, tags).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.core.types import Completion, ContentPart, Message, Sample
from reasonctl.evaluation.answers import AnswerScorer
from reasonctl.rewards.choice import ChoiceConfig, ChoiceReward
from reasonctl.rewards.math import MathConfig, MathReward

DATA = Path(__file__).parent / "data"
REQUIRED_AGREEMENT = 0.95
TIMEOUT_S = 6.0
"""Per symbolic comparison: above the 3 s default, so a busy test machine does not turn a
slow but finite comparison into a wrong verdict (the pathological rows time out anyway)."""


def _rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]


def _sample(row: dict[str, Any], index: int) -> Sample:
    meta = {"choices": row["options"]} if "options" in row else {}
    return Sample([Message("user", [ContentPart("text", text=f"Question {index}?")])],
                  reference=row["reference"], meta=meta, source=f"corpus:{index}")


def _agreement(name: str, scores: list[float | None], rows: list[dict[str, Any]],
               capsys: pytest.CaptureFixture[str]) -> None:
    wrong = [f"{row['case']}: {row['completion']!r} vs {row['reference']!r} scored {score}"
             for row, score in zip(rows, scores, strict=True) if score != row["label"]]
    agreement = 1 - len(wrong) / len(rows)
    with capsys.disabled():
        print(f"\n{name}: agreement with hand labels {agreement:.1%} "
              f"({len(rows) - len(wrong)}/{len(rows)})")
    assert agreement >= REQUIRED_AGREEMENT, "\n".join(wrong)
    assert not wrong, "disagreements:\n" + "\n".join(wrong)


@pytest.fixture(scope="module")
def math_rows() -> list[dict[str, Any]]:
    rows = _rows("math_pairs.jsonl")
    assert len(rows) >= 190
    return rows


@pytest.fixture(scope="module")
def choice_rows() -> list[dict[str, Any]]:
    rows = _rows("choice_answers.jsonl")
    assert len(rows) >= 80
    return rows


def test_math_reward_agrees_with_hand_labels(math_rows: list[dict[str, Any]],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    reward = MathReward(MathConfig(timeout_s=TIMEOUT_S))
    samples = [_sample(row, i) for i, row in enumerate(math_rows)]
    scores = reward([row["completion"] for row in math_rows], samples)
    _agreement("math", scores, math_rows, capsys)


def test_math_reward_with_the_last_number_fallback_agrees_with_its_labels(
        math_rows: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    """Rows without an answer tag, box or statement score 0 by default; with
    ``last_number_fallback`` their last number (or formula) is read, as labelled in
    ``label_with_fallback``; every other row scores the same either way."""
    rows = [row for row in math_rows if not row["case"].startswith("pathological")]
    fallback_rows = [row for row in rows if "label_with_fallback" in row]
    assert len(fallback_rows) >= 8 and all(row["label"] == 0 for row in fallback_rows)
    reward = MathReward(MathConfig(timeout_s=TIMEOUT_S, last_number_fallback=True))
    scores = reward([row["completion"] for row in rows],
                    [_sample(row, i) for i, row in enumerate(rows)])
    relabelled = [{**row, "label": row.get("label_with_fallback", row["label"])}
                  for row in rows]
    _agreement("math with last_number_fallback", scores, relabelled, capsys)


def test_choice_reward_agrees_with_hand_labels(choice_rows: list[dict[str, Any]],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    reward = ChoiceReward(ChoiceConfig())
    samples = [_sample(row, i) for i, row in enumerate(choice_rows)]
    scores = reward([row["completion"] for row in choice_rows], samples)
    _agreement("choice", scores, choice_rows, capsys)


@pytest.mark.parametrize(
    ("corpus", "answer_format", "reward", "options"),
    [
        ("math_pairs.jsonl", "math", "math", {"timeout_s": TIMEOUT_S}),
        ("choice_answers.jsonl", "letter", "choice", {}),
        ("math_pairs.jsonl", "free", "exact_match", {}),
        ("choice_answers.jsonl", "reasoning", "choice", {"require_tag": True}),
        ("math_pairs.jsonl", "reasoning", "math", {"require_tag": True,
                                                    "timeout_s": TIMEOUT_S}),
    ],
)
def test_evaluation_scores_like_the_reward(corpus: str, answer_format: str, reward: str,
                                           options: dict[str, Any], tiny_model_dir: Path
                                           ) -> None:
    """The evaluation path (engine -> score_samples) and the reward set give the same
    verdict on every completion, and ``eval`` accuracy equals ``reward/<name>/mean``."""
    from reasonctl.core.plugins import PluginHost
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.evaluation.scoring import score_samples
    from reasonctl.sdk.api import load_config

    pairs = [(row, _sample(row, i)) for i, row in enumerate(_rows(corpus))
             if not row["case"].startswith("pathological")]  # timed out in the test above
    pairs = [(row, s) for row, s in pairs if AnswerScorer(answer_format).reward_name(s) == reward]
    samples = [s for _, s in pairs]
    texts = [row["completion"] for row, _ in pairs]
    registry = PluginHost.load().registry
    config = load_config(values={"rewards": {"components": [{"name": reward, **options}]}})
    reward_set = RewardSet.from_config(config, registry)
    scores = reward_set.score(texts, samples)

    class ReplayEngine:  # answers each prompt with the corpus completion, in order
        def generate(self, prompts: list[dict[str, Any]], params: Any) -> list[list[Completion]]:
            assert len(prompts) == len(texts)
            return [[Completion(text, [], [], "stop")] for text in texts]

    processor = ChatProcessor.from_pretrained(tiny_model_dir, max_length=256)
    report = score_samples(ReplayEngine(), processor, samples, answer_format=answer_format,
                           params=None, scorer=AnswerScorer.from_config(answer_format, config,
                                                                        registry))
    verdicts = [p.correct for p in report.predictions]
    assert verdicts == [value == 1.0 for value in scores.components[reward]]
    assert {p.reward for p in report.predictions} == {reward}
    assert report.accuracy == pytest.approx(scores.metrics[f"reward/{reward}/mean"])


def test_reasoning_picks_the_reward_that_fits_the_sample() -> None:
    scorer = AnswerScorer("reasoning")
    mcq = Sample([], reference="B", meta={"choices": ["x", "y", "z"]})
    number = Sample([], reference="Natalia sold 72 clips.\n#### 72")
    text = Sample([], reference="Paris")
    assert scorer.reward_name(mcq) == "choice"
    assert scorer.reward_name(number) == "math"
    assert scorer.reward_name(text) == "exact_match"
    assert scorer.score("<think>y</think><answer>B</answer>", mcq) == ("B", True)
    assert scorer.score("The answer is B", mcq) == (None, False)  # no answer block
    assert scorer.score("<answer>72</answer>", number) == ("72", True)
    assert scorer.score("<answer> paris </answer>", text) == ("paris", True)


def test_evaluation_uses_the_run_reward_options() -> None:
    from reasonctl.core.plugins import PluginHost
    from reasonctl.sdk.api import load_config

    config = load_config(values={"rewards": {"components": [
        {"name": "math", "rel_tol": 1e-3}, {"name": "choice", "letters": "WXYZ"}]}})
    registry = PluginHost.load().registry
    math_scorer = AnswerScorer.from_config("math", config, registry)
    assert math_scorer.score(r"\boxed{3.1416}", Sample([], reference=r"\pi"))[1] is True
    assert AnswerScorer("math").score(r"\boxed{3.1416}", Sample([], reference=r"\pi"))[1] is False
    letters = AnswerScorer.from_config("letter", config, registry)
    assert letters.score("Answer: X", Sample([], reference="X"))[1] is True


def test_reward_terms_and_evaluation_share_one_judge_on_gsm8k_references() -> None:
    """The case from the field: a GSM8K gold with an <answer> tag was reward 1, eval 0."""
    sample = Sample([], reference="Natalia sold 48/2 = 24 clips in May.\n#### 72")
    reward = RewardSet([RewardTerm("math", MathReward(MathConfig()))])
    assert reward.score(["<answer>72</answer>"], [sample]).totals == [1.0]
    for answer_format in ("math", "reasoning"):
        assert AnswerScorer(answer_format).score("<answer>72</answer>", sample) == ("72", True)
