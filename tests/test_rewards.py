"""The first-party rule-based rewards, their answer parsers and their config options."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from pydantic import ValidationError

from reasonctl.core.config import RunConfig, load_config
from reasonctl.core.errors import ConfigError
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.registry import Registry
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.rewards.answers import (
    extract_boxed,
    extract_tagged,
    last_number,
    parse_exact,
    parse_number,
)
from reasonctl.rewards.choice_answers import read_choice
from reasonctl.rewards.length import overlong_penalty


def sample(reference: object = None, **meta: object) -> Sample:
    prompt = Message("user", [ContentPart("text", text="question?")])
    return Sample(messages=[prompt], reference=reference, meta=dict(meta), source="t.jsonl:1")


class _DefaultStandIns:
    """Stand-ins for default components other plugins provide, only where none is installed,
    so that ``load_config`` gets as far as validating reward options."""

    def __init__(self, registry: Registry) -> None:
        defaults = RunConfig()
        wanted = {
            "algorithm": [defaults.algorithm.name],
            "backend": [defaults.backend.name],
            "dataset": [defaults.data.format],
            "rollout_engine": [defaults.rollout.engine],
            "logger": defaults.logging.loggers,
        }
        self.missing = {
            kind: [n for n in names if n not in registry.names(kind)]
            for kind, names in wanted.items()
        }

    def _register(self, kind: str, register) -> None:
        for name in self.missing[kind]:
            register(name, lambda config, **kwargs: None, description="test stand-in")

    @hookimpl
    def register_algorithms(self, register) -> None:
        self._register("algorithm", register)

    @hookimpl
    def register_backends(self, register) -> None:
        self._register("backend", register)

    @hookimpl
    def register_datasets(self, register) -> None:
        self._register("dataset", register)

    @hookimpl
    def register_rollout_engines(self, register) -> None:
        self._register("rollout_engine", register)

    @hookimpl
    def register_loggers(self, register) -> None:
        self._register("logger", register)


@pytest.fixture(scope="module")
def registry() -> Registry:
    host = PluginHost.load()
    host.add_plugin(_DefaultStandIns(host.registry), name="test-defaults")
    return host.registry


def build(registry: Registry, name: str, **options: object):
    return registry.get("reward", name).build(options)


def score(reward, completion: str, item: Sample) -> float | None:
    (value,) = reward([completion], [item])
    return value


# --- registration -----------------------------------------------------------------------------


def test_rewards_are_registered_by_the_installed_plugin(registry: Registry) -> None:
    rewards = registry.available("reward")
    for name in ("format", "choice", "math", "exact_match", "length"):
        assert rewards[name] == "reasonctl"
        assert registry.get("reward", name).config_model is not None



def test_rewards_registration_loads_the_rewards_only_when_its_hook_runs() -> None:
    """The registration module imports no reward; its hook registers each reward with the
    config model kept next to it in ``reasonctl.rewards``, without importing torch."""
    script = """
import json, sys
import reasonctl.plugins.rewards as registration
before = sorted(m for m in sys.modules if m.startswith("reasonctl.rewards"))
seen = {}
def register(name, factory, *, config_model=None, description=""):
    seen[name] = [factory.__module__, config_model.__module__]
registration.register_rewards(register)
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
print(json.dumps({"before": before, "seen": seen, "heavy": heavy}))
"""
    report = run_python(script)
    assert report["before"] == []
    assert report["seen"] == {
        name: [f"reasonctl.rewards.{name}"] * 2
        for name in ("format", "choice", "math", "exact_match", "length", "remote",
                     "reward_model", "judge")
    }
    assert report["heavy"] == []


def run_python(script: str) -> dict:
    """Run ``script`` in a fresh interpreter and decode the JSON it prints."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])

# --- answers helpers --------------------------------------------------------------------------


def test_extract_tagged_takes_the_last_complete_block() -> None:
    text = "<think>I will use <answer> tags</think><answer> B </answer>"
    assert extract_tagged(text, "answer") == "B"
    assert extract_tagged("<answer>1</answer> then <answer>2</answer>", "answer") == "2"
    assert extract_tagged("<answer>unclosed", "answer") is None
    assert extract_tagged("<result>x</result>", "result") == "x"


