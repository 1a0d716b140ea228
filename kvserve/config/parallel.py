"""ParallelConfig: how the model is split across processes (one rank until tensor parallelism lands)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks each layer's weights are sharded over (Megatron-style)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1: tensor parallelism is not implemented yet")
