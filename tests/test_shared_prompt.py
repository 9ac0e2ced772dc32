"""Shared-prompt packed rows equal padded rows: log-probs, entropy, loss and gradients.

Each case builds GRPO training rows from prompts of different lengths (video, image and
text prompts mixed for the vision-language models) with completions of different lengths,
and runs them once as padded rows (each repeating its prompt) and once as shared-prompt
micro-batches (each prompt once, several micro-batches under a small token budget), on the
tiny Qwen2, Qwen2.5-VL and Qwen3-VL models. Tolerances: float32 1e-5 relative on
log-probs and 1e-4 on gradients (summation order differs); bfloat16 (log-probs) 5e-2
absolute, as two bfloat16 computations of one sequence differ by rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from data_factories import write_tiny_mp4
from PIL import Image

from reasonctl.algorithms.grpo_loss import PolicyLossSettings, policy_loss
from reasonctl.algorithms.policy_batch import (
    PolicyRow,
    chunked,
    collate_policy_rows,
    shared_prompt_micro_batches,
)
from reasonctl.backends.token_logprobs import TokenLogprobModel
from reasonctl.core.types import Completion, ContentPart, Message, RolloutGroup, Sample
from reasonctl.data.processing import ChatProcessor
from reasonctl.models.shared_prompt import SharedPromptLayout
from reasonctl.models.varlen_attention import varlen_attention_reference


def _load(alias: str) -> tuple[Any, ChatProcessor]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    directory = Path(resolve_tiny_alias(alias))
    auto = AutoModelForCausalLM if alias == "tiny-random" else AutoModelForImageTextToText
    model = auto.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.no_grad():  # larger weights: log-probs that differ by position and context
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(8.0)
    return model, ChatProcessor.from_pretrained(directory, max_length=4096)


def _samples(alias: str, tmp_path: Path) -> list[Sample]:
    texts = ["What is two plus two?", "Name a colour.",
             "Describe in a few words what you would do on a rainy afternoon at home."]
    samples = [Sample([Message("user", [ContentPart("text", text=t)])]) for t in texts]
    if alias == "tiny-random":
        return samples
    clip = write_tiny_mp4(tmp_path / "a.mp4", frames=8, fps=4, size=(64, 48))
    other = write_tiny_mp4(tmp_path / "b.mp4", frames=6, fps=3, size=(40, 72))
    image = tmp_path / "i.png"
    Image.new("RGB", (56, 84), (200, 30, 90)).save(image)
    media = [
        Sample([Message("user", [ContentPart("video", path=str(clip)),
                                 ContentPart("text", text="What moves?")])]),
        Sample([Message("user", [ContentPart("image", path=str(image)),
                                 ContentPart("text", text="Which colour is this image?")])]),
        Sample([Message("user", [ContentPart("video", path=str(other)),
                                 ContentPart("text", text="Count the frames, please.")])]),
    ]
    return [media[0], samples[0], media[1], media[2], samples[2]]


def _rows(processor: ChatProcessor, samples: list[Sample], *, group: int = 3) -> list[PolicyRow]:
    from reasonctl.algorithms.policy_batch import policy_rows

    generator = torch.Generator().manual_seed(1)
    groups = []
    for sample in samples:
        prompt = processor.encode_prompt(sample)
        completions = []
        for _ in range(group):
            length = int(torch.randint(1, 9, (1,), generator=generator))
            ids = torch.randint(10, 200, (length,), generator=generator).tolist()
            completions.append(Completion(text="", token_ids=ids,
                                          logprobs=[-1.0] * length, finish_reason="stop"))
        groups.append(RolloutGroup(sample=sample, prompt_ids=prompt.input_ids,
                                  completions=completions, prompt=prompt))
    advantages = torch.linspace(-1.0, 1.0, sum(len(g.completions) for g in groups)).tolist()
    return policy_rows(groups, advantages)


def _loss(outputs: tuple[torch.Tensor, torch.Tensor | None], batch: dict[str, Any]
          ) -> torch.Tensor:
    logprobs, entropy = outputs
    settings = PolicyLossSettings(max_tokens=16, entropy_bonus=0.01)
    mask = batch["loss_mask"][:, 1:]
    loss, _ = policy_loss(logprobs, (logprobs.detach() - 0.1) * batch["completion_mask"],
                          batch["advantages"], mask, settings, entropy=entropy,
                          num_tokens=64.0, num_sequences=15.0)
    return loss


def _run(policy: TokenLogprobModel, batches: list[tuple[list[PolicyRow], dict[str, Any]]]
         ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-row log-probs and entropy of each row's completion, and the summed gradients."""
    policy.zero_grad(set_to_none=True)
    logprobs, entropy = {}, {}
    for rows, batch in batches:
        outputs = policy(batch, True, 0.9)
        _loss(outputs, batch).backward()
        for i, row in enumerate(rows):
            key = id(row)
            logprobs[key] = outputs[0][i, row.completion_span].detach()
            entropy[key] = outputs[1][i, row.completion_span].detach()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logprobs, entropy, grads