def test_extract_boxed_handles_nested_braces() -> None:
    assert extract_boxed(r"so \boxed{\frac{\sqrt{2}}{2}} done") == r"\frac{\sqrt{2}}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert extract_boxed(r"\boxed{1") is None
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B", "B"),
        ("b", "B"),
        ("(C)", "C"),
        ("**D**", "D"),
        ("A.", "A"),
        ("Answer: B", "B"),
        ("I compared them, so the answer is (C) since it fits.", "C"),
        ("The correct option is D.", "D"),
        ("B) a red ball", "B"),
        ("C. the cat", "C"),
        ("Looking at each option carefully\nB", "B"),
        ("(B) a red ball", "B"),
        ("I think (A) is wrong, so (B) it is", None),  # mentions, no commitment
        ("The answer is B. Option C is a truck and option D is a bicycle.", "B"),
        ("Answer: E", None),  # only four options
        ("A cat sat on the mat", None),
        ("(B) or (C)", None),  # a hedge
        ("", None),
    ],
)
def test_read_choice(text: str, expected: str | None) -> None:
    assert read_choice(text, "ABCD").letter == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),
        ("-3.5", -3.5),
        ("1,234,567.5", 1234567.5),
        ("3/4", 0.75),
        (r"\frac{3}{4}", 0.75),
        (r"-\dfrac{1}{2}", -0.5),
        ("50%", 50.0),
        (r"12.5\%", 12.5),
        (r"\frac34", 0.75),
        (r"1{,}234", 1234.0),
        ("$12", 12.0),
        (r"30^\circ", 30.0),
        (r"5 \text{ cm}", 5.0),
        ("7.", 7.0),
        ("1/0", None),
        ("x + 1", None),
    ],
)
def test_parse_number(text: str, expected: float | None) -> None:
    assert parse_number(text) == expected


def test_numbers_stay_exact() -> None:
    assert parse_exact("123456789").value != parse_exact("123456700").value
    assert parse_exact("18.90").value == parse_exact(r"\$18.9").value
    assert parse_exact("2/4").kind == "fraction" and parse_exact("0.5").kind == "decimal"
    assert parse_exact("50%").values() == [50, Fraction(1, 2)]


def test_last_number() -> None:
    assert last_number("she pays $1,234.50 in total.").value == Fraction("1234.5")
    assert last_number("step 1: 3 + 4 = 7\n#### 7").value == 7
    assert last_number(r"the ratio is \frac{2}{3}").value == Fraction(2, 3)
    assert last_number("we get x-5, that is -5").value == -5
    assert last_number("The answer is 1/2.").value == Fraction(1, 2)
    assert last_number("no digits here") is None


# --- format -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>2+2 is 4</think>\n<answer>4</answer>", 1.0),
        ("  <think>\nreasoning\n</think><answer>4</answer>\n", 1.0),
        ("<answer>4</answer>", 0.0),  # think required
        ("<think>r</think><answer>  </answer>", 0.0),  # empty answer
        ("<think>r</think><answer>4</answer> trailing words", 0.0),
        ("<answer>4</answer><think>r</think>", 0.0),  # wrong order
        ("<think>r</think><think>s</think><answer>4</answer>", 0.0),  # tag twice
        ("The answer is 4", 0.0),
    ],
)
def test_format_reward(registry: Registry, completion: str, expected: float) -> None:
    assert score(build(registry, "format"), completion, sample()) == expected


def test_format_reward_options(registry: Registry) -> None:
    optional_think = build(registry, "format", require_think=False)
    assert score(optional_think, "<answer>4</answer>", sample()) == 1.0
    assert score(optional_think, "<think>r</think><answer>4</answer>", sample()) == 1.0

    partial = build(registry, "format", partial_credit=0.5)
    assert score(partial, "<think>r</think><answer>4</answer> trailing", sample()) == 0.5
    assert score(partial, "no tags at all", sample()) == 0.0

    custom = build(registry, "format", think_tag="reasoning", answer_tag="final")
    assert score(custom, "<reasoning>r</reasoning><final>4</final>", sample()) == 1.0
    assert score(custom, "<think>r</think><answer>4</answer>", sample()) == 0.0

    with pytest.raises(ValidationError, match="not a tag name"):
        build(registry, "format", answer_tag="<answer>")


