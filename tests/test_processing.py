"""ChatProcessor (templates, assistant-only loss masks, truncation) and collate/packing."""

from __future__ import annotations

import pytest
import torch

from reasonctl.core.errors import DataError
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.data.collate import collate
from reasonctl.data.processing import ChatProcessor, EncodedSample
from reasonctl.models.tiny import build_tiny_tokenizer


def chat(*turns: tuple[str, str], source: str = "rows.jsonl:1") -> Sample:
    return Sample([Message(role, [ContentPart("text", text=text)]) for role, text in turns],
                  source=source)


def target_text(processor: ChatProcessor, encoded: EncodedSample) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, flag in zip(encoded.input_ids, encoded.loss_mask, strict=True):
        if flag and not previous:
            runs.append([])
        if flag:
            runs[-1].append(token)
        previous = flag
    return [processor.decode(run, skip_special_tokens=False) for run in runs]


CONVERSATION = chat(
    ("system", "Be brief."),
    ("user", "What is 2+2?"),
    ("assistant", "4"),
    ("user", "And 3+3?"),
    ("assistant", "It is 6."),
)


def test_multi_turn_mask_covers_only_assistant_content_and_end_token(tiny_tokenizer):
    processor = ChatProcessor(tiny_tokenizer, max_length=512)
    encoded = processor.encode_sft(CONVERSATION)
    assert len(encoded.input_ids) == len(encoded.loss_mask)
    assert target_text(processor, encoded) == ["4<|im_end|>", "It is 6.<|im_end|>"]
    full = processor.decode(encoded.input_ids, skip_special_tokens=False)
    assert full == processor.render(CONVERSATION)
    assert not encoded.truncated


# A template in the style of reasoning models: earlier assistant turns lose their <think>
# block and are stripped, so the full rendering is not an extension of partial renderings.
HISTORY_REWRITING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not loop.last -%}"
    "{%- set c = m.content.split('</think>')[-1].strip() -%}"
    "{%- else -%}{%- set c = m.content -%}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_mask_survives_templates_that_rewrite_history():
    custom = build_tiny_tokenizer()
    custom.chat_template = HISTORY_REWRITING_TEMPLATE
    processor = ChatProcessor(custom, max_length=512)
    sample = chat(
        ("user", "q1"),
        ("assistant", "<think>hmm</think> a1"),
        ("user", "q2"),
        ("assistant", "<think>ok</think>a2"),
    )
    encoded = processor.encode_sft(sample)
    assert target_text(processor, encoded) == ["a1<|im_end|>", "<think>ok</think>a2<|im_end|>"]


def test_system_prompt_is_added_only_when_missing(tiny_tokenizer):
    processor = ChatProcessor(tiny_tokenizer, max_length=512, system_prompt="SYS")
    plain = processor.render(chat(("user", "hi"), ("assistant", "yo")))
    assert plain.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nhi")
    assert "SYS" not in processor.render(CONVERSATION)


def test_truncation_keeps_max_length_tokens_and_flags_it(tiny_tokenizer):
    full = ChatProcessor(tiny_tokenizer, max_length=4096).encode_sft(CONVERSATION)
    limit = full.loss_mask.index(1) + 3  # the first answer keeps three tokens
    cut = ChatProcessor(tiny_tokenizer, max_length=limit).encode_sft(CONVERSATION)
    assert len(full.input_ids) > limit
    assert cut.truncated and len(cut.input_ids) == limit
    assert cut.input_ids == full.input_ids[:limit]
    assert cut.loss_mask == full.loss_mask[:limit]
    # cut before the first answer token: nothing to train on, a bad row naming the sample
    with pytest.raises(DataError, match="answer is cut off"):
        ChatProcessor(tiny_tokenizer, max_length=limit - 3).encode_sft(CONVERSATION)


