"""``judge``: a generative model grades each completion with a rubric.

```toml
[[rewards.components]]
name = "judge"
model = "Qwen/Qwen2.5-7B-Instruct"   # any causal LM (a directory or a Hugging Face id)
template_file = "rubric.txt"          # or template = "...{prompt}...{reference}...{completion}..."
parse = "verdict"                     # or "score"
marker = "Verdict:"                   # the verdict (or score) follows the last marker
verdicts = { correct = 1.0, incorrect = 0.0 }
max_new_tokens = 256
engine = "hf"                         # our rollout engine; "vllm" where vLLM is installed
```

The rubric is filled with the sample's prompt, its reference and the completion, written
as a user turn with the tokenizer's chat template (``chat = false``: as is) and generated
greedily (``temperature = 0``) by the rollout engine: reasonctl's own ``hf`` engine
(static KV cache, continuous batching of up to ``batch_size`` sequences) or vLLM. The
judge's reply is read at its last ``marker``:

- ``parse = "verdict"``: the word(s) after it must be one of ``verdicts`` (case,
  markdown emphasis and quotes ignored; the longest matching verdict wins, so
  "incorrect" is not read as "correct"), whose value is the score;
- ``parse = "score"``: a number after it, within ``score_range``, scaled to [0, 1].

A reply without the marker, or with anything else after it, scores ``None`` with the
reason ``unparseable`` (a number outside the range: ``out_of_range``); a rubric that needs
``{reference}`` on a sample without one gives ``no_reference``, a prompt longer than
``max_prompt_tokens`` ``too_long``. The judge counts its reasons (:attr:`JudgeReward.reasons`),
logs the unparseable replies of each batch, and explanations show the verdict it read (or
the end of an unparseable reply). It runs in a background thread (the reward is
asynchronous) or on ``reasonctl serve-rewards`` workers, batched across requests.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from reasonctl.core.types import Explanation, Sample, SamplingParams
from reasonctl.rewards.model_rewards import (
    BackgroundScoring,
    ModelRewardConfig,
    load_tokenizer,
    model_source,
    prompt_text,
    reference_text,
    resolve_device,
    torch_dtype,
)
from reasonctl.rewards.templates import check_template, placeholders, render

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = """You are grading the answer to a question against a reference answer.

Question:
{prompt}

Reference answer:
{reference}

Answer to grade:
{completion}

