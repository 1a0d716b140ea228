"""LoRAConfig: how many adapters the engine serves at once, how large, and how many it keeps loaded."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    max_loras: int = 1
    """Adapters resident in the model's slots at once: the most distinct adapters in one step."""
    max_lora_rank: int = 16
    """Largest rank r an adapter may have (the slot tensors are padded to it)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (LRU), so a swapped-out one returns without a disk read;
    None: max_loras."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
