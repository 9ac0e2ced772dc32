"""What the decode step's Triton kernels share: whether Triton is there, whether its
interpreter runs them, what the GPU offers (processors, programmatic dependent launches,
tensor descriptors) and block-size arithmetic."""

from __future__ import annotations

import os

import torch


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


def kernels_run_on(device: torch.device) -> bool:
    """True when the decode step's Triton kernels run on ``device``: a CUDA device, or
    any device under Triton's interpreter, with Triton installed."""
    return (device.type == "cuda" or interpreting()) and triton_available()


def processor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (1 elsewhere)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports_pdl(device: torch.device) -> bool:
    """True when kernels on ``device`` can be programmatic dependent launches (a kernel
    starts while the previous one finishes and waits for it in its first instructions):
    a CUDA GPU of compute capability 9.0 or newer, compiled kernels (not the interpreter)
    and a Triton that has the instructions."""
    if device.type != "cuda" or interpreting() or not triton_available():
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    import triton.language.extra.cuda as cuda_extras

    return hasattr(cuda_extras, "gdc_wait")


def supports_tensor_descriptors(device: torch.device) -> bool:
    """True when compiled kernels on ``device`` can load tiles through tensor-memory-
    accelerator descriptors (one bulk copy per tile instead of per-thread loads): a CUDA
    GPU of compute capability 9.0 or newer with a Triton that has host-side descriptors.
    (Triton's interpreter also runs descriptor loads; kernels use them there only when
    asked to.)"""
    if device.type != "cuda" or interpreting() or not triton_available():
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