Is the final answer of the answer to grade the same as the reference answer? Reason \
briefly, then end with one line: "Verdict: correct" or "Verdict: incorrect"."""
UNPARSEABLE = "unparseable"
OUT_OF_RANGE = "out_of_range"
NO_REFERENCE = "no_reference"
TOO_LONG = "too_long"
JUDGED = "judged"
REPLY_TAIL_CHARS = 200
_DECORATION = "*_`'\"[]()<>: \t\n"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


class JudgeConfig(ModelRewardConfig):
    """Options of the ``judge`` reward."""

    template: str | None = Field(
        default=None,
        description="The rubric, with {prompt}, {completion} and {reference}; default: a "
        "correctness rubric against the reference answer ending in 'Verdict: ...'.",
    )
    template_file: str | None = Field(default=None,
                                      description="A file holding the rubric (UTF-8).")
    system: str | None = Field(default=None, description="A system message before the rubric.")
    chat: bool = Field(default=True,
                       description="Write the rubric as a user turn with the tokenizer's "
                       "chat template; false: the rubric is the whole prompt.")
    parse: Literal["verdict", "score"] = Field(
        default="verdict", description="verdict: a word of `verdicts`; score: a number.")
    marker: str | None = Field(
        default=None,
        description="The verdict or score follows the last occurrence of this text "
        "(case-insensitive); default 'Verdict:' or 'Score:'; '' reads the last line.",
    )
    verdicts: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0, "incorrect": 0.0},
        description="Verdict word(s) and their scores.")
    score_range: tuple[float, float] = Field(
        default=(1.0, 10.0), description="parse = 'score': the lowest and highest score "
        "the rubric asks for; scaled to 0 and 1.")
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens the judge may write.")
    max_prompt_tokens: int = Field(default=8192, gt=0,
                                   description="Longer judge prompts are not judged (None).")
    temperature: float = Field(default=0.0, ge=0, description="0: greedy.")
    seed: int = Field(default=0, ge=0)
    stop: list[str] = Field(default_factory=list,
                            description="Strings that end the judge's reply.")
    engine: Literal["hf", "vllm"] = Field(
        default="hf", description="hf: reasonctl's rollout engine; vllm: vLLM (installed "
        "with pip install 'reasonctl[vllm]').")
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="engine = 'vllm': the GPU share vLLM may use.")

    @field_validator("template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        return None if value is None else check_template(value)

    @field_validator("verdicts")
    @classmethod
    def _verdicts(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("name at least one verdict, e.g. {correct = 1.0, incorrect = 0.0}")
        keys = [key.strip().casefold() for key in value]
        if any(not key for key in keys) or len(set(keys)) != len(keys):
            raise ValueError("verdicts must be different non-empty words (case is ignored)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JudgeConfig:
        if self.template is not None and self.template_file is not None:
            raise ValueError("give template or template_file, not both")
        low, high = self.score_range
        if not low < high:
            raise ValueError(f"score_range: the lowest score must be below the highest "
                             f"(got {list(self.score_range)})")
        if self.template_file is not None:
            self.rubric()
        return self

    def rubric(self) -> str:
        """The rubric template (``template_file`` read and checked here)."""
        if self.template_file is None:
            return self.template or DEFAULT_TEMPLATE
        path = Path(self.template_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"template_file: cannot read {path}: {exc.strerror}") from None
        try:
            return check_template(text)
        except ValueError as exc:
            raise ValueError(f"template_file {path}: {exc}") from None

    def read_marker(self) -> str:
        """The marker the reply is read at."""
        if self.marker is not None:
            return self.marker
        return "Verdict:" if self.parse == "verdict" else "Score:"


def read_reply(reply: str, config: JudgeConfig) -> Explanation:
    """The score of a judge's ``reply`` (see the module docstring)."""
    marker = config.read_marker()
    if marker:
        at = reply.casefold().rfind(marker.casefold())
        if at < 0:
            return Explanation(None, _tail(reply), UNPARSEABLE)
        after = reply[at + len(marker) :]
    else:
        lines = [line for line in reply.splitlines() if line.strip()]
        after = lines[-1] if lines else ""
    after = after.lstrip(_DECORATION)
    if config.parse == "verdict":
        return _verdict(after, reply, config)
    match = _NUMBER.match(after)
    if match is None:
        return Explanation(None, _tail(reply), UNPARSEABLE)
    value = float(match.group(0))
    low, high = config.score_range
    if not low <= value <= high:
        return Explanation(None, match.group(0), OUT_OF_RANGE)
    return Explanation((value - low) / (high - low), match.group(0), JUDGED)


def _verdict(after: str, reply: str, config: JudgeConfig) -> Explanation:
    folded = after.casefold()
    for word, score in sorted(config.verdicts.items(), key=lambda item: -len(item[0])):
        key = word.strip().casefold()
        if folded.startswith(key) and (len(folded) == len(key) or not folded[len(key)].isalnum()):
            return Explanation(float(score), word, JUDGED)
    return Explanation(None, _tail(reply), UNPARSEABLE)


def _tail(reply: str) -> str:
    reply = reply.strip()
    return reply if len(reply) <= REPLY_TAIL_CHARS else "..." + reply[-REPLY_TAIL_CHARS:]


