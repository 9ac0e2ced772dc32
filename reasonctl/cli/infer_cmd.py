"""``reasonctl infer``: stream one completion for a prompt, token by token, to stdout; for a
diffusers pipeline directory (or a LoRA export of one), write a PNG or an mp4 instead."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from reasonctl.cli.common import ConfigOption, SetOption


def infer_command(
    model: Annotated[str, typer.Option("--model", help="Model directory or storage URI.")],
    prompt: Annotated[str, typer.Option("--prompt", help="The user message.")],
    image: Annotated[Path | None, typer.Option("--image", help="An image file.")] = None,
    video: Annotated[Path | None, typer.Option("--video", help="A video file.")] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option("--system-prompt", help="System message (default: data.system_prompt)."),
    ] = None,
    fps: Annotated[
        float | None,
        typer.Option("--fps", min=0.01,
                     help="Video frames sampled per second (default: the model's)."),
    ] = None,
    max_pixels: Annotated[
        int | None,
        typer.Option("--max-pixels", min=1, help="Pixels per image or video frame at most."),
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", min=1, help="Default: eval.max_new_tokens, else "
        "rollout.max_new_tokens (256).")] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", min=0.0, help="Default: eval.temperature (0, greedy).")] = None,
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
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Print the model's answer to ``--prompt`` as it is generated (greedy by default).

    ``--image`` / ``--video`` put the file before the text in the user message; they need a
    vision-language model (e.g. Qwen2.5-VL, Qwen3-VL). ``--config`` reads the run config
    (the rollout engine's section, data.system_prompt and prompt_template, the data
    format's fps and max_pixels, rollout.stop, top_p, top_k and suppress_tokens, eval's
    temperature and max_new_tokens); the flags win over it. Without ``--config``, the
    same settings come from the ``reasonctl_generation.toml`` a training export holds,
    so the answer stops where the run's rollouts stopped. A diffusers pipeline directory
    generates an image or a video for ``--prompt`` instead and writes it to ``--output``.
    """
    from reasonctl.backends.generation_files import generation_settings_file
    from reasonctl.cli import common
    from reasonctl.core.errors import DataError, UsageError
    from reasonctl.core.protocols import StreamsText
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.data.formats.media_options import MediaOptions
    from reasonctl.data.messages import apply_prompt_options
    from reasonctl.diffusion.infer import is_diffusion_model
    from reasonctl.evaluation.scoring import sampling_for_eval
    from reasonctl.evaluation.standalone import load_engine
    from reasonctl.models.loading import resolve_model_dir

    run_config = common.load(config, set_, values={})
    model_dir = resolve_model_dir(model, registry=common.host().registry, config=run_config)
    exported = generation_settings_file(model_dir) if not config else None
    if exported is not None:  # the run's own generation settings, below --set and REASONCTL_*
        run_config = common.load([str(exported)], set_, values={})
    media = run_config.component_config("data", run_config.data.format)
    if isinstance(media, MediaOptions):
        fps = fps if fps is not None else media.fps
        max_pixels = max_pixels if max_pixels is not None else media.max_pixels
    system_prompt = system_prompt if system_prompt is not None else run_config.data.system_prompt
    parts: list[ContentPart] = []
    for kind, path in (("image", image), ("video", video)):
        if path is not None:
            if not path.is_file():
                raise UsageError(f"--{kind} {path}: no such file (cwd: {Path.cwd()})")
            parts.append(ContentPart(kind, path=str(path),  # type: ignore[arg-type]
                                     max_pixels=max_pixels,
                                     fps=fps if kind == "video" else None))
    parts.append(ContentPart("text", text=prompt))
    if is_diffusion_model(model_dir):
        from reasonctl.diffusion.infer import InferOptions, generate

        written = generate(model_dir, prompt, InferOptions(
            height=height, width=width, frames=frames, steps=steps,
            guidance_scale=guidance_scale, seed=seed, output=output))
        sys.stdout.write(f"{written}\n")
        return
    messages = apply_prompt_options([Message("user", parts)], system_prompt or None,
                                    run_config.data.prompt_template)
    engine, processor = load_engine(str(model_dir), run_config, common.host().registry)
    flags = [f"--{kind}" for kind, path in (("image", image), ("video", video)) if path]
    try:
        encoded = processor.encode_prompt(Sample(messages, source="/".join(flags or ["--prompt"])))
    except DataError as exc:  # a file that is no image/video, a prompt over model.max_length
        raise UsageError(str(exc)) from exc
    params = sampling_for_eval(run_config, seed=seed, processor=processor)
    if temperature is not None:
        params.temperature = temperature
    if max_new_tokens is not None:
        params.max_new_tokens = max_new_tokens
    if isinstance(engine, StreamsText):
        pieces: Any = engine.stream(encoded.as_prompt(), params)
    else:
        pieces = [engine.generate([encoded.as_prompt()], params)[0][0].text]
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
