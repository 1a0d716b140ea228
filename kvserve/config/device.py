"""DeviceConfig: where the model runs, with which attention backend and how many CPU threads."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: torch.device
    """Resolved: `auto` is the CPU until a CUDA run is tested (the GPU issue turns it on)."""
    attention_backend: str
    """A name in attention.registry.BACKENDS (auto resolves when the worker builds the model)."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None: torch's own choice."""
    enforce_eager: bool = False
    """CUDA: no CUDA graphs (every step runs eagerly); the CPU never captures."""
    batch_invariant: bool = False
    """Fixed-order matmul and attention: a row's logits do not depend on the rest of the step
    (--batch-invariant; config/batch_invariance.py says what it refuses)."""

    @staticmethod
    def resolve_device(name: str) -> torch.device:
        # NOTE: `auto` never picks a device whose path has not run in a test (docs/ARCHITECTURE.md).
        if name == "auto":
            return torch.device("cpu")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but CUDA is not available")
        return torch.device(name)