def test_encode_prompt_drops_answer_and_ends_with_generation_prompt(tiny_tokenizer):
    processor = ChatProcessor(tiny_tokenizer, max_length=512)
    encoded = processor.encode_prompt(CONVERSATION)
    text = processor.decode(encoded.input_ids, skip_special_tokens=False)
    assert text.endswith("And 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert "It is 6." not in text
    assert encoded.num_prompt_tokens == len(encoded.input_ids)
    assert sum(encoded.loss_mask) == 0
    short = ChatProcessor(tiny_tokenizer, max_length=16).encode_prompt(CONVERSATION)
    assert short.truncated and short.input_ids == encoded.input_ids[-16:]


def test_errors_name_the_sample(tiny_tokenizer):
    processor = ChatProcessor(tiny_tokenizer, max_length=512)
    with pytest.raises(DataError, match=r"rows.jsonl:7: no assistant turn"):
        processor.encode_sft(chat(("user", "hi"), source="rows.jsonl:7"))
    image = Sample(
        [Message("user", [ContentPart("image", path="/x.png"), ContentPart("text", text="?")]),
         Message("assistant", [ContentPart("text", text="a cat")])],
        source="rows.jsonl:3",
    )
    with pytest.raises(DataError, match=r"rows.jsonl:3: .*image input.*no image processor"):
        processor.encode_sft(image)


def test_collate_pads_right_and_keeps_masks(tiny_tokenizer):
    a = EncodedSample([1, 2, 3], [0, 1, 1])
    b = EncodedSample([4, 5], [0, 1])
    batch = collate([a, b], pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    packed = collate([a, EncodedSample([4, 5], [1, 1])], pad_id=9, pack=True)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # the first token of the second sample is not a target of the first sample's last token
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0, 1]]
    assert "attention_mask" not in packed


def token_losses(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-target-token negative log-likelihood, in sequence order."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask",
                                                      "position_ids")}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), targets, reduction="none"
    )
    return nll[batch["loss_mask"][:, 1:].bool()]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_batch_loss_equals_unpacked_loss(tiny_tokenizer, tiny_model_dir, attention):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=attention
    ).eval()
    processor = ChatProcessor(tiny_tokenizer, max_length=512)
    samples = [
        processor.encode_sft(CONVERSATION),
        processor.encode_sft(chat(("user", "hello there"), ("assistant", "hi!"))),
        processor.encode_sft(chat(("user", "x"), ("assistant", "a longer answer, twice."))),
    ]
    with torch.no_grad():
        unpacked = token_losses(model, collate(samples, processor.pad_id))
        packed_batch = collate(samples, processor.pad_id, pack=True)
        packed = token_losses(model, packed_batch)
        # Without restarting positions the samples attend to each other: the losses change.
        leaky = dict(packed_batch)
        leaky["position_ids"] = torch.arange(packed_batch["input_ids"].shape[1])[None]
        crossing = token_losses(model, leaky)
    assert packed.shape == unpacked.shape
    assert sum(s.num_loss_tokens for s in samples) == unpacked.numel()
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=0)
    assert abs(packed.sum() - unpacked.sum()) < 1e-4
    assert not torch.allclose(crossing, unpacked, atol=1e-3)


def test_collate_lays_out_per_token_extras_packed_or_not():
    image = EncodedSample(
        [1, 7, 7, 2], [0, 0, 0, 1],
        extras={"pixel_values": torch.ones(8, 3), "image_grid_thw": torch.tensor([[1, 2, 4]]),
                "mm_token_type_ids": torch.tensor([0, 1, 1, 0])},
    )
    text = EncodedSample([1, 2], [0, 1])
    batch = collate([text, image], pad_id=0)
    assert batch["mm_token_type_ids"].tolist() == [[0, 0, 0, 0], [0, 1, 1, 0]]
    assert batch["pixel_values"].shape == (8, 3)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 4]]
    packed = collate([text, image, text], pad_id=0, pack=True)
    assert packed["input_ids"].tolist() == [[1, 2, 1, 7, 7, 2, 1, 2]]
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]
    assert packed["mm_token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0]]
    assert packed["loss_mask"].tolist() == [[0, 1, 0, 0, 0, 1, 0, 1]]
    assert packed["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert packed["pixel_values"].shape == (8, 3)
