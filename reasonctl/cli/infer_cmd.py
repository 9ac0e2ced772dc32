"""``reasonctl infer``: stream one completion for a prompt, token by token, to stdout."""

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
) -> None:
    """Print the model's answer to ``--prompt`` as it is generated (greedy by default).

    ``--image`` / ``--video`` put the file before the text in the user message; they need a
    vision-language model (e.g. Qwen2.5-VL).
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
