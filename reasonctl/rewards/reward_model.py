"""``reward_model``: a sequence-classification model scores prompt + completion.

```toml
[[rewards.components]]
name = "reward_model"
model = "path/or/hub-id"       # AutoModelForSequenceClassification (e.g. a Bradley-Terry RM)
label = 0                      # which output logit is the score (0 for a one-logit model)
normalize = "none"             # or "sigmoid": the logit mapped into (0, 1)
batch_size = 16
max_length = 4096              # longer inputs score None (reason "too_long")
```

The input is the sample's prompt turns and the completion as the assistant's answer,
written with the tokenizer's chat template (or ``template`` with ``{prompt}``,
``{completion}`` and ``{reference}``; ``"{prompt}\\n{completion}"`` for tokenizers without
a template). Inputs are padded on the right and the model reads the score at each
input's last token. The model runs in a background thread (the reward is asynchronous)
or on ``reasonctl serve-rewards`` workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from reasonctl.core.types import Explanation, Sample
from reasonctl.rewards.base import Reason
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
from reasonctl.rewards.templates import check_template, render

TOO_LONG = "too_long"


class RewardModelConfig(ModelRewardConfig):
    """Options of the ``reward_model`` reward."""

    label: int = Field(default=0, ge=0,
                       description="Index of the output logit that is the score.")
    normalize: Literal["none", "sigmoid"] = Field(
        default="none", description="sigmoid: map the logit into (0, 1).")
    max_length: int = Field(default=4096, gt=0,
                            description="Longer inputs (in tokens) are not scored (None).")
    template: str | None = Field(
        default=None,
        description="The input text with {prompt}, {completion} and {reference}; default: "
        "the tokenizer's chat template (prompt turns, then the completion as the "
        "assistant's turn).",
    )

    @field_validator("template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        return None if value is None else check_template(value)


class RewardModelReward(BackgroundScoring):
    """The score a sequence-classification model gives prompt + completion."""

    def __init__(self, config: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        super().__init__()
        self.config = config
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(config)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            model_source(config), dtype=torch_dtype(config.dtype, self.device),
            trust_remote_code=config.trust_remote_code)
        if config.label >= model.config.num_labels:
            from reasonctl.core.errors import ConfigError

            raise ConfigError([f"label: {config.model} has {model.config.num_labels} output "
                               f"logit(s); label must be below that (got {config.label})"])
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._torch = torch

    def __repr__(self) -> str:
        return f"RewardModelReward(model={self.config.model!r})"

    def text(self, completion: str, sample: Sample) -> str:
        """The input the model scores for ``completion`` answering ``sample``."""
        prompt = prompt_text(sample)
        if self.config.template is not None:
            return render(self.config.template, prompt=prompt, completion=completion,
                          reference=reference_text(sample) or "")
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": m.role, "content": m.text} for m in sample.prompt_messages()]
            messages.append({"role": "assistant", "content": completion})
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return f"{prompt}\n{completion}"

    def explain(self, completions: Sequence[str], samples: Sequence[Sample]
                ) -> list[Explanation]:
        """Score each completion (``scored``; ``too_long`` beyond ``max_length`` tokens)."""
        encoded = [self.tokenizer(self.text(c, s), add_special_tokens=False)["input_ids"]
                   for c, s in zip(completions, samples, strict=True)]
        out: list[Explanation] = [Explanation(None, None, TOO_LONG)] * len(encoded)
        fitting = [i for i, ids in enumerate(encoded) if len(ids) <= self.config.max_length]
        size = self.config.batch_size
        for start in range(0, len(fitting), size):
            chunk = fitting[start : start + size]
            for index, score in zip(chunk, self._scores([encoded[i] for i in chunk]),
                                    strict=True):
                out[index] = Explanation(score, None, Reason.SCORED)
        return out

    def _scores(self, batch: list[list[int]]) -> list[float]:
        torch = self._torch
        padded = self.tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        with torch.inference_mode():
            logits = self.model(input_ids=padded["input_ids"].to(self.device),
                                attention_mask=padded["attention_mask"].to(self.device)).logits
        values = logits[:, self.config.label].float()
        if self.config.normalize == "sigmoid":
            values = torch.sigmoid(values)
        return [float(v) for v in values.cpu()]


def reward_model_reward(config: RewardModelConfig) -> RewardModelReward:
    """The factory of ``reward_model``."""
    return RewardModelReward(config)


__all__ = ["RewardModelConfig", "RewardModelReward", "reward_model_reward"]
