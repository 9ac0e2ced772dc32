"""What the decode step's Triton kernels share: whether Triton is there, whether its
interpreter runs them, and block-size arithmetic."""

from __future__ import annotations

import os


def triton_available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU
    tensors). Its half-precision arithmetic is inexact, so kernels compute in float32
    there; half-precision products are exact in float32, so results agree."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()
