"""Fixtures shared by the rollout-engine tests: a tiny Qwen2 model with large random
weights (so greedy outputs vary from token to token), its tokenizer and chat prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The saved tiny model (seed 3, initializer range 0.3)."""
    from reasonctl.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("rollout-model"), seed=3,
                               initializer_range=0.3)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    """The tiny model loaded in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompts(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    """Token ids of each question as a user turn with the generation prompt."""
    out = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out
