"""Reward plumbing: adapting callables, loading them by path, weighted scoring, errors."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest

from reasonctl.core.callables import (
    CallableLoadError,
    as_reward,
    batched,
    is_batched,
    load_callable,
)
from reasonctl.core.config import RunConfig, component_name_problems
from reasonctl.core.errors import ConfigError, ReasonctlError, RewardError, RewardLengthError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.core.types import ContentPart, Message, Sample


def sample(reference: object = None, source: str = "", **meta: object) -> Sample:
    prompt = Message("user", [ContentPart("text", text="question?")])
    return Sample(messages=[prompt], reference=reference, meta=dict(meta), source=source)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """Write a module of reward functions on sys.path and return its (unique) name."""
    name = f"user_rewards_{request.node.name.replace('[', '_').replace(']', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            LIMIT = 3

            def contains_reference(completion, reference):
                if reference is None:
                    return None
                return float(str(reference) in completion)

            class Scorers:
                @staticmethod
                def short(completion):
                    return 1.0 if len(completion) < 10 else 0.0
            """
        )
    )
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('bad import-time code')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in (name, f"{name}_broken"):
        sys.modules.pop(module, None)


# --- as_reward -------------------------------------------------------------------------------


def test_per_sample_callable_gets_arguments_by_name() -> None:
    def score(response: str, reference: str | None) -> float | None:
        return None if reference is None else float(response == reference)

    reward = as_reward(score)
    samples = [sample("4"), sample("4"), sample(None)]
    assert reward(["4", "5", "4"], samples) == [1.0, 0.0, None]
    assert not is_batched(score)


def test_per_sample_callable_with_unnamed_parameters_gets_text_then_sample() -> None:
    seen = []

    def score(text: str, item: Sample) -> float:
        seen.append((text, item.source))
        return float(len(text))

    reward = as_reward(score)
    assert reward(["ab", "abc"], [sample(source="f:1"), sample(source="f:2")]) == [2.0, 3.0]
    assert seen == [("ab", "f:1"), ("abc", "f:2")]


def test_unnamed_parameter_takes_what_named_ones_leave() -> None:
    def score(completion: str, item: Sample, *, scale: float = 2.0) -> float:
        return scale * len(item.meta["tags"]) + len(completion)

    assert as_reward(score)(["x"], [sample(tags=[1, 2])]) == [5.0]


def test_kwargs_receive_completion_reference_and_sample() -> None:
    def score(**kwargs: object) -> float:
        assert set(kwargs) == {"completion", "reference", "sample"}
        return 1.0 if kwargs["completion"] == kwargs["reference"] else 0.0

    assert as_reward(score)(["a", "b"], [sample("a"), sample("a")]) == [1.0, 0.0]


def test_callable_object_is_adapted() -> None:
    class Contains:
        def __call__(self, completion: str, sample: Sample) -> float:
            return float(str(sample.reference) in completion)

    reward = as_reward(Contains())
    assert reward(["it is 7", "it is 8"], [sample(7), sample(7)]) == [1.0, 0.0]


def test_batched_by_parameter_name_is_called_once() -> None:
    calls = []

    def lengths(completions: list[str], samples: list[Sample]) -> list[float]:
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    assert is_batched(lengths)
    assert as_reward(lengths)(["a", "bb", "ccc"], [sample()] * 3) == [1.0, 2.0, 3.0]
    assert calls == [3]


def test_batched_by_decorator() -> None:
    @batched
    def rank(texts: list[str], items: list[Sample]) -> list[float]:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        return [float(order.index(i)) for i in range(len(texts))]

    assert as_reward(rank)(["ccc", "a", "bb"], [sample()] * 3) == [2.0, 0.0, 1.0]


def test_signature_that_cannot_be_filled_is_rejected_up_front() -> None:
    def needs_three(completion: str, sample: Sample, threshold: float) -> float:
        return 0.0

    with pytest.raises(RewardError, match="cannot fill parameter 'threshold'"):
        as_reward(needs_three)


# --- load_callable ----------------------------------------------------------------------------


def test_load_callable_resolves_functions_and_dotted_attributes(user_module: str) -> None:
    fn = load_callable(f"{user_module}:contains_reference")
    assert fn("x = 42", 42) == 1.0
    assert load_callable(f"{user_module}:Scorers.short")("tiny") == 1.0


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon_here", "expected 'package.module:function'"),
        ("mod:", "expected 'package.module:function'"),
        ("missing_module_xyz:fn", "module 'missing_module_xyz' was not found"),
    ],
)
def test_load_callable_bad_paths(path: str, message: str) -> None:
    with pytest.raises(CallableLoadError, match=message):
        load_callable(path)


