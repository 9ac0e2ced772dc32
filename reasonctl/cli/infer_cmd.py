"""``reasonctl infer``: stream one completion for a prompt, token by token, to stdout; for a
diffusers pipeline directory (or a LoRA export of one), write a PNG or an mp4 instead."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer


def infer_command(
    model: Annotated[str, typer.Option("--model", help="Model directory or storage URI.")],
    prompt: Annotated[str, typer.Option("--prompt", help="The user message.")],
    image: Annotated[Path | None, typer.Option("--image", help="An image file.")] = None,
    video: Annotated[Path | None, typer.Option("--video", help="A video file.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 256,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0)] = 0.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    output: Annotated[Path, typer.Option("--output", help="Diffusion models: the file to "
                                         "write (.png for images, .mp4 for videos).")
                      ] = Path("sample.png"),
    height: Annotated[int, typer.Option("--height", min=1, help="Diffusion models.")] = 480,
    width: Annotated[int, typer.Option("--width", min=1, help="Diffusion models.")] = 832,
    frames: Annotated[int | None, typer.Option("--frames", min=1, help="Diffusion video "
                                               "models (4k + 1; default 33).")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Diffusion models: "
                                       "denoising steps.")] = 30,
    guidance_scale: Annotated[float, typer.Option("--guidance-scale", min=1.0,
                                                  help="Diffusion models: CFG (1 = off).")
                              ] = 1.0,
) -> None:
    """Print the model's answer to ``--prompt`` as it is generated (greedy by default).

    ``--image`` / ``--video`` put the file before the text in the user message; they need a
    vision-language model (e.g. Qwen2.5-VL). A diffusers pipeline directory generates an
    image or a video for ``--prompt`` instead and writes it to ``--output``.
    """
    from reasonctl.cli import common
    from reasonctl.core.errors import DataError
    from reasonctl.core.protocols import StreamsText
    from reasonctl.core.types import ContentPart, Message, Sample, SamplingParams
    from reasonctl.evaluation.standalone import load_engine

    parts: list[ContentPart] = []
    for kind, path in (("image", image), ("video", video)):
        if path is not None:
            if not path.is_file():
                raise DataError(f"--{kind} {path}: no such file (cwd: {Path.cwd()})")
            parts.append(ContentPart(kind, path=str(path)))  # type: ignore[arg-type]
    parts.append(ContentPart("text", text=prompt))
    run_config = common.load(None, None, values={})
    diffusion = _diffusion_model_dir(model, run_config)
    if diffusion is not None:
        from reasonctl.diffusion.infer import InferOptions, generate

        written = generate(diffusion, prompt, InferOptions(
            height=height, width=width, frames=frames, steps=steps,
            guidance_scale=guidance_scale, seed=seed, output=output))
        sys.stdout.write(f"{written}\n")
        return
    engine, processor = load_engine(model, run_config, common.host().registry)
    encoded = processor.encode_prompt(Sample([Message("user", parts)], source="--prompt"))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    if isinstance(engine, StreamsText):
        pieces: Any = engine.stream(encoded.as_prompt(), params)
    else:
        pieces = [engine.generate([encoded.as_prompt()], params)[0][0].text]
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _diffusion_model_dir(model: str, run_config: Any) -> Path | None:
    """The local directory of ``model`` when it is a diffusion pipeline (or its LoRA)."""
    from reasonctl.cli import common
    from reasonctl.diffusion.infer import is_diffusion_model
    from reasonctl.models.loading import resolve_model_dir

    if model == "tiny-random":
        return None
    directory = resolve_model_dir(model, registry=common.host().registry, config=run_config)
    return directory if is_diffusion_model(directory) else None
