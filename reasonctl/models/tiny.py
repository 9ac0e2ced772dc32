"""Tiny random-weight models and a byte-level tokenizer, built offline.

``model.name_or_path = "tiny-random"`` resolves to a Qwen2-shaped model of a few hundred
thousand parameters created here on first use, so the quickstart and tests need no
download. The tokenizer is byte-level (every UTF-8 byte is a token) with Qwen's chat
special tokens and a Qwen-style chat template.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_ALIAS = "tiny-random"
TINY_VERSION = "v1"
TINY_VL_ALIASES = {"tiny-random-vl": "qwen2_5_vl", "tiny-random-qwen3-vl": "qwen3_vl"}
"""Aliases of the tiny vision-language models (:mod:`reasonctl.models.tiny_vl`)."""
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set text.v = text.v + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}"
    "{%- set text.v = text.v + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- elif part['type'] == 'video' -%}"
    "{%- set text.v = text.v + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
    "{%- endif -%}{%- endfor -%}{%- set text = text.v -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def cache_root() -> Path:
    """Where reasonctl caches generated or downloaded models (``REASONCTL_CACHE``)."""
    return Path(os.environ.get("REASONCTL_CACHE", Path.home() / ".cache" / "reasonctl"))


def build_tiny_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` with Qwen chat tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


def tiny_qwen2_config(vocab_size: int, **overrides: Any) -> Any:
    """A Qwen2 config with 2 layers, hidden size 64, GQA (4 heads, 2 KV heads)."""
    from transformers import Qwen2Config

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    values.update(overrides)
    return Qwen2Config(**values)


def make_tiny_model_dir(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a randomly initialised tiny Qwen2 model and its tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model, tokenizer = _random_tiny_qwen2(AutoModelForCausalLM, seed, **config_overrides)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return _save(path, model, tokenizer)


def make_tiny_reward_model_dir(path: str | Path, *, seed: int = 0, num_labels: int = 1) -> Path:
    """Save a randomly initialised tiny Qwen2 sequence-classification model (a reward
    model with ``num_labels`` outputs) and its tokenizer to ``path``."""
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = _random_tiny_qwen2(AutoModelForSequenceClassification, seed,
                                          num_labels=num_labels)
    return _save(path, model, tokenizer)


def _random_tiny_qwen2(model_class: Any, seed: int, **config_overrides: Any) -> tuple[Any, Any]:
    """A tiny Qwen2 ``model_class`` with weights drawn from ``seed`` (the global RNG is left
    as it was), and its tokenizer."""
    import torch

    tokenizer = build_tiny_tokenizer()
    config = tiny_qwen2_config(len(tokenizer), **config_overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class.from_config(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model, tokenizer


def _save(path: str | Path, model: Any, tokenizer: Any) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