class JudgeReward(BackgroundScoring):
    """Scores completions with a generative judge model and a rubric."""

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__()
        self.config = config
        self.rubric = config.rubric()
        self.needs_reference = "reference" in placeholders(self.rubric)
        self.tokenizer = load_tokenizer(config)
        if config.chat and not getattr(self.tokenizer, "chat_template", None):
            from reasonctl.core.errors import ConfigError

            raise ConfigError([f"chat: the tokenizer of {config.tokenizer or config.model} has "
                               "no chat template; set chat = false to give the rubric as the "
                               "whole prompt"])
        self.engine = _build_engine(config, self.tokenizer)

    def __repr__(self) -> str:
        return f"JudgeReward(model={self.config.model!r}, parse={self.config.parse!r})"

    def prompt_ids(self, completion: str, sample: Sample) -> list[int]:
        """The judge's prompt for ``completion`` answering ``sample``, as token ids."""
        text = render(self.rubric, prompt=prompt_text(sample), completion=completion,
                      reference=reference_text(sample) or "")
        if not self.config.chat:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        messages = [{"role": "user", "content": text}]
        if self.config.system:
            messages.insert(0, {"role": "system", "content": self.config.system})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def explain(self, completions: Sequence[str], samples: Sequence[Sample]
                ) -> list[Explanation]:
        """Judge each completion (see the module docstring for the reasons)."""
        out: list[Explanation | None] = []
        prompts: list[list[int]] = []
        for completion, sample in zip(completions, samples, strict=True):
            if self.needs_reference and reference_text(sample) is None:
                out.append(Explanation(None, None, NO_REFERENCE))
                continue
            ids = self.prompt_ids(completion, sample)
            if len(ids) > self.config.max_prompt_tokens:
                out.append(Explanation(None, None, TOO_LONG))
                continue
            out.append(None)
            prompts.append(ids)
        replies = iter(self.generate(prompts))
        explained = [e if e is not None else read_reply(next(replies), self.config) for e in out]
        unparseable = [e for e in explained if e.reason in (UNPARSEABLE, OUT_OF_RANGE)]
        if unparseable:
            logger.warning("judge %s: %d of %d replies could not be read (scored None); the "
                           "first ends: %r", self.config.model, len(unparseable),
                           len(explained), unparseable[0].extracted)
        return explained

    def generate(self, prompts: list[list[int]]) -> list[str]:
        """The judge's replies to ``prompts`` (token ids), generated together."""
        if not prompts:
            return []
        cfg = self.config
        params = SamplingParams(n=1, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                stop=list(cfg.stop), seed=cfg.seed)
        groups = self.engine.generate([{"input_ids": ids} for ids in prompts], params)
        return [group[0].text for group in groups]


def _build_engine(config: JudgeConfig, tokenizer: Any) -> Any:
    """The rollout engine that generates the judge's replies."""
    source = model_source(config)
    device = resolve_device(config.device)
    dtype = torch_dtype(config.dtype, device)
    if config.engine == "vllm":
        from types import SimpleNamespace

        from transformers import AutoConfig, GenerationConfig

        from reasonctl.core.errors import require
        from reasonctl.rollout.hf_engine import default_eos_ids
        from reasonctl.rollout.vllm.config import VLLMRolloutConfig

        require("vllm", "vllm", "the judge reward with engine = 'vllm'")
        from reasonctl.rollout.vllm.engine import VLLMColocatedEngine

        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:
            generation = None
        hf_config = AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code)
        eos = default_eos_ids(SimpleNamespace(generation_config=generation, config=hf_config),
                              tokenizer)
        vllm_config = VLLMRolloutConfig(gpu_memory_utilization=config.gpu_memory_utilization,
                                        max_num_seqs=config.batch_size, sleep_level=0)
        args = vllm_config.engine_args(model_dir=source, dtype=str(dtype).removeprefix("torch."),
                                       seed=config.seed, weight_transfer_backend="")
        args["tokenizer"] = config.tokenizer or source
        if config.trust_remote_code:
            args["trust_remote_code"] = True
        return VLLMColocatedEngine(args, eos_token_ids=eos)
    from transformers import AutoModelForCausalLM

    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                 trust_remote_code=config.trust_remote_code)
    model = model.to(device).eval().requires_grad_(False)
    return HFRolloutEngine(model, tokenizer, max_batch_size=config.batch_size)


def judge_reward(config: JudgeConfig) -> JudgeReward:
    """The factory of ``judge``."""
    return JudgeReward(config)


__all__ = ["DEFAULT_TEMPLATE", "JudgeConfig", "JudgeReward", "judge_reward", "read_reply"]
