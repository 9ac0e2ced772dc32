"""The recipes of ``examples/recipes/`` for a few steps at the real shape with random weights:
step time and peak memory of each layout, through ``reasonctl run`` as users start it.

The recipe's own files run unchanged (``--config recipe.toml --config layout.toml``), in a
working directory laid out as ``docs/recipes/`` says, except for what a benchmark cannot
download: the model is a random-weight one built from ``examples/recipes/shapes/`` (the real
architecture's ``config.json``; the word-level tokenizer of :mod:`bench.common`, with Qwen's
chat and vision tokens, whose ids the config takes), and the data are random stand-ins in
the recipe's layout (GSM8K parquet rows, Cosmos-Reason1 SFT and RL rows of a local Hub
snapshot with noise clips, a prompt list). A last config file sets the step count and turns
checkpoints and the export off; for Cosmos-Predict2.5 the served reward is scored in the
trainer (no service round trip) and the prompts carry random precomputed text embeddings
(the pipeline's 7B text encoder is not built). ``--size tiny`` scales every model down and
the workload with it, so the script runs on a CPU.

    python -m bench.recipes --recipe qwen2_5_7b_math --layout grpo --nproc 8
    python -m bench.recipes --recipe cosmos_reason1 --layout grpo+grpo_one_gpu
    python -m bench.recipes --all --size tiny          # CPU smoke: every one-process layout

The last line printed is a JSON summary: per run the mean ``step_time_s`` after
``--warmup`` steps and the largest ``peak_mem_gb`` of any step (0 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, environment, free_memory, log, now, random_rows, words

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "recipes"
SHAPES = RECIPES / "shapes"
MODELS = {  # where the recipe reads its model, and the shape standing in for it
    "qwen2_5_7b_math": {"models/Qwen2.5-7B-Instruct": "qwen2_5_7b_instruct"},
    "cosmos_reason1": {"models/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl_7b_instruct",
                       "outputs/cosmos_reason1_sft/export/final": "qwen2_5_vl_7b_instruct"},
    "cosmos_reason2": {"models/Qwen3-VL-8B-Instruct": "qwen3_vl_8b_instruct",
                       "outputs/cosmos_reason2_sft/export/final": "qwen3_vl_8b_instruct"},
    "cosmos_predict2_5": {"models/Cosmos-Predict2.5-2B-diffusers": "cosmos_predict2_5_2b"},
}
LAYOUTS = {  # layout -> processes it runs on (GPUs)
    "qwen2_5_7b_math": {"grpo": 8, "grpo+one_gpu": 1, "grpo+megatron": 8, "grpo+separate": 4},
    **{recipe: {"sft": 8, "sft+sft_one_gpu": 1, "grpo": 8, "grpo+grpo_one_gpu": 1,
                "grpo+grpo_separate": 4} for recipe in ("cosmos_reason1", "cosmos_reason2")},
    "cosmos_predict2_5": {"flow_grpo": 8, "flow_grpo+one_gpu": 1},
}
TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(LAYOUTS))
    parser.add_argument("--layout", help="Recipe files joined by '+', e.g. grpo+one_gpu.")
    parser.add_argument("--all", action="store_true",
                        help="Every recipe's one-process layouts (with --nproc, those too).")
    parser.add_argument("--size", default="real", choices=["real", "tiny"])
    parser.add_argument("--nproc", type=int, default=0,
                        help="Processes of a multi-GPU layout (default: the layout's own).")
    parser.add_argument("--steps", type=int, default=4, help="Steps, warm-up included.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="/tmp/reasonctl-bench-recipes")
    args = parser.parse_args()
    if not args.all and not (args.recipe and args.layout):
        parser.error("give --recipe and --layout, or --all")
    return args


# --- models ---------------------------------------------------------------------------------


def word_tokenizer(vision: bool) -> Any:
    """The word-level tokenizer: ``w<i>`` is id ``i``, then Qwen's chat (and vision) tokens."""
    from bench import common, video_common

    if vision:
        return video_common.build_tokenizer()
    return common.build_tokenizer()