# --- choice -----------------------------------------------------------------------------------

OPTIONS = {"A": "a dog", "B": "a red ball", "C": "a cat", "D": "nothing"}


@pytest.mark.parametrize(
    ("completion", "item", "expected"),
    [
        ("<think>...</think><answer>C</answer>", sample("C"), 1.0),
        ("<think>...</think><answer>B</answer>", sample("C"), 0.0),
        ("<answer>(c)</answer>", sample("(C)"), 1.0),
        ("After looking again, the answer is C.", sample("C"), 1.0),
        ("<answer>I cannot tell</answer>", sample("C"), 0.0),
        # reference dict with index2ans; answer given as the letter or as the option text
        ("<answer>C</answer>", sample({"question": "q", "index2ans": OPTIONS, "answer": "C"}), 1.0),
        ("<answer>C</answer>", sample({"question": "q", "index2ans": OPTIONS, "answer": "a cat"}),
         1.0),
        ("<answer>B</answer>", sample({"question": "q", "index2ans": OPTIONS, "answer": "a cat"}),
         0.0),
        # Cosmos-Reason RL layout in meta["qa_pairs"], as a dict or a list of one
        ("<answer>A</answer>", sample(qa_pairs={"index2ans": OPTIONS, "answer": "A"}), 1.0),
        ("<answer>A</answer>", sample(qa_pairs=[{"index2ans": OPTIONS, "answer": "a dog"}]), 1.0),
        # the response may give the option text instead of the letter
        ("<answer>A Cat</answer>", sample(qa_pairs={"index2ans": OPTIONS, "answer": "C"}), 1.0),
        ("<answer>a dog</answer>", sample(qa_pairs={"index2ans": OPTIONS, "answer": "C"}), 0.0),
        # a letter outside the options is not a pick
        ("<answer>E</answer>", sample("A", choices=["x", "y", "z", "w"]), 0.0),
        # meta["choices"] as a list, reference as option text or as a 0-based index
        ("<answer>B</answer>", sample("yes", choices=["no", "yes"]), 1.0),
        ("<answer>B</answer>", sample(1, choices=["no", "yes"]), 1.0),
        # no options known: a text reference is compared as text
        ("<answer>Paris</answer>", sample("paris"), 1.0),
    ],
)
def test_choice_reward(registry: Registry, completion: str, item: Sample, expected: float) -> None:
    assert score(build(registry, "choice"), completion, item) == expected


def test_choice_reward_without_reference_does_not_apply(registry: Registry) -> None:
    reward = build(registry, "choice")
    assert score(reward, "<answer>A</answer>", sample()) is None
    assert score(reward, "<answer>A</answer>", sample(qa_pairs={"index2ans": OPTIONS})) is None


def test_choice_reward_custom_letters_and_whole_text(registry: Registry) -> None:
    reward = build(registry, "choice", letters="WXYZ", answer_tag=None)
    item = sample("X", choices=["one", "two", "three"])
    assert score(reward, "I pick (X)", item) == 1.0
    assert score(reward, "I pick (A)", item) == 0.0
    with pytest.raises(ValidationError, match="distinct upper-case letters"):
        build(registry, "choice", letters="abc")


# --- math -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        (r"so the answer is \boxed{42}", "42", 1.0),
        (r"\boxed{42}", 42, 1.0),
        (r"\boxed{41}", 42, 0.0),
        (r"\boxed{0.5}", "1/2", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (r"\boxed{1,234}", "1234", 1.0),
        (r"\boxed{50\%}", "0.5", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{3.0}", "3", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\dfrac{1}{\sqrt{2}}", 1.0),  # symbolic
        ("She has 3 apples, then 5 more, so 8 in total.", "8", 0.0),  # no answer written
        ("Total: $1,200.00.", "#### 1200", 0.0),
        ("So she pays $1,200.00.\n#### 1200", "#### 1200", 1.0),  # GSM8K-style reference
        ("I think 7, no wait, 9", "7", 0.0),
        ("no idea", "7", 0.0),
        (r"<think>maybe 3</think><answer>\boxed{4}</answer>", r"solution ... \boxed{4}", 1.0),
        ("<think>it is 4</think><answer>3</answer>", "4", 0.0),  # only the answer block counts
        ("<answer>2/4</answer>", "0.5", 1.0),
    ],
)
def test_math_reward(
    registry: Registry, completion: str, reference: object, expected: float
) -> None:
    assert score(build(registry, "math"), completion, sample(reference)) == expected


