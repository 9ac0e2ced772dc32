"""The decode step's kernels compiled for and run on a CUDA GPU (skipped without one): runs
``tests/cuda_checks.py`` in a separate pytest process, since this suite's ``conftest.py``
switches Triton to its interpreter at import for the CPU kernel tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_chain_on_cuda() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider",
         str(root / "tests" / "cuda_checks.py")],
        env=env, capture_output=True, text=True, timeout=1200, cwd=root)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
