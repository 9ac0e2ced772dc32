"""Checkpoint directories: atomic writes, newest-complete lookup, keep-N pruning.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/`` holding the backend's distributed
state under ``state/``, per-rank RNG states and ``manifest.json`` (step, config hash,
algorithm state). It is written as ``.tmp-step_<N>`` and renamed only once complete, so a
crash never leaves a directory that looks complete. Directories without a manifest are
torn: they are skipped and reported.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path
    manifest: dict[str, Any]


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; only the main rank touches the layout."""

    def __init__(self, root: Path, *, keep: int, is_main: bool,
                 barrier: Callable[[], None] = lambda: None, rank: int = 0) -> None:
        self.root = Path(root)
        self.keep = keep
        self.is_main = is_main
        self.barrier = barrier
        self.rank = rank
        self.torn: list[Path] = []

    def step_dir(self, step: int) -> Path:
        """The final directory of the checkpoint at ``step``."""
        return self.root / f"step_{step}"

    def save(
        self, step: int, write_state: Callable[[Path], None], manifest: dict[str, Any]
    ) -> Path:
        """Write a checkpoint collectively and return its final directory.

        ``write_state(directory)`` is called on every rank (the backend's distributed save);
        the main rank then writes the manifest, renames the directory and prunes old ones.
        """
        tmp = self.root / f".tmp-step_{step}"
        final = self.step_dir(step)
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        write_state(tmp / "state")
        save_rng_state(tmp / f"rng_rank{self.rank}.pt")
        self.barrier()
        if self.is_main:
            payload = {"step": step, "saved_at": time.time(), **manifest}
            (tmp / MANIFEST).write_text(json.dumps(payload, indent=2, default=str))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self.prune()
        self.barrier()
        return final

    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first; torn directories are recorded in ``torn``."""
        found: list[CheckpointInfo] = []
        self.torn = []
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            if child.name.startswith(".tmp-step_"):
                self.torn.append(child)
                continue
            match = STEP_DIR.match(child.name)
            if not match or not child.is_dir():
                continue
            manifest_path = child / MANIFEST
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                self.torn.append(child)
                continue
            found.append(CheckpointInfo(int(match.group(1)), child, manifest))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or ``None``."""
        complete = self.complete()
        return complete[-1] if complete else None

    def prune(self) -> None:
        """Delete the oldest complete checkpoints beyond ``keep``; never the newest."""
        complete = self.complete()
        for info in complete[: max(0, len(complete) - max(self.keep, 1))]:
            shutil.rmtree(info.path, ignore_errors=True)


def read_checkpoint(path: Path) -> CheckpointInfo:
    """Load a checkpoint directory given explicitly (``run.resume = "path"``)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); point run.resume at a "
            "checkpoints/step_<N> directory or set run.resume = true for the newest one"
        )
    manifest = json.loads(manifest_path.read_text())
    return CheckpointInfo(int(manifest["step"]), path, manifest)


def save_rng_state(path: Path) -> None:
    """Save Python, NumPy and torch (CPU and CUDA) random states of this rank."""
    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, path)


def load_rng_state(path: Path) -> bool:
    """Restore random states saved by :func:`save_rng_state`; False when the file is absent."""
    import numpy as np
    import torch

    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True