def test_math_reward_options(registry: Registry) -> None:
    assert score(build(registry, "math"), r"\boxed{4}", sample(None)) is None
    strict = build(registry, "math", require_boxed=True)
    assert score(strict, "the answer is 4", sample("4")) == 0.0
    assert score(strict, r"the answer is \boxed{4}", sample("4")) == 1.0
    assert score(build(registry, "math"), r"\boxed{3.14}", sample("3.14159")) == 0.0
    assert score(build(registry, "math"), r"\boxed{3.1416}", sample(r"\pi")) == 0.0
    loose = build(registry, "math", rel_tol=1e-4)
    assert score(loose, r"\boxed{3.1416}", sample(r"\pi")) == 1.0
    assert score(loose, r"\boxed{3.1416}", sample("3.14159")) == 0.0  # two decimals: exact
    tagged = build(registry, "math", require_tag=True)
    assert score(tagged, r"\boxed{4}", sample("4")) == 0.0
    assert score(tagged, "<answer>4</answer>", sample("4")) == 1.0
    fallback = build(registry, "math", last_number_fallback=True)
    assert score(fallback, "so 8 in total.", sample("8")) == 1.0
    assert score(build(registry, "math"), "so 8 in total.", sample("8")) == 0.0


def test_a_pathological_answer_cannot_stall_scoring_even_off_the_main_thread(
        registry: Registry) -> None:
    """SymPy never finishes 9^(9^(9^9)); the comparison runs in a child process that is
    killed at the time limit, from whatever thread scores."""
    import threading
    import time

    reward = build(registry, "math", timeout_s=1.0)
    results: list = []

    def work() -> None:
        results.append(reward([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2\sqrt{2}}"],
                              [sample("5"), sample(r"\sqrt{8}")]))

    started = time.monotonic()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results == [[0.0, 1.0]]
    assert time.monotonic() - started < 30


def test_a_timed_out_comparison_is_not_retried_and_the_judge_recovers() -> None:
    import time

    from reasonctl.rewards.math_judge import SymbolicJudge

    judge = SymbolicJudge()
    try:
        tower = "9^{9^{9^{9}}}"
        assert judge.equivalent(tower, "1", timeout_s=1.0) is False
        assert judge.timeouts == 1
        started = time.monotonic()
        assert judge.equivalent(tower, "1", timeout_s=1.0) is False  # remembered
        assert time.monotonic() - started < 0.5 and judge.timeouts == 2
        assert judge.equivalent(r"\sqrt{8}", r"2\sqrt2", timeout_s=30.0) is True
    finally:
        judge.close()


# --- exact_match ------------------------------------------------------------------------------


def test_exact_match_reward(registry: Registry) -> None:
    reward = build(registry, "exact_match")
    assert score(reward, "<answer>  New   York </answer>", sample("new york")) == 1.0
    assert score(reward, "<answer>New York!</answer>", sample("new york")) == 0.0
    assert score(reward, "Boston", sample(["NYC", "boston"])) == 1.0
    assert score(reward, "<answer>4</answer>", sample(4)) == 1.0
    assert score(reward, "anything", sample(None)) is None

    assert score(build(registry, "exact_match", ignore_punctuation=True),
                 "<answer>New York!</answer>", sample("new york")) == 1.0
    assert score(build(registry, "exact_match", ignore_case=False),
                 "<answer>new york</answer>", sample("New York")) == 0.0
    whole = build(registry, "exact_match", answer_tag=None)
    assert score(whole, "<answer>x</answer>", sample("x")) == 0.0
    tagged = build(registry, "exact_match", require_tag=True)
    assert score(tagged, "x", sample("x")) == 0.0


