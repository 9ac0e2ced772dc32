"""A tiny judge that really judges: the tiny Qwen2 of :mod:`reasonctl.models.tiny`, built
from its config and trained here for a few seconds to reply to a short rubric with a
verdict that depends on the completion it reads (and, for one completion, with a reply
that is no verdict at all). Greedy decoding then reproduces those replies exactly, so a
test knows what the judge must say: correct, incorrect, or nothing parseable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reasonctl.core.types import ContentPart, Message, Sample

RUBRIC = "Q: {prompt}\nRef: {reference}\nA: {completion}\nJudge: "
QUESTION = "What is 2+2?"
REFERENCE = "4"
REPLIES = {
    "4": "Verdict: correct",
    "The answer is 4.": "Verdict: correct",
    "x = 4": "Verdict: correct",
    "5": "Verdict: incorrect",
    "4 or 5": "Verdict: incorrect",
    "banana": "I do not know.",
}
"""Completion -> what the trained judge replies."""
SCORES = {"4": 1.0, "The answer is 4.": 1.0, "x = 4": 1.0, "5": 0.0, "4 or 5": 0.0,
          "banana": None}
JUDGE_OPTIONS = {"template": RUBRIC, "chat": False, "max_new_tokens": 24, "device": "cpu",
                 "batch_size": 4}
"""The ``judge`` reward's options for this model (add ``model``)."""


def make_trained_judge_dir(path: Path, *, max_steps: int = 600) -> Path:
    """Train the tiny judge on :data:`REPLIES` and save it (with its tokenizer) to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from reasonctl.models.tiny import build_tiny_tokenizer, tiny_qwen2_config

    tokenizer = build_tiny_tokenizer()
    config = tiny_qwen2_config(len(tokenizer))
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    rows = []
    for completion, reply in REPLIES.items():
        prompt = RUBRIC.format(prompt=QUESTION, reference=REFERENCE, completion=completion)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
        rows.append((prompt_ids, reply_ids))
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for row, (prompt_ids, reply_ids) in enumerate(rows):
        sequence = prompt_ids + reply_ids
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        labels[row, len(prompt_ids) : len(sequence)] = torch.tensor(reply_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 5e-3:
            break
    assert loss.item() < 5e-3, f"the tiny judge did not learn its replies (loss {loss.item()})"
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


_BUILT: dict[str, Path] = {}


def trained_judge_dir(factory: pytest.TempPathFactory) -> Path:
    """The trained tiny judge, saved once per test session."""
    if "judge" not in _BUILT:
        _BUILT["judge"] = make_trained_judge_dir(factory.mktemp("judge") / "model")
    return _BUILT["judge"]


def tiny_reward_model_dir(factory: pytest.TempPathFactory) -> Path:
    """A tiny random reward model (one output logit), saved once per test session."""
    from reasonctl.models.tiny import make_tiny_reward_model_dir

    if "reward_model" not in _BUILT:
        _BUILT["reward_model"] = make_tiny_reward_model_dir(factory.mktemp("rm") / "model",
                                                            seed=3)
    return _BUILT["reward_model"]


def question(text: str = QUESTION, reference: Any = REFERENCE) -> Sample:
    """A sample asking ``text`` with ``reference`` as its answer."""
    return Sample([Message("user", [ContentPart("text", text=text)])], reference=reference,
                  source=f"q:{text}")
