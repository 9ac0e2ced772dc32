"""Write the video quickstart's data: short mp4 clips of one colour each, and a question about
the colour in the layouts Cosmos-Reason data uses.

    python examples/video_quickstart.py outputs/video_quickstart_data

writes, under the given directory (the default is ``outputs/video_quickstart_data``):

- ``clips/<colour>_<n>.mp4``: 8 frames at 4 fps, 32x32 pixels, a noisy flat colour that
  brightens a little over the clip (written with PyAV: ``pip install 'reasonctl[video]'``);
- ``sft.jsonl``: prompt/answer rows, the answer ``<answer>B</answer>`` style;
- ``rl.jsonl`` and ``eval.jsonl``: Cosmos-Reason1 RL rows, ``{"video": ...,
  "qa_pairs": {"question", "index2ans", "answer"}}``, for GRPO and ``reasonctl eval`` (on
  clips of their own).

The configs ``examples/configs/quickstart_video_*.toml`` read these files:
``quickstart_video_sft.toml`` then ``quickstart_video_grpo.toml`` (SFT, then GRPO with
format and choice rewards), and ``quickstart_video_grpo_letters.toml`` (GRPO alone, from the
random model with one-token answers: the reward climbs from ~0.02 to ~1.0 as it learns each
clip's colour).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (200, 40, 40), "green": (40, 190, 60), "blue": (40, 60, 210)}
OPTIONS = {"A": "red", "B": "green", "C": "blue"}
QUESTION = "What colour is this video?"


def write_clip(path: Path, rgb: tuple[int, int, int], rng: random.Random,
               frames: int = 8, fps: int = 4, size: int = 32) -> Path:
    """A clip of ``rgb`` with per-pixel noise and a slow brightening."""
    import av
    import numpy as np

    noise = np.random.default_rng(rng.randrange(2**32))
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            base = np.array(rgb, dtype=np.float32) * (0.8 + 0.05 * index)
            pixels = base + noise.normal(0, 12, (size, size, 3))
            image = np.clip(pixels, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def prompt_text() -> str:
    """The question with its lettered options, as GRPO and eval lay out ``qa_pairs``."""
    return QUESTION + "\n" + "\n".join(f"{k}. {v}" for k, v in OPTIONS.items())


def write_dataset(root: str | Path, *, clips_per_colour: int = 8, eval_per_colour: int = 4,
                  seed: int = 0) -> Path:
    """Write the clips and the three JSON Lines files under ``root``; return ``root``."""
    root = Path(root)
    rng = random.Random(seed)
    letters = {colour: letter for letter, colour in OPTIONS.items()}
    splits: dict[str, list[dict]] = {"sft": [], "rl": [], "eval": []}
    for colour, rgb in COLOURS.items():
        for n in range(clips_per_colour + eval_per_colour):
            clip = write_clip(root / "clips" / f"{colour}_{n}.mp4", rgb, rng)
            video = str(clip.relative_to(root))
            qa = {"question": QUESTION, "index2ans": OPTIONS, "answer": letters[colour]}
            if n < clips_per_colour:
                splits["sft"].append({"video": video, "prompt": prompt_text(),
                                      "answer": f"<answer>{letters[colour]}</answer>"})
                splits["rl"].append({"video": video, "qa_pairs": qa})
            else:
                splits["eval"].append({"video": video, "qa_pairs": qa})
    for name, rows in splits.items():
        rng.shuffle(rows)
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return root


def main() -> None:
    """Command line: the output directory (default ``outputs/video_quickstart_data``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="outputs/video_quickstart_data")
    parser.add_argument("--clips-per-colour", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = write_dataset(args.root, clips_per_colour=args.clips_per_colour, seed=args.seed)
    print(f"wrote {root}/clips, sft.jsonl, rl.jsonl, eval.jsonl")


if __name__ == "__main__":
    main()