def shape_config(shape: str, size: str, tokenizer: Any) -> Any:
    """The shape's config with the tokenizer's special ids (``tiny``: small sizes)."""
    from transformers import AutoConfig

    values = json.loads((SHAPES / shape / "config.json").read_text())
    text = values.get("text_config", values)
    text.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None)
    if "vision_config" in values:
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"),
                           ("vision_end_token_id", "<|vision_end|>")):
            values[key] = int(tokenizer.convert_tokens_to_ids(token))
    if size == "tiny":
        text.update(TINY_TEXT, max_window_layers=2)
        if "head_dim" in text:
            text["head_dim"] = 16
        rope = text.get("rope_scaling") or {}
        if "mrope_section" in rope:
            rope["mrope_section"] = [2, 3, 3]
        vision = values.get("vision_config")
        if vision is not None:
            vision.update(TINY_VISION, out_hidden_size=text["hidden_size"])
            if "fullatt_block_indexes" in vision:
                vision["fullatt_block_indexes"] = [1]
            if "deepstack_visual_indexes" in vision:
                vision.update(deepstack_visual_indexes=[0], num_position_embeddings=64)
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def build_language_model(target: Path, shape: str, size: str) -> None:
    """A random-weight (seed 0, bfloat16) model of ``shape``, its tokenizer (and processor
    settings) in ``tokenizer/``."""
    from transformers import AutoModelForCausalLM

    from reasonctl.models.loading import auto_model_class

    vision = (SHAPES / shape / "preprocessor_config.json").is_file()
    tokenizer = word_tokenizer(vision)
    config = shape_config(shape, size, tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cls = auto_model_class(config) if vision else AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target / "tokenizer")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        if (SHAPES / shape / name).is_file():
            shutil.copy(SHAPES / shape / name, target / "tokenizer" / name)
    del model
    free_memory()