def test_load_callable_missing_attribute_suggests_a_name(user_module: str) -> None:
    with pytest.raises(CallableLoadError) as info:
        load_callable(f"{user_module}:contains_referense")
    assert "has no attribute 'contains_referense'" in str(info.value)
    assert "Did you mean 'contains_reference'?" in str(info.value)
    assert isinstance(info.value, ReasonctlError)


def test_load_callable_not_callable_and_broken_module(user_module: str) -> None:
    with pytest.raises(CallableLoadError, match="'LIMIT' is a int, not a callable"):
        load_callable(f"{user_module}:LIMIT")
    with pytest.raises(CallableLoadError, match="raised RuntimeError: bad import-time") as info:
        load_callable(f"{user_module}_broken:fn")
    assert isinstance(info.value.__cause__, RuntimeError)


# --- RewardSet.score --------------------------------------------------------------------------


def exact(completion: str, reference: object) -> float | None:
    return None if reference is None else float(completion == str(reference))


def short(completion: str) -> float:
    return 1.0 if len(completion) <= 2 else 0.0


def test_weighted_total_counts_none_as_zero_and_reports_metrics() -> None:
    rewards = RewardSet(
        [RewardTerm("exact", as_reward(exact), 2.0), RewardTerm("short", as_reward(short), 0.5)]
    )
    samples = [sample("7"), sample("7"), sample(None), sample("8")]
    scores = rewards.score(["7", "seven", "7", "8"], samples)

    assert scores.components == {"exact": [1.0, 0.0, None, 1.0], "short": [1.0, 0.0, 1.0, 1.0]}
    assert scores.totals == [2.5, 0.0, 0.5, 2.5]
    m = scores.metrics
    assert m["reward/mean"] == pytest.approx(5.5 / 4)
    variance = sum((t - 5.5 / 4) ** 2 for t in scores.totals) / 4
    assert m["reward/std"] == pytest.approx(math.sqrt(variance))
    assert m["reward/exact/mean"] == pytest.approx(2 / 3)  # over the three non-None scores
    assert m["reward/exact/std"] == pytest.approx(math.sqrt(2 / 9))
    assert m["reward/exact/coverage"] == pytest.approx(0.75)
    assert m["reward/short/coverage"] == 1.0
    assert m["reward/errors"] == 0.0
    assert rewards.names == ["exact", "short"]


def test_reward_that_never_applies_has_zero_coverage_and_no_mean() -> None:
    scores = RewardSet([RewardTerm("exact", as_reward(exact))]).score(["a"], [sample(None)])
    assert scores.totals == [0.0]
    assert scores.metrics["reward/exact/coverage"] == 0.0
    assert "reward/exact/mean" not in scores.metrics


def boom_on_bad(completion: str) -> float:
    if completion == "bad":
        raise ValueError("cannot parse")
    return 1.0


def test_on_error_raise_names_the_reward_and_the_sample() -> None:
    rewards = RewardSet([RewardTerm("parser", as_reward(boom_on_bad))], on_error="raise")
    samples = [sample(source="train.jsonl:3"), sample(source="train.jsonl:4")]
    with pytest.raises(RewardError) as info:
        rewards.score(["fine", "bad"], samples)
    error = info.value
    assert isinstance(error, ReasonctlError)
    assert "reward 'parser' failed on sample train.jsonl:4" in str(error)
    assert "ValueError: cannot parse" in str(error)
    assert "'bad'" in str(error)  # the completion preview
    assert error.reward == "parser" and error.source == "train.jsonl:4"
    assert isinstance(error.__cause__, ValueError)


def test_error_preview_is_limited_to_200_characters() -> None:
    def always_fails(completion: str) -> float:
        raise RuntimeError("nope")

    rewards = RewardSet([RewardTerm("fails", as_reward(always_fails))])
    with pytest.raises(RewardError) as info:
        rewards.score(["x" * 500], [sample(source="d.jsonl:1")])
    assert info.value.completion == "x" * 200
    assert "x" * 201 not in str(info.value)


def test_on_error_zero_isolates_failing_samples_of_a_batched_reward() -> None:
    calls = []

    def fragile(completions: list[str], samples: list[Sample]) -> list[float]:
        calls.append(len(completions))
        if "bad" in completions:
            raise ValueError("batch contains bad")
        return [0.5] * len(completions)

    rewards = RewardSet(
        [RewardTerm("fragile", as_reward(fragile)), RewardTerm("short", as_reward(short), 2.0)],
        on_error="zero",
    )
    samples = [sample(source=f"d:{i}") for i in range(3)]
    scores = rewards.score(["ok", "bad", "ok"], samples)

    assert scores.components["fragile"] == [0.5, 0.0, 0.5]
    assert scores.totals == [2.5, 0.0, 2.5]
    assert scores.metrics["reward/errors"] == 1.0
    assert [e.source for e in scores.errors] == ["d:1"]
    assert calls == [3, 1, 1, 1]  # the batch, then one call per completion


