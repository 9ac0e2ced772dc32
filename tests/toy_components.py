"""A toy algorithm and backend registered through the public plugin API, for core tests.

The "model" is one number fitted to a target by gradient descent: enough to see a loss
fall, checkpoints round-trip and a resumed run equal an uninterrupted one, without torch.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

import reasonctl


class ToyAlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: float = 3.0
    signal_at_step: int = 0
    nan_at_step: int = 0
    """This step's loss is NaN and its update is skipped, as a backend skips it."""

    def needs(self) -> reasonctl.Needs:
        """No tokenizer and no data: the toy fits one number."""
        return reasonctl.Needs(processor=False, dataset=False)


class ToyBackend:
    """Holds one weight; 'saves' it as JSON; 'exports' it as a file."""

    def __init__(self, config: Any) -> None:
        self.rank, self.world_size, self.is_main = 0, 1, True
        self.device = "cpu"
        self.weight = 0.0
        self.closed = False

    def setup(self, ctx: Any) -> None:
        self.lr = ctx.config.train.lr

    def token_outputs(self, batch: Any, **options: Any) -> Any:
        raise NotImplementedError("the toy algorithm updates the weight itself")

    def train_step(self, micro_batches: Any, loss_fn: Any, **options: Any) -> Any:
        raise NotImplementedError("the toy algorithm updates the weight itself")

    def full_state_dict(self) -> Any:
        yield "weight", self.weight

    def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "weight.json").write_text(json.dumps({"weight": self.weight}))

    def load_checkpoint(self, directory: Path) -> None:
        self.weight = json.loads((directory / "weight.json").read_text())["weight"]

    def export(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "weight.txt").write_text(repr(self.weight))

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class ToyAlgorithm:
    """Gradient descent on (w - target)^2; a step's loss is measured before its update."""

    def __init__(self, config: ToyAlgorithmConfig) -> None:
        self.config = config
        self.updates = 0

    def setup(self, ctx: Any) -> None:
        ctx.total_steps = ctx.config.train.max_steps or 10

    def step(self, ctx: Any) -> dict[str, float]:
        backend = ctx.backend
        if self.config.nan_at_step and ctx.step + 1 == self.config.nan_at_step:
            return {"loss": float("nan"), "grad_norm": float("nan"), "weight": backend.weight}
        error = backend.weight - self.config.target
        backend.weight -= backend.lr * 2 * error
        self.updates += 1
        if self.config.signal_at_step and ctx.step + 1 == self.config.signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"loss": error * error, "weight": backend.weight}

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]


class ToyPlugin:
    """Registers ``toy`` algorithm and backend and records lifecycle events."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    @reasonctl.hookimpl
    def register_algorithms(self, register: Any) -> None:
        register("toy", ToyAlgorithm, config_model=ToyAlgorithmConfig)

    @reasonctl.hookimpl
    def register_backends(self, register: Any) -> None:
        register("toybackend", ToyBackend)

    @reasonctl.hookimpl
    def on_run_start(self, ctx: Any) -> None:
        self.events.append(("start",))

    @reasonctl.hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("step", step, metrics["loss"]))

    @reasonctl.hookimpl
    def on_checkpoint_saved(self, ctx: Any, step: int, path: Path) -> None:
        self.events.append(("checkpoint", step, path))

    @reasonctl.hookimpl
    def on_run_end(self, ctx: Any, status: str, error: BaseException | None) -> None:
        self.events.append(("end", status))
