"""Suite-wide settings. Fixtures for tiny models live in the ``reasonctl.testing`` plugin."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton builds its own library functions for the interpreter only when this is set at
# its import; tests switch the interpreter off again unless they ask for it (below)
os.environ["TRITON_INTERPRET"] = "1"
try:  # imported now, while that holds (a model's construction may import it later)
    import triton  # noqa: F401
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Keep reasonctl's model cache inside the test session's temporary directory."""
    monkeypatch.setenv("REASONCTL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU runs skip the Triton kernels, as they do outside tests."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch):
    """Run the decode step's Triton kernels in Triton's interpreter (CPU tensors) for one
    test: the kernels are defined anew under ``TRITON_INTERPRET=1`` and dropped after, so
    no other test sees interpreted kernels."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from reasonctl.rollout.kernels import (
        decode_attention,
        decode_linear,
        decode_mlp,
        decode_norm,
        head_sampling,
        prefill_kernels,
        race_sampling,
        step_record,
    )

    modules = (decode_attention, decode_linear, decode_mlp, decode_norm, head_sampling,
               prefill_kernels, race_sampling, step_record)
    for module in modules:
        module._kernels.cache_clear()
    yield
    for module in modules:
        module._kernels.cache_clear()