def build_pipeline(target: Path, size: str) -> None:
    """Cosmos-Predict2.5: the 2B transformer of the shape, random, with the Wan2.1 VAE's real
    shape and no text encoder (prompts carry embeddings); ``tiny``: the tiny pipeline."""
    if size == "tiny":
        from reasonctl.diffusion.tiny import make_tiny_pipeline_dir

        make_tiny_pipeline_dir(target, "cosmos")
        return
    import diffusers
    from diffusers import (
        AutoencoderKLWan,
        CosmosTransformer3DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    torch.manual_seed(0)
    config = CosmosTransformer3DModel.load_config(SHAPES / "cosmos_predict2_5_2b" / "transformer")
    components = {"transformer": CosmosTransformer3DModel.from_config(config).to(torch.bfloat16),
                  "vae": AutoencoderKLWan().to(torch.bfloat16),
                  "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0)}
    index: dict[str, Any] = {"_class_name": "Cosmos2_5_PredictBasePipeline",
                             "_diffusers_version": diffusers.__version__,
                             "text_encoder": [None, None], "tokenizer": [None, None]}
    for name, component in components.items():
        index[name] = ["diffusers", type(component).__name__]
        component.save_pretrained(target / name)
    (target / "model_index.json").write_text(json.dumps(index, indent=2))
    free_memory()


def model_dir(cache: Path, shape: str, size: str) -> Path:
    """The random model of ``shape`` (built once per size, then reused)."""
    target = cache / f"{shape}-{size}"
    if (target / "config.json").is_file() or (target / "model_index.json").is_file():
        return target
    log(f"building random {shape} ({size}) in {target}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if shape == "cosmos_predict2_5_2b":
        build_pipeline(tmp, size)
    else:
        build_language_model(tmp, shape, size)
    tmp.rename(target)
    return target


# --- data in the recipes' layouts -------------------------------------------------------------


def write_text_data(work: Path, rows: int) -> None:
    """GSM8K-shaped parquet: a ~100-word question, a worked answer ending in ``#### N``."""
    import pandas as pd

    questions = random_rows(rows, 100, seed=1)
    path = work / "data" / "gsm8k" / "main" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"question": [words(q) for q in questions],
                  "answer": [f"{words(q[:20])} #### {i}" for i, q in enumerate(questions)]}
                 ).to_parquet(path)


def write_video_data(work: Path, rows: int, size: str) -> None:
    """Local snapshots of the Cosmos-Reason1 SFT and RL layouts: a ``robovqa`` config whose
    split (``understanding``, ``rl``) is a parquet file, clips under the subset folder."""
    import pandas as pd

    from bench.video_common import write_clips

    questions = random_rows(rows, 64, seed=3)
    for name, split in (("cosmos_reason1_sft", "understanding"), ("cosmos_reason1_rl", "rl")):
        root = work / "data" / name
        clips = write_clips(root / "robovqa" / "clips", 4, "tiny" if size == "tiny" else "full")
        videos = [f"clips/{clips[i % len(clips)].name}" for i in range(rows)]
        if split == "rl":
            table = {"video": videos, "qa_pairs": [json.dumps({
                "question": words(q), "index2ans": {"A": "w1 w2", "B": "w3 w4", "C": "w5"},
                "answer": "ABC"[i % 3]}) for i, q in enumerate(questions)]}
        else:
            table = {"video": videos, "conversations": [json.dumps([
                {"role": "user", "content": words(q)},
                {"role": "assistant", "content": f"<think>{words(q[:48])}</think>"
                                                 f"<answer>{words(q[:8])}</answer>"}])
                for q in questions]}
        pd.DataFrame(table).to_parquet(root / "robovqa" / f"{split}.parquet")
        (root / "README.md").write_text(
            f"---\nconfigs:\n- config_name: robovqa\n  data_files:\n  - split: {split}\n"
            f"    path: robovqa/{split}.parquet\n---\n")


def write_prompts(work: Path, rows: int, pipeline: Path, size: str) -> None:
    """Prompts, each with random precomputed text embeddings at the model's width."""
    from safetensors.torch import save_file

    from reasonctl.diffusion.adapters import adapter_for

    path = work / "data" / "predict_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if size == "tiny":  # the tiny pipeline has its own text encoder
        path.write_text("".join(json.dumps({"prompt": f"scene {i}"}) + "\n" for i in range(rows)))
        return
    width, _ = adapter_for(pipeline).text_dims()
    embedding = work / "data" / "prompt_embeds.safetensors"
    generator = torch.Generator().manual_seed(1)
    save_file({"prompt_embeds": torch.randn(512, width, generator=generator)
               .to(torch.bfloat16)}, str(embedding))
    path.write_text("".join(json.dumps({"prompt": f"scene {i}", "meta": {
        "text_embedding": str(embedding)}}) + "\n" for i in range(rows)))


# --- a run ------------------------------------------------------------------------------------


def bench_overrides(recipe: str, algorithm: str, size: str, steps: int,
                    processes: int) -> dict[str, Any]:
    """The last config file: steps, no checkpoints or export, metrics only; for ``tiny``, a
    workload a CPU runs in seconds."""
    values: dict[str, Any] = {
        "train": {"max_steps": steps},
        "checkpoint": {"every_steps": 0, "export_final": False},
        "logging": {"loggers": ["jsonl"], "plot": False},
    }
    if recipe == "cosmos_predict2_5":
        values["rewards"] = {"components": [{"name": "brightness", "target": 0.45}]}
    else:
        values["model"] = {"tokenizer": f"{next(iter(MODELS[recipe]))}/tokenizer"}
    if size != "tiny":
        return values
    values["backend"] = {"device": "cpu"}
    if algorithm == "flow_grpo":
        values["algorithm"] = {"flow_grpo": {
            "prompts_per_step": processes, "height": 32, "width": 32, "frames": 5,
            "sample_steps": 4, "eval_steps": 4, "guidance_scale": 1.0, "max_text_tokens": 16}}
        values["rollout"] = {"n": 2}
        values["train"]["micro_batch_size"] = 2
        return values
    values["model"]["max_length"] = 1024
    values["train"].update(micro_batch_size=2)
    if algorithm == "grpo":
        values["algorithm"] = {"grpo": {"prompts_per_step": 2 * processes}}
        values["rollout"] = {"n": 2, "max_new_tokens": 8, "hf": {"max_batch_size": 8}}
    else:
        values["train"]["global_batch_size"] = 2 * processes
    return values


def run_layout(recipe: str, layout: str, args: argparse.Namespace, cache: Path
               ) -> dict[str, Any]:
    """One layout of one recipe through ``reasonctl run``; its step time and peak memory."""
    import tomli_w

    files = layout.split("+")
    processes = args.nproc or LAYOUTS[recipe][layout]
    work = Path(args.out) / args.size / recipe / layout
    shutil.rmtree(work / "outputs", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for target, shape in MODELS[recipe].items():
        link = work / target
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(model_dir(cache, shape, args.size), target_is_directory=True)
    rows = 64 * max(args.steps, 1)
    if recipe == "qwen2_5_7b_math":
        write_text_data(work, rows)
    elif recipe == "cosmos_predict2_5":
        write_prompts(work, rows, work / next(iter(MODELS[recipe])), args.size)
    else:
        write_video_data(work, rows, args.size)
    algorithm = {"sft": "sft", "grpo": "grpo", "flow_grpo": "flow_grpo"}[files[0]]
    overrides = bench_overrides(recipe, algorithm, args.size, args.steps, processes)
    (work / "bench.toml").write_text(tomli_w.dumps(overrides))
    command = [sys.executable, "-m", "reasonctl", "run"]
    for name in files:
        command += ["--config", str(RECIPES / recipe / f"{name}.toml")]
    command += ["--config", str(work / "bench.toml")]
    if processes > 1:
        command += ["--nproc-per-node", str(processes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    log(f"{recipe} {layout} ({args.size}, {processes} process(es)): {' '.join(command)}")
    started = now()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = round(now() - started, 1)
    result: dict[str, Any] = {"recipe": recipe, "layout": layout, "size": args.size,
                              "processes": processes, "wall_s": wall, "ok": done.returncode == 0}
    if done.returncode:
        log(done.stderr[-4000:])
        return {**result, "rc": done.returncode}
    run_dir = next((work / "outputs").glob("*/metrics.jsonl")).parent
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in metrics if m["step"] > args.warmup] or metrics
    result["step_time_s"] = round(sum(m["step_time_s"] for m in timed) / len(timed), 3)
    result["peak_mem_gb"] = round(max(m.get("peak_mem_gb", 0.0) for m in metrics), 2)
    result["steps"] = len(metrics)
    return result


def main() -> None:
    """Run the chosen layouts and print one JSON summary."""
    args = parse_args()
    cache = Path(args.out) / "models"
    cache.mkdir(parents=True, exist_ok=True)
    if args.all:
        chosen = [(recipe, layout) for recipe, layouts in LAYOUTS.items()
                  for layout, processes in layouts.items() if processes == 1 or args.nproc]
        chosen = [(r, lay) for r, lay in chosen if "separate" not in lay
                  and "megatron" not in lay] if args.size == "tiny" else chosen
    else:
        if args.layout not in LAYOUTS[args.recipe]:
            raise SystemExit(f"--layout {args.layout!r}: {args.recipe} has "
                             f"{', '.join(LAYOUTS[args.recipe])}")
        chosen = [(args.recipe, args.layout)]
    runs = [run_layout(recipe, layout, args, cache) for recipe, layout in chosen]
    emit({"benchmark": "recipes", "environment": environment(), "runs": runs})


if __name__ == "__main__":
    main()
