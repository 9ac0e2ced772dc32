"""The decode step's one-kernel bookkeeping (run by Triton's interpreter on CPU) against
the stock operations it replaces."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels.step_record import record_tokens
from reasonctl.rollout.static.buffers import record_step

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _state(rows: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "done": torch.arange(rows) % 4 == 0,
        "generated": torch.randint(0, 6, (rows,), generator=generator),
        "windows": torch.zeros(3, rows, 4, dtype=torch.float64),
        "input_ids": torch.zeros(rows, dtype=torch.long),
        "positions": torch.randint(0, 20, (rows,), generator=generator),
    }


def _record(function: object, state: dict[str, torch.Tensor], tokens: torch.Tensor,
            logprobs: torch.Tensor, eos: torch.Tensor, **extra: object) -> tuple:
    rows = tokens.shape[0]
    window_tokens = torch.zeros(rows, 4, dtype=torch.long)
    window_logprobs = torch.zeros(rows, 4)
    window_valid = torch.zeros(rows, 4, dtype=torch.bool)
    column = 2  # a strided column of each window
    function(tokens, logprobs, state["done"], state["generated"], window_tokens[:, column],
             window_logprobs[:, column], window_valid[:, column], state["input_ids"],
             state["positions"], eos, 7, 18, **extra)
    return window_tokens, window_logprobs, window_valid


@pytest.mark.parametrize("rows", [5, 130])  # one program, and two with a ragged second
def test_one_kernel_books_a_step_as_the_stock_operations_do(rows: int) -> None:
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 10, (rows,), generator=generator)
    tokens[1] = 3  # an end token in a live row
    logprobs = -torch.rand(rows, generator=generator)
    eos = torch.tensor([3, 8])
    expected, got = _state(rows), _state(rows)
    want = _record(record_step, expected, tokens, logprobs, eos)
    seed = torch.tensor([41])
    have = _record(record_tokens, got, tokens, logprobs, eos, seed=seed)
    for a, b in zip(want, have, strict=True):
        assert torch.equal(a, b)
    for key in ("done", "generated", "input_ids", "positions"):
        assert torch.equal(expected[key], got[key]), key
    assert int(seed) == 42
    # the step did something: end tokens and the length limit finished rows, positions
    # moved on and stopped at the limit
    assert got["done"].sum() > _state(rows)["done"].sum()
    assert (got["positions"] <= 18).all() and (got["positions"] == 18).any()


def test_bad_input_names_every_problem() -> None:
    rows = 4
    with pytest.raises(ValueError) as caught:
        record_tokens(torch.zeros(rows, dtype=torch.long), torch.zeros(3),
                      torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.long),
                      torch.zeros(rows, 2, dtype=torch.long)[:, 0], torch.zeros(rows),
                      torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.long),
                      torch.zeros(rows, dtype=torch.long), torch.tensor([1]), 5, 9,
                      seed=torch.zeros(2, dtype=torch.long))
    message = str(caught.value)
    for fragment in ("logprobs must be [4]", "share a stride", "seed must be"):
        assert fragment in message, fragment
