"""Attention backends by name (`--attention-backend`)."""
from __future__ import annotations

from kvserve.attention.torch_sdpa import TorchSDPABackend

BACKENDS = ("auto", "torch_sdpa", "cpu_paged")


def make_backend(name: str, device_type: str) -> TorchSDPABackend:
    """auto: the C++ paged decode kernel on CPU when it builds, else PyTorch SDPA with gathered contexts."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "torch_sdpa" or device_type != "cpu":
        return TorchSDPABackend()
    from kvserve.attention.cpu_kernels import load_paged_decode

    kernel = load_paged_decode()
    if kernel is None and name == "cpu_paged":
        raise ValueError("attention backend cpu_paged needs a C++ compiler and ninja to build its kernel")
    return TorchSDPABackend(kernel)
