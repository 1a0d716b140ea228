"""Attention backends by name (`--attention-backend`)."""
from __future__ import annotations

from kvserve.attention.backend import AttentionBackend

BACKENDS = ("auto", "cpu_paged", "torch_ref")
_ALIASES = {"torch_sdpa": "torch_ref"}  # the reference backend's name before the two were split


def make_backend(name: str, device_type: str) -> AttentionBackend:
    """auto: cpu_paged on CPU when its kernel builds, else torch_ref (the only backend off the CPU today)."""
    name = _ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    from kvserve.attention.torch_ref import TorchRefBackend

    if name == "torch_ref" or device_type != "cpu":
        if name == "cpu_paged":
            raise ValueError("attention backend cpu_paged runs on the CPU only")
        return TorchRefBackend()
    from kvserve.attention.cpu_kernels import load_paged_attention
    from kvserve.attention.cpu_paged import CPUPagedBackend

    kernel = load_paged_attention()
    if kernel is None:
        if name == "cpu_paged":
            raise ValueError("attention backend cpu_paged needs a C++ compiler and ninja to build its kernel")
        return TorchRefBackend()
    return CPUPagedBackend(kernel)
