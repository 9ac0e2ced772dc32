"""Diffusion data: the ``video_text`` and ``mock_media`` formats, precomputed embeddings,
bad inputs named as ``file: reason`` (or skipped and counted), media I/O and inference."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from reasonctl.core.errors import DataError
from reasonctl.diffusion.conditioning import (
    TEXT_EMBEDDING,
    TextConditioner,
    embedding_path,
    load_frames,
    media_path,
    prompt_text,
)
from reasonctl.diffusion.datasets import (
    MockMediaConfig,
    VideoTextConfig,
    build_mock_media_dataset,
    build_video_text_dataset,
)
from reasonctl.testing import run_context
from tests.diffusion_support import tiny_pipelines, write_video_text  # noqa: F401


def _dataset(root: Path, on_bad_row: str = "error", **options: Any) -> Any:
    ctx = run_context({"data": {"format": "video_text", "on_bad_row": on_bad_row}})
    return build_video_text_dataset(VideoTextConfig(root=str(root), **options), ctx=ctx)


def test_video_text_pairs_clips_with_captions_and_embeddings(tmp_path: Path) -> None:
    root = write_video_text(tmp_path / "data", {"a": "a bright room", "b": "snow"})
    (root / "text_embeddings").mkdir()
    save_file({"prompt_embeds": torch.zeros(7, 32)},
              str(root / "text_embeddings" / "a.safetensors"))
    dataset = _dataset(root)
    assert len(dataset) == 2
    first, second = dataset[0], dataset[1]
    assert prompt_text(first) == "a bright room" and prompt_text(second) == "snow"
    assert media_path(first) == str(root / "videos" / "a.mp4")
    assert embedding_path(first) == str(root / "text_embeddings" / "a.safetensors")
    assert embedding_path(second) is None and first.meta["id"] == "a"
    clip = load_frames([first], frames=5, height=16, width=24, what="test")
    assert clip.shape == (1, 5, 16, 24, 3) and clip.dtype == torch.uint8
    assert abs(float(clip.float().mean()) - 220) < 4


def test_bad_rows_are_named_or_skipped_and_counted(tmp_path: Path) -> None:
    root = write_video_text(tmp_path / "data", {"good": "fine", "nometa": "x", "broken": "y",
                                                "shape": "z"})
    (root / "metas" / "nometa.txt").unlink()
    (root / "videos" / "broken.mp4").write_bytes(b"not a video at all")
    (root / "text_embeddings").mkdir()
    save_file({"prompt_embeds": torch.zeros(1, 2, 3, 4)},
              str(root / "text_embeddings" / "shape.safetensors"))
    with pytest.raises(DataError) as error:
        _dataset(root)
    assert str(root / "videos" / "broken.mp4") in str(error.value)
    assert "unreadable video" in str(error.value)
    dataset = _dataset(root, on_bad_row="skip")
    assert [s.meta["id"] for s in dataset.samples] == ["good"]
    assert dataset.skipped_rows == 3
    problems = {}
    for stem in ("nometa", "shape"):
        clean = write_video_text(tmp_path / stem, {stem: "c"})
        if stem == "nometa":
            (clean / "metas" / "nometa.txt").unlink()
        else:
            (clean / "text_embeddings").mkdir()
            save_file({"prompt_embeds": torch.zeros(1, 2, 3, 4)},
                      str(clean / "text_embeddings" / "shape.safetensors"))
        with pytest.raises(DataError) as error:
            _dataset(clean)
        problems[stem] = str(error.value)
    assert f"no caption file {tmp_path / 'nometa' / 'metas' / 'nometa.txt'}" in problems["nometa"]
    assert str(tmp_path / "shape" / "text_embeddings" / "shape.safetensors") in problems["shape"]
    assert "prompt_embeds has shape [1, 2, 3, 4]" in problems["shape"]


def test_pickled_embeddings_need_allow_pickle(tmp_path: Path,
                                              tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from reasonctl.diffusion.adapters import adapter_for

    root = write_video_text(tmp_path / "data", {"a": "caption"})
    (root / "t5_xxl").mkdir()
    with (root / "t5_xxl" / "a.pickle").open("wb") as handle:
        pickle.dump([np.ones((5, 32), dtype=np.float32)], handle)  # cosmos-rl's layout
    with pytest.raises(DataError, match="allow_pickle = true"):
        _dataset(root, embeddings_dir="t5_xxl")
    sample = _dataset(root, embeddings_dir="t5_xxl", allow_pickle=True)[0]
    adapter = adapter_for(tiny_pipelines["wan"])
    refusing = TextConditioner(adapter, device=torch.device("cpu"), dtype=torch.float32,
                               max_tokens=8)
    with pytest.raises(DataError, match="pickled text embeddings run code"):
        refusing.for_samples([sample])
    allowed = TextConditioner(adapter, device=torch.device("cpu"), dtype=torch.float32,
                              max_tokens=8, allow_pickle=True)
    assert allowed.for_samples([sample]).embeds.shape == (1, 5, 32)


def test_embeddings_of_another_model_are_rejected_by_file(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.diffusion.adapters import adapter_for

    good, wide = tmp_path / "good.safetensors", tmp_path / "wide.safetensors"
    save_file({"prompt_embeds": torch.ones(6, 64), "pooled_prompt_embeds": torch.ones(64)},
              str(good))
    save_file({"prompt_embeds": torch.ones(6, 4096)}, str(wide))
    conditioner = TextConditioner(adapter_for(tiny_pipelines["sd3"]), device=torch.device("cpu"),
                                  dtype=torch.float32, max_tokens=8)

    def sample(path: Path | None, text: str = "a cat") -> Sample:
        meta = {TEXT_EMBEDDING: str(path)} if path else {}
        return Sample([Message("user", [ContentPart("text", text=text)])], meta=meta)

    mixed = conditioner.for_samples([sample(good), sample(None)])
    assert mixed.embeds.shape == (2, 77 + 8, 64) and mixed.pooled.shape == (2, 64)
    assert torch.equal(mixed.embeds[0, :6], torch.ones(6, 64))
    with pytest.raises(DataError) as error:
        conditioner.for_samples([sample(wide)])
    assert str(error.value).startswith(f"{wide}: prompt_embeds has shape [6, 4096]")
    assert "takes [tokens, 64]" in str(error.value)


def test_mock_media_and_jsonl_prompts(tmp_path: Path) -> None:
    ctx = run_context({"run": {"output_dir": str(tmp_path)}})
    dataset = build_mock_media_dataset(MockMediaConfig(samples=3, prompts=["p", "q"],
                                                       media=True, size=8), ctx=ctx)
    assert [prompt_text(s) for s in dataset.samples] == ["p", "q", "p"]
    clip = load_frames(dataset.samples, frames=5, height=8, width=8, what="ddrl")
    assert clip.shape == (3, 5, 8, 8, 3)
    assert (clip[0] == clip[0, 0, 0, 0]).all()  # a solid colour, repeated over frames
    plain = build_mock_media_dataset(MockMediaConfig(samples=1), ctx=ctx)
    with pytest.raises(DataError, match="needs a video or image in each sample"):
        load_frames(plain.samples, frames=1, height=8, width=8, what="algorithm.ddrl.data_beta")


def test_media_round_trip_and_grid(tmp_path: Path) -> None:
    from reasonctl.diffusion.media import fit, grid, load_media, write_media

    clip = np.zeros((3, 10, 20, 3), dtype=np.uint8)
    clip[:, :, :10] = 200
    assert fit(clip, 10, 10).shape == (3, 10, 10, 3)
    path = write_media(tmp_path / "clip", clip)
    assert path.suffix == ".mp4"
    back = load_media(path, frames=3, height=10, width=20)
    assert back.shape == (3, 10, 20, 3) and back[:, :, :8].mean() > 150
    image = write_media(tmp_path / "one", clip[:1])
    assert image.suffix == ".png" and load_media(image, frames=2, height=10, width=20).shape[0] == 2
    assert grid([clip, clip, clip]).shape == (3, 20, 40, 3)
    with pytest.raises(ValueError, match="has 3 frame"):
        load_media(path, frames=5, height=10, width=20)


def test_infer_writes_an_image_for_a_pipeline_directory(
        tmp_path: Path, tiny_pipelines: dict[str, Path]) -> None:  # noqa: F811
    from PIL import Image
    from typer.testing import CliRunner

    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    app = build_app(PluginHost.load())
    out = tmp_path / "cat.png"
    model = str(tiny_pipelines["sd3"])
    result = CliRunner().invoke(app, ["infer", "--model", model, "--prompt", "a cat",
                                      "--height", "32", "--width", "32", "--steps", "2",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and str(out) in result.output
    assert Image.open(out).size == (32, 32)
    bad = CliRunner().invoke(app, ["infer", "--model", model, "--prompt", "x",
                                   "--height", "30", "--width", "32"])
    assert bad.exit_code == 2
    assert "--height: 30 is not a positive multiple of 16" in bad.output