# --- length -----------------------------------------------------------------------------------


def test_overlong_penalty_follows_the_dapo_ramp() -> None:
    assert overlong_penalty(80, max_length=100, buffer=20) == 0.0
    assert overlong_penalty(90, max_length=100, buffer=20) == pytest.approx(-0.5)
    assert overlong_penalty(100, max_length=100, buffer=20) == pytest.approx(-1.0)
    assert overlong_penalty(150, max_length=100, buffer=20) == -1.0
    assert overlong_penalty(101, max_length=100, buffer=0) == -1.0
    assert overlong_penalty(95, max_length=100, buffer=10, penalty=0.5) == pytest.approx(-0.25)


def test_length_reward_units(registry: Registry) -> None:
    chars = build(registry, "length", max_length=10, buffer=4)
    assert chars(["x" * 6, "x" * 8, "x" * 12], [sample()] * 3) == [0.0, -0.5, -1.0]
    words = build(registry, "length", max_length=4, buffer=2, unit="words", penalty=2.0)
    assert words(["one two", "one two three", "a b c d e"], [sample()] * 3) == [0.0, -1.0, -2.0]


def test_length_reward_counts_tokenizer_tokens(registry: Registry, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ",": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)

    reward = build(registry, "length", max_length=4, buffer=2, unit="tokens",
                   tokenizer=str(tmp_path))
    # "hello,world" is one word but three tokens; "hello world" two of each
    assert reward(["hello world", "hello,world", "hello, world, hello"], [sample()] * 3) == [
        0.0, -0.5, -1.0
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_length": 10, "buffer": 20}, "must not exceed max_length"),
        ({"max_length": 10, "buffer": 2, "unit": "tokens"}, "needs tokenizer"),
        ({"max_length": 10, "buffer": 2, "tokenizer": "t"}, "only used with unit = 'tokens'"),
        ({"buffer": 2}, "max_length"),
    ],
)
def test_length_config_is_checked(registry: Registry, options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build(registry, "length", **options)


# --- options through the run config -----------------------------------------------------------


def rewards_config(registry: Registry, *components: dict) -> RunConfig:
    return load_config(values={"rewards": {"components": list(components)}}, registry=registry)


def test_reward_options_validate_through_load_config(registry: Registry) -> None:
    config = rewards_config(
        registry,
        {"name": "math", "weight": 1.0, "require_boxed": True},
        {"name": "length", "weight": 0.5, "max_length": 512, "buffer": 128},
    )
    (_, math_options), (_, length_options) = config.reward_configs(registry)
    assert math_options.require_boxed is True
    assert (length_options.max_length, length_options.buffer) == (512, 128)


def test_wrong_reward_option_key_is_a_config_problem(registry: Registry) -> None:
    with pytest.raises(ConfigError) as info:
        rewards_config(registry, {"name": "exact_match", "ignore_cas": True})
    (problem,) = info.value.problems
    assert problem.startswith("rewards.components.0.ignore_cas: unknown key")
    assert "did you mean 'ignore_case'?" in problem


def test_bad_reward_option_values_are_reported_with_their_path(registry: Registry) -> None:
    with pytest.raises(ConfigError) as info:
        rewards_config(
            registry,
            {"name": "format"},
            {"name": "length", "max_length": 10, "buffer": 20},
            {"name": "format_v2"},
        )
    problems = info.value.problems
    assert any(p.startswith("rewards.components.2.name: Unknown reward 'format_v2'") for p in
               problems)

    with pytest.raises(ConfigError) as info:
        rewards_config(registry, {"name": "length", "max_length": 10, "buffer": 20})
    (problem,) = info.value.problems
    assert problem.startswith("rewards.components.0")
    assert "must not exceed max_length" in problem


def test_module_function_reward_takes_no_options(registry: Registry) -> None:
    with pytest.raises(ConfigError) as info:
        rewards_config(registry, {"name": "os.path:exists", "threshold": 2})
    (problem,) = info.value.problems
    assert problem.startswith("rewards.components.0.threshold:")
    assert "takes no options" in problem