def test_length_mismatch_is_an_error_naming_the_reward() -> None:
    def one_short(completions: list[str], samples: list[Sample]) -> list[float]:
        return [1.0] * (len(completions) - 1)

    rewards = RewardSet([RewardTerm("one_short", as_reward(one_short))])
    with pytest.raises(RewardLengthError, match="'one_short' returned 1 scores for 2 completions"):
        rewards.score(["a", "b"], [sample(source="x:1"), sample(source="x:2")])

    zeroed = RewardSet([RewardTerm("one_short", as_reward(one_short))], on_error="zero")
    scores = zeroed.score(["a", "b"], [sample(), sample()])
    assert scores.components["one_short"] == [0.0, 0.0]
    assert scores.metrics["reward/errors"] == 2.0


def test_batch_only_failure_with_each_sample_fine() -> None:
    def batch_of_one_only(completions: list[str], samples: list[Sample]) -> list[float]:
        if len(completions) > 1:
            raise RuntimeError("batching broken")
        return [1.0]

    with pytest.raises(RewardError, match="succeeded on each one alone"):
        RewardSet([RewardTerm("b", as_reward(batch_of_one_only))]).score(["a", "b"], [sample()] * 2)
    scores = RewardSet([RewardTerm("b", as_reward(batch_of_one_only))], on_error="zero").score(
        ["a", "b"], [sample()] * 2
    )
    assert scores.components["b"] == [1.0, 1.0]
    assert scores.metrics["reward/errors"] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), "1.0", [1.0]])
def test_invalid_score_values_are_errors(bad: object) -> None:
    rewards = RewardSet([RewardTerm("odd", as_reward(lambda completion: bad))])
    with pytest.raises(RewardError, match="reward 'odd'"):
        rewards.score(["a"], [sample(source="s:1")])


def test_numeric_types_are_accepted() -> None:
    rewards = RewardSet([RewardTerm("b", as_reward(lambda completion: completion == "y"))])
    assert rewards.score(["y", "n"], [sample(), sample()]).components["b"] == [1.0, 0.0]


def test_score_rejects_mismatched_inputs_and_duplicate_names() -> None:
    rewards = RewardSet([RewardTerm("short", as_reward(short))])
    with pytest.raises(ValueError, match="2 completions but 1 samples"):
        rewards.score(["a", "b"], [sample()])
    with pytest.raises(ConfigError, match="'short' is listed twice"):
        RewardSet([RewardTerm("short", as_reward(short)), RewardTerm("short", as_reward(short))])


# --- from config ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry():
    return PluginHost.load().registry


def test_from_config_builds_plugin_and_module_function_rewards(registry, user_module: str) -> None:
    config = RunConfig(
        rewards={
            "components": [
                {"name": "exact_match", "weight": 1.0, "ignore_case": False},
                {"name": f"{user_module}:contains_reference", "weight": 0.5},
            ],
            "on_error": "zero",
        }
    )
    rewards = RewardSet.from_config(config, registry)
    assert rewards.names == ["exact_match", f"{user_module}:contains_reference"]
    assert rewards.on_error == "zero"
    scores = rewards.score(["<answer>Paris</answer>", "paris"], [sample("Paris"), sample("Paris")])
    assert scores.components["exact_match"] == [1.0, 0.0]  # ignore_case = false was applied
    assert scores.components[f"{user_module}:contains_reference"] == [1.0, 0.0]
    assert scores.totals == [1.5, 0.0]


def test_from_config_without_rewards_says_how_to_add_one(registry) -> None:
    with pytest.raises(ConfigError, match=r"\[\[rewards.components\]\]"):
        RewardSet.from_config(RunConfig(), registry)


def test_config_accepts_importable_module_function_and_reports_a_bad_one(
    registry, user_module: str
) -> None:
    def reward_problems(name: str) -> list[str]:
        data = {"rewards": {"components": [{"name": name}]}}
        return [p for p in component_name_problems(data, registry) if p.startswith("rewards.")]

    assert reward_problems(f"{user_module}:contains_reference") == []
    (problem,) = reward_problems(f"{user_module}:missing_fn")
    assert problem.startswith("rewards.components.0.name: cannot load")
    assert "has no attribute 'missing_fn'" in problem
    (problem,) = reward_problems("not_a_module_abc:fn")
    assert "module 'not_a_module_abc' was not found" in problem
    (problem,) = reward_problems("exact_mach")
    assert "Did you mean 'exact_match'?" in problem
