"""The model rewards in the trainer's process: ``reward_model`` (a tiny sequence-classification
model built from its config) scores like unbatched forward passes, ``judge`` (a tiny judge
trained for a few seconds, :mod:`tests.judge_support`) reads verdicts, counts the replies it
cannot read, and judges in the background while the caller goes on."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import reasonctl
from reasonctl.core.errors import ConfigError
from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.core.types import Sample
from reasonctl.rewards.judge import JudgeConfig, JudgeReward, read_reply
from reasonctl.rewards.reward_model import RewardModelConfig, RewardModelReward
from tests.judge_support import (
    JUDGE_OPTIONS,
    SCORES,
    question,
    tiny_reward_model_dir,
    trained_judge_dir,
)


@pytest.fixture(scope="session")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained_judge_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_reward_model_dir(tmp_path_factory)


# --- reward_model ----------------------------------------------------------------------------


def test_reward_model_scores_each_input_as_an_unbatched_forward_pass(
        reward_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = RewardModelReward(RewardModelConfig(model=str(reward_model_dir), device="cpu",
                                                 batch_size=3))
    assert isinstance(reward, reasonctl.SubmitsAsync)
    assert isinstance(reward, reasonctl.ExplainsScores)
    texts = ["4", "The answer is 4.", "a much longer completion that needs padding " * 3,
             "5", "x" * 40]
    samples = [question(), question("What is 3+1?"), question(), question(), question()]
    scores = reward(texts, samples)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    expected = []
    for text, sample in zip(texts, samples, strict=True):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.messages[0].text},
             {"role": "assistant", "content": text}], tokenize=False)
        ids = tokenizer(chat, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(float(model(input_ids=ids).logits[0, 0]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 6) for s in scores}) == len(scores)  # the input matters

    sigmoid = RewardModelReward(RewardModelConfig(model=str(reward_model_dir), device="cpu",
                                                  normalize="sigmoid"))
    assert sigmoid(texts[:2], samples[:2]) == pytest.approx(
        [float(torch.sigmoid(torch.tensor(v))) for v in expected[:2]], abs=1e-6)
    templated = RewardModelReward(RewardModelConfig(
        model=str(reward_model_dir), device="cpu", max_length=30,
        template="Q: {prompt} Ref: {reference} A: {completion}"))
    explained = templated.explain(["4", "y" * 40], samples[:2])
    assert explained[0].reason == "scored" and explained[0].score is not None
    assert (explained[1].score, explained[1].reason) == (None, "too_long")
    with pytest.raises(ConfigError, match="label must be below that"):
        RewardModelReward(RewardModelConfig(model=str(reward_model_dir), device="cpu",
                                            label=1))


# --- judge -------------------------------------------------------------------------------------


def test_the_trained_judge_reads_verdicts_and_counts_what_it_cannot_read(
        judge_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    registry = reasonctl.plugin_host().registry
    config = reasonctl.load_config(values={"rewards": {"components": [
        {"name": "judge", "model": str(judge_dir), **JUDGE_OPTIONS}]}})
    rewards = RewardSet.from_config(config, registry)
    judge = rewards.terms[0].reward
    completions = list(SCORES)
    samples = [question()] * len(completions)
    with caplog.at_level(logging.WARNING, logger="reasonctl.rewards.judge"):
        scores = rewards.score(completions, samples, explain=True)
    assert scores.components["judge"] == list(SCORES.values())
    assert [(e.extracted, e.reason) for e in scores.explanations["judge"]] == [
        ("correct", "judged"), ("correct", "judged"), ("correct", "judged"),
        ("incorrect", "judged"), ("incorrect", "judged"), ("I do not know.", "unparseable")]
    assert scores.metrics["reward/judge/coverage"] == pytest.approx(5 / 6)
    assert "1 of 6 replies could not be read" in caplog.text
    # asynchronous path, as in training: counted by reason
    assert judge(completions, samples) == list(SCORES.values())
    assert judge.reasons == {"judged": 5, "unparseable": 1}
    # a rubric with {reference} does not judge samples without one
    (missing,) = judge.explain(["4"], [question(reference=None)])
    assert (missing.score, missing.reason) == (None, "no_reference")
    short = JudgeReward(JudgeConfig(model=str(judge_dir), **{**JUDGE_OPTIONS,
                                                            "max_prompt_tokens": 10}))
    assert short.explain(["4"], [question()])[0].reason == "too_long"


def test_the_judge_scores_in_the_background_while_the_caller_goes_on(judge_dir: Path) -> None:
    judge = JudgeReward(JudgeConfig(model=str(judge_dir), **JUDGE_OPTIONS))
    release = threading.Event()
    generating = threading.Event()
    real_generate = judge.engine.generate

    def held_generate(prompts: Any, params: Any) -> Any:  # the real engine, started late
        generating.set()
        assert release.wait(30)
        return real_generate(prompts, params)

    judge.engine.generate = held_generate  # type: ignore[method-assign]
    events: list[str] = []

    def local(completions: list[str], samples: list[Sample]) -> list[float]:
        events.append("local reward")
        return [0.5] * len(completions)

    rewards = RewardSet([RewardTerm("judge", judge), RewardTerm("local", local)])
    pending = rewards.submit(["4", "5"], [question(), question()])
    assert generating.wait(30)  # judging has started and is held ...
    events.append("log-prob passes")  # ... while the caller computes, e.g., log-probs
    release.set()
    scores = rewards.collect(pending)
    assert events == ["local reward", "log-prob passes"]
    assert scores.components == {"judge": [1.0, 0.0], "local": [0.5, 0.5]}
    assert scores.totals == [1.5, 0.5]


@pytest.mark.parametrize(("reply", "options", "expected"), [
    ("Looks right.\nVerdict: correct", {}, (1.0, "correct", "judged")),
    ("Verdict: incorrect", {}, (0.0, "incorrect", "judged")),
    ("**Verdict:** **Incorrect**.", {}, (0.0, "incorrect", "judged")),
    ("verdict: CORRECT", {}, (1.0, "correct", "judged")),
    ("Verdict: correct ... on reflection, Verdict: incorrect", {}, (0.0, "incorrect", "judged")),
    ("Verdict: \"correct\"", {}, (1.0, "correct", "judged")),
    ("Verdict: correctly done", {}, (None, "Verdict: correctly done", "unparseable")),
    ("Verdict: maybe", {}, (None, "Verdict: maybe", "unparseable")),
    ("The answer is correct", {}, (None, "The answer is correct", "unparseable")),
    ("", {}, (None, "", "unparseable")),
    ("Grade: A", {"marker": "Grade:", "verdicts": {"A": 1.0, "B": 0.5, "C": 0.0}},
     (1.0, "A", "judged")),
    ("blah\nPASS", {"marker": "", "verdicts": {"pass": 1.0, "fail": 0.0}},
     (1.0, "pass", "judged")),
    ("Score: 7", {"parse": "score"}, (pytest.approx(6 / 9), "7", "judged")),
    ("Score: 10/10", {"parse": "score"}, (1.0, "10", "judged")),
    ("score: **1**", {"parse": "score"}, (0.0, "1", "judged")),
    ("Score: 11", {"parse": "score"}, (None, "11", "out_of_range")),
    ("Score: high", {"parse": "score"}, (None, "Score: high", "unparseable")),
    ("Rating: 3", {"parse": "score", "marker": "Rating:", "score_range": (0, 4)},
     (0.75, "3", "judged")),
])
def test_judge_replies_are_read_at_the_last_marker(reply: str, options: dict[str, Any],
                                                  expected: tuple[Any, ...]) -> None:
    explanation = read_reply(reply, JudgeConfig(model="m", **options))
    assert (explanation.score, explanation.extracted, explanation.reason) == expected


def test_judge_options_are_checked_with_their_path(tmp_path: Path) -> None:
    def problems(**options: Any) -> str:
        with pytest.raises(ConfigError) as info:
            reasonctl.load_config(values={"rewards": {"components": [
                {"name": "judge", "model": "m", **options}]}})
        return "\n".join(info.value.problems)

    assert "rewards.components.0.template" in problems(template="Grade {answer}")
    assert "{answer} is not a placeholder" in problems(template="Grade {answer}")
    assert "must contain {completion}" in problems(template="Grade {prompt}")
    assert "not both" in problems(template="{completion}", template_file="r.txt")
    assert "cannot read" in problems(template_file=str(tmp_path / "missing.txt"))
    assert "lowest score must be below" in problems(parse="score", score_range=[5, 1])
    assert "different non-empty words" in problems(verdicts={"Yes": 1, "yes": 0})
    assert "rewards.components.0.tempreature: unknown key" in problems(tempreature=0.5)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Grade {completion} against {reference}. Verdict:")
    config = reasonctl.load_config(values={"rewards": {"components": [
        {"name": "judge", "model": "m", "template_file": str(rubric)}]}})
    assert config.rewards.components[0].name == "judge"
    with pytest.raises(ValidationError, match="template"):
        RewardModelConfig(model="m", template="{prompt}")


def test_a_judge_whose_tokenizer_has_no_chat_template_says_to_set_chat_false(
        judge_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    options = {**JUDGE_OPTIONS, "chat": True, "tokenizer": str(tmp_path / "plain")}
    with pytest.raises(ConfigError, match="set chat = false"):
        JudgeReward(JudgeConfig(model=str(judge_dir), **options))


def test_rewards_agree_checks_a_judge_against_human_labels(judge_dir: Path,
                                                          tmp_path: Path) -> None:
    import json

    import tomli_w
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    rows = [("4", 1), ("The answer is 4.", 1), ("x = 4", 0), ("5", 0), ("4 or 5", 0),
            ("banana", 0)]  # a person marks "x = 4" wrong: the judge disagrees there
    data = tmp_path / "completions.jsonl"
    data.write_text("".join(json.dumps({"prompt": "What is 2+2?", "reference": "4",
                                        "completion": text}) + "\n" for text, _ in rows))
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"label": label, "class": "judged"}) + "\n"
                              for _, label in rows))
    config = tmp_path / "judge.toml"
    config.write_text(tomli_w.dumps({"rewards": {"components": [
        {"name": "judge", "model": str(judge_dir), **JUDGE_OPTIONS}]}}))
    out = tmp_path / "agreement.json"
    result = CliRunner().invoke(build_app(PluginHost.load()), [
        "rewards", "agree", "--config", str(config), "--data", str(data), "--labels",
        str(labels), "--output", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    (judge,) = json.loads(out.read_text())["rewards"]
    assert judge["confusion"] == {"1": {"1": 2, "0": 0, "none": 0},
                                  "0": {"1": 1, "0": 2, "none": 1}}
    assert judge["agree"] == 4 and judge["by_class"]["judged"]["rows"] == 6
    assert [(d["row"], d["reason"]) for d in judge["disagreements"]] == [
        (3, "judged"), (6, "unparseable")]
