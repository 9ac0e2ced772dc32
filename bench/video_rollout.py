"""Rollout throughput with video prompts against the same language model's text prompts.

One job, one model (a random Qwen2.5-VL-7B- or Qwen3-VL-8B-shaped VLM, bf16, the
``single`` backend's module, which the ``hf`` engine shares as in GRPO): ``--prompts``
prompts x ``--n`` completions x ``--new-tokens`` new tokens at temperature 1, the
reserved tokens suppressed as in a run.

- video: each prompt is a clip (8 frames of 448x448 sampled at 2 fps, about 1k vision
  tokens) and a 64-word question, encoded by the run's processor from a JSONL data file;
- text: prompts of random words with the same token counts as the video prompts, so the
  two rollouts differ only in the vision inputs (the vision tower in the prefill and the
  multimodal rotary positions).

Each side warms up twice untimed (graph capture), then runs ``--repeats`` times (median);
tokens/s counts generated tokens over wall time. Also reported: which decode path ran,
greedy parity of the video prompts with ``generate`` (``--parity-prompts`` prompts,
``--parity-tokens`` tokens), the log-prob gap of sampled video completions against the
trainer's recomputation (``backend.token_outputs``), each side's log-prob gap against a
plain forward pass of the full sequence without autocast (float32 weights:
``engine_vs_float32``, ``trainer_vs_float32``, which tell which side strays), and peak GPU
memory.

    python -m bench.video_rollout --model qwen2_5_vl
    python -m bench.video_rollout --model qwen3_vl
    python -m bench.video_rollout --model qwen3_vl --size tiny     # CPU smoke run

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    build_rollout_engine,
    emit,
    environment,
    free_memory,
    log,
    now,
    peak_memory_gb,
    random_rows,
    reasonctl_backend,
    tokenizer_dir,
)
from bench.video_common import MODELS, build_vl_model_dir, data_values, video_rows, write_clips


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_vl", choices=MODELS)
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parity-prompts", type=int, default=2)
    parser.add_argument("--parity-tokens", type=int, default=32)
    parser.add_argument("--decode", default="static", choices=["static", "dynamic"])
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="rollout.hf.fused_kernels = false (the stock decode step).")
    parser.add_argument("--skip-text", action="store_true", help="Video prompts only.")
    parser.add_argument("--out", default="/tmp/reasonctl-bench")
    return parser.parse_args()


def setup(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """The backend, run context (processor and engine composed as a run composes them) and
    the encoded video prompts."""
    from reasonctl.runtime.composition import build_dataset, build_processor

    out = Path(args.out)
    model_dir = build_vl_model_dir(out / "models", args.model, args.size)
    clips = write_clips(out / "clips", args.prompts, args.size)
    data = out / "run" / "video_rollout" / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in video_rows(clips, args.prompts)))
    backend, ctx = reasonctl_backend(model_dir, data.parent, values={
        "model": {"max_length": 8192, "tokenizer": str(tokenizer_dir(model_dir))},
        "data": data_values(data, args.size),
        "rollout": {"engine": "hf", "n": args.n, "temperature": 1.0,
                    "max_new_tokens": args.new_tokens,
                    "hf": {"decode": args.decode, "max_batch_size": args.prompts * args.n,
                           "fused_kernels": not args.no_fused_kernels}},
    })
    ctx.processor = build_processor(ctx)
    ctx.engine = build_rollout_engine(ctx)
    dataset = build_dataset(ctx)
    encoded = [ctx.processor.encode_prompt(dataset[i]) for i in range(len(dataset))]
    return backend, ctx, encoded


def timed_rollouts(engine: Any, prompts: list[dict[str, Any]], params: Any, repeats: int
                   ) -> tuple[float, list[Any]]:
    """Median tokens/s over ``repeats`` rollouts after two untimed ones; the last groups."""
    groups: list[Any] = []
    for _ in range(2):
        engine.generate(prompts, params)
    rates = []
    for _ in range(repeats):
        started = now()
        groups = engine.generate(prompts, params)
        seconds = now() - started
        rates.append(sum(len(c.token_ids) for g in groups for c in g) / seconds)
    return statistics.median(rates), groups


def greedy_parity(backend: Any, engine: Any, encoded: list[Any], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """The engine's greedy tokens against ``generate(do_sample=False)`` per prompt, under
    the backend's autocast as the engine runs (compute dtype on both sides)."""
    model = backend.hf_model
    from reasonctl.core.types import SamplingParams

    prompts = encoded[: args.parity_prompts]
    groups = engine.generate([e.as_prompt() for e in prompts],
                             SamplingParams(temperature=0.0, max_new_tokens=args.parity_tokens))
    same, first_difference = 0, []
    for prompt, group in zip(prompts, groups, strict=True):
        inputs: dict[str, Any] = {"input_ids": torch.tensor([prompt.input_ids])}
        for key, value in prompt.extras.items():
            inputs[key] = value.view(1, -1) if key == "mm_token_type_ids" else value
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad(), backend.autocast():
            out = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                                 max_new_tokens=args.parity_tokens, do_sample=False)
        reference = out[0, len(prompt.input_ids):].tolist()
        ours = group[0].token_ids
        same += ours == reference[: len(ours)]
        first_difference.append(next((i for i, (a, b) in enumerate(zip(ours, reference,
                                                                         strict=False))
                                      if a != b), None))
    return {"identical": same, "of": len(prompts), "first_difference": first_difference}