@pytest.mark.parametrize("alias", ["tiny-random", "tiny-random-vl", "tiny-random-qwen3-vl"])
def test_shared_prompt_rows_equal_padded_rows(alias: str, tmp_path: Path) -> None:
    model, processor = _load(alias)
    rows = _rows(processor, _samples(alias, tmp_path))
    policy = TokenLogprobModel(model, chunk_tokens=7)
    padded = [(chunk, collate_policy_rows(chunk, processor.pad_id)) for chunk in chunked(rows, 4)]
    budget = max(r.prompt_len for r in rows) + 12  # several micro-batches, groups split
    shared = shared_prompt_micro_batches(rows, processor.pad_id, budget=budget)
    assert len(shared) > 2
    assert sorted(id(r) for rs, _ in shared for r in rs) == sorted(id(r) for r in rows)
    want_lp, want_ent, want_grad = _run(policy, padded)
    got_lp, got_ent, got_grad = _run(policy, shared)
    for row in rows:
        torch.testing.assert_close(got_lp[id(row)], want_lp[id(row)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_ent[id(row)], want_ent[id(row)], rtol=1e-5, atol=1e-5)
    assert set(got_grad) == set(want_grad)
    for name, grad in want_grad.items():
        torch.testing.assert_close(got_grad[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    vision = [n for n in want_grad if "visual" in n]
    assert (alias == "tiny-random") or vision and any(
        bool(want_grad[n].abs().sum() > 0) for n in vision)


def test_bfloat16_shared_prompt_log_probs_are_as_close_to_float32_as_padded_ones(
        tmp_path: Path) -> None:
    model, processor = _load("tiny-random-vl")
    rows = _rows(processor, _samples("tiny-random-vl", tmp_path))
    padded_batch = collate_policy_rows(rows, processor.pad_id)
    (shared_rows, shared), = shared_prompt_micro_batches(rows, processor.pad_id, budget=10_000)
    assert [id(r) for r in shared_rows] == [id(r) for r in rows]
    mask = padded_batch["completion_mask"].bool()
    with torch.no_grad():
        exact = TokenLogprobModel(model)(padded_batch)[0][mask]
        model.to(torch.bfloat16)
        policy = TokenLogprobModel(model)
        padded_error = (policy(padded_batch)[0][mask] - exact).abs()
        shared_error = (policy(shared)[0][mask] - exact).abs()
    # bfloat16 rounding alone: both layouts stray from float32 by the same order
    assert float(shared_error.mean()) < 1.5 * float(padded_error.mean()) + 1e-3
    assert float(shared_error.max()) < 0.2


def test_layout_places_prompt_keys_before_each_completion() -> None:
    layout = SharedPromptLayout.build([(3, [2, 0, 1]), (2, [1])], width=6)
    assert layout.length == 3 + 3 + 2 + 1
    assert layout.cu_q.tolist() == [0, 3, 5, 6, 8, 9]
    assert layout.cu_k.tolist() == [0, 3, 8, 12, 14, 17]
    assert layout.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 6, 7, 8]
    assert layout.score_index.tolist() == [2, 3, 2, 7]  # each completion's first token: prompt end
    assert layout.target_index.tolist() == [3, 4, 5, 8]
    assert layout.output_rows.tolist() == [0, 0, 2, 3]
    assert layout.output_columns.tolist() == [2, 3, 2, 1]
    assert layout.text_positions().tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]


def test_reference_attention_sees_the_prompt_and_its_own_past_only() -> None:
    torch.manual_seed(0)
    prompt, own = torch.randn(4, 2, 8), torch.randn(3, 2, 8)
    query = torch.cat([prompt, own])[4:]
    keys = torch.cat([prompt, own])
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    out = varlen_attention_reference(query, keys, keys, cu_q, cu_k)
    whole = torch.nn.functional.scaled_dot_product_attention(
        keys.transpose(0, 1), keys.transpose(0, 1), keys.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out, whole.transpose(0, 1)[4:])


def test_micro_batches_split_to_the_count_every_rank_runs(tmp_path: Path) -> None:
    _, processor = _load("tiny-random")
    rows = _rows(processor, _samples("tiny-random", tmp_path), group=4)
    budget = 10_000
    assert len(shared_prompt_micro_batches(rows, processor.pad_id, budget=budget)) == 1
    for count in (2, 3, 5, len(rows)):
        batches = shared_prompt_micro_batches(rows, processor.pad_id, budget=budget,
                                              count=count)
        assert len(batches) == count
        assert sorted(id(r) for rs, _ in batches for r in rs) == sorted(id(r) for r in rows)
    with pytest.raises(ValueError, match="cannot make"):
        shared_prompt_micro_batches(rows, processor.pad_id, budget=budget,
                                    count=len(rows) + 1)


@pytest.mark.parametrize("alias", ["tiny-random-vl", "tiny-random-qwen3-vl"])
def test_vision_tower_through_varlen_attention_equals_its_sdpa_loop(alias: str,
                                                                    tmp_path: Path) -> None:
    from reasonctl.models.varlen_attention import (
        VISION_ATTENTION_NAME,
        enable_vision_varlen_attention,
    )

    model, processor = _load(alias)
    prompt = processor.encode_prompt(_samples(alias, tmp_path)[0])
    pixels, grid = prompt.extras["pixel_values_videos"], prompt.extras["video_grid_thw"]
    base = model.model
    with torch.no_grad():
        want = base.get_video_features(pixels, grid, return_dict=True).pooler_output
        assert enable_vision_varlen_attention(model)
        assert base.visual.config._attn_implementation == VISION_ATTENTION_NAME
        got = base.get_video_features(pixels, grid, return_dict=True).pooler_output
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_resumed_video_grpo_run_equals_the_unbroken_one(tmp_path: Path) -> None:
    """Video GRPO on shared-prompt micro-batches (several a step, groups split by the
    token budget), stopped after its step-2 checkpoint and resumed, equals the unbroken
    run step for step."""
    import importlib.util
    import json

    import reasonctl

    path = Path(__file__).resolve().parents[1] / "examples" / "video_quickstart.py"
    spec = importlib.util.spec_from_file_location("video_quickstart", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = module.write_dataset(tmp_path / "data", clips_per_colour=2, eval_per_colour=0)

    def config(name: str, **train: Any) -> dict[str, Any]:
        return {
            "run": {"output_dir": str(tmp_path / name), "seed": 0},
            "model": {"name_or_path": "tiny-random-vl", "max_length": 256},
            "data": {"format": "jsonl", "jsonl": {"path": str(data / "rl.jsonl"), "fps": 2.0}},
            "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2,
                                                   "update_layout": "shared_prompt",
                                                   "micro_batch_tokens": 150}},
            "rollout": {"n": 4, "max_new_tokens": 4, "temperature": 1.0},
            "train": {"lr": 5e-3, "max_steps": 4, "micro_batch_size": 4, **train},
            "rewards": {"components": [{"name": "choice"}]},
            "backend": {"name": "single", "device": "cpu"},
            "checkpoint": {"export_final": False, "every_steps": 2},
            "logging": {"loggers": ["jsonl"]},
        }

    def metrics(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    reasonctl.run(config("full"))
    reasonctl.run(config("part", max_steps=2))
    resumed = config("part")
    resumed["run"]["resume"] = True
    reasonctl.run(resumed)
    expected, got = metrics("full"), metrics("part")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in ("reward/mean", "loss", "entropy", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5)


def test_update_layout_falls_back_to_padded_rows_where_the_backend_cannot() -> None:
    from reasonctl.algorithms.grpo import GRPO
    from reasonctl.algorithms.grpo_config import GRPOConfig
    from reasonctl.core.errors import ConfigError

    class PaddedOnly:  # a backend without RunsSharedPrompts (e.g. megatron)
        pass

    class SharedCapable:
        def shared_prompt_problem(self) -> str | None:
            return None

    assert not GRPO(GRPOConfig())._choose_shared_prompts(None, PaddedOnly())  # type: ignore[arg-type]
    assert GRPO(GRPOConfig())._choose_shared_prompts(None, SharedCapable())  # type: ignore[arg-type]
    assert not GRPO(GRPOConfig(update_layout="padded"))._choose_shared_prompts(
        None, SharedCapable())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="update_layout = 'shared_prompt'.*PaddedOnly"):
        GRPO(GRPOConfig(update_layout="shared_prompt"))._choose_shared_prompts(
            None, PaddedOnly())  # type: ignore[arg-type]


def test_eager_attention_is_a_reason_for_padded_rows() -> None:
    from reasonctl.models.shared_prompt_attention import shared_prompt_problem

    model, _ = _load("tiny-random")
    assert shared_prompt_problem(model) is None
    model.config._attn_implementation_internal = "eager"
    assert "eager" in (shared_prompt_problem(model) or "")