def logprob_gap(backend: Any, processor: Any, encoded: list[Any], groups: list[Any]
                ) -> dict[str, float]:
    """The largest log-prob differences of the sampled video completions (first
    completion of each prompt): engine vs trainer (``backend.token_outputs``, the
    ``gap``), and each of them vs a plain forward pass of the full sequence without
    autocast (the float32 weights the backend keeps: ``engine_vs_float32`` and
    ``trainer_vs_float32``), which says which side strays from the model."""
    from reasonctl.data.collate import collate_shared_media
    from reasonctl.data.processing import EncodedSample

    model = backend.hf_model
    device = next(model.parameters()).device
    out = {"gap": 0.0, "engine_vs_float32": 0.0, "trainer_vs_float32": 0.0}
    for prompt, group in zip(encoded, groups, strict=True):
        completion = group[0]
        count = len(completion.token_ids)
        extras = dict(prompt.extras)
        types = extras.get("mm_token_type_ids")
        if types is not None:
            extras["mm_token_type_ids"] = torch.cat([types, types.new_zeros(count)])
        ids = prompt.input_ids + completion.token_ids
        row = EncodedSample(ids, [0] * len(prompt.input_ids) + [1] * count, extras)
        span = slice(len(prompt.input_ids) - 1, len(prompt.input_ids) - 1 + count)
        engine = torch.tensor(completion.logprobs)
        trainer = backend.token_outputs(collate_shared_media([row], processor.pad_id)
                                        ).logprobs[0, span].float().cpu()
        inputs: dict[str, Any] = {"input_ids": torch.tensor([ids]),
                                  "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        for key, value in extras.items():
            inputs[key] = value.view(1, -1) if key == "mm_token_type_ids" else value
        with torch.no_grad():
            hidden = backend_decoder(model)(**{k: v.to(device) for k, v in inputs.items()}
                                            ).last_hidden_state[0, span]
            logits = model.get_output_embeddings()(hidden).float()
            target = torch.tensor(ids[1:], device=device)[span].view(-1, 1)
            exact = logits.log_softmax(-1).gather(-1, target).view(-1).cpu()
        out["gap"] = max(out["gap"], float((trainer - engine).abs().max()))
        out["engine_vs_float32"] = max(out["engine_vs_float32"],
                                       float((engine - exact).abs().max()))
        out["trainer_vs_float32"] = max(out["trainer_vs_float32"],
                                        float((trainer - exact).abs().max()))
    return out


def backend_decoder(model: Any) -> Any:
    """The model's base module (hidden states without the output head's full logits)."""
    from reasonctl.backends.token_logprobs import decoder_of

    return decoder_of(model)


def main() -> None:
    """Video and text rollouts of the same model in one job; print the comparison."""
    from reasonctl.algorithms.rollouts import sampling_params

    args = parse_args()
    backend, ctx, encoded = setup(args)
    engine, processor = ctx.engine, ctx.processor
    params = sampling_params(ctx.config, seed=0, processor=processor)
    video_prompts = [e.as_prompt() for e in encoded]
    words = random_rows(len(encoded), max(len(e.input_ids) for e in encoded), seed=5)
    text_prompts = [{"input_ids": words[i][: len(e.input_ids)]} for i, e in enumerate(encoded)]
    summary: dict[str, Any] = {
        "bench": "video_rollout", "model": args.model, "size": args.size,
        "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
        "prompt_tokens": statistics.fmean(len(e.input_ids) for e in encoded),
        "video_tokens": statistics.fmean(
            int((e.extras["mm_token_type_ids"] == 2).sum()) for e in encoded),
        **environment(),
    }
    free_memory()
    text_rate = 0.0
    if not args.skip_text:
        from reasonctl.data.processing import EncodedSample

        log("--- text prompts")
        text_rate, text_groups = timed_rollouts(engine, text_prompts, params, args.repeats)
        summary["text_tokens_per_s"] = text_rate
        summary["text_decode"] = engine.last_stats.decode
        log(f"text: {text_rate:.0f} tokens/s ({engine.last_stats.decode})")
        text_gaps = logprob_gap(
            backend, processor,
            [EncodedSample(list(p["input_ids"]), [0] * len(p["input_ids"]), {})
             for p in text_prompts], text_groups)
        summary["text_logprob_gap"] = text_gaps.pop("gap")
        summary.update({f"text_{k}": v for k, v in text_gaps.items()})
    log("--- video prompts")
    video_rate, groups = timed_rollouts(engine, video_prompts, params, args.repeats)
    summary["video_tokens_per_s"] = video_rate
    summary["video_decode"] = engine.last_stats.decode
    summary["video_over_text"] = video_rate / text_rate if text_rate else None
    summary["peak_mem_gb"] = peak_memory_gb()
    ratio = summary["video_over_text"]
    log(f"video: {video_rate:.0f} tokens/s ({engine.last_stats.decode})"
        + (f", {ratio:.2f} of text" if ratio is not None else ""))
    summary["greedy_parity"] = greedy_parity(backend, engine, encoded, args)
    gaps = logprob_gap(backend, processor, encoded, groups)
    summary["logprob_gap"] = gaps.pop("gap")
    summary.update(gaps)
    backend.close()
    emit(summary)


if __name__ == "__main__":
    main()
