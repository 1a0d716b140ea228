"""ShardContext: which tensor-parallel rank a model is built for, and its collectives (none on one rank)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Collective = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ShardContext:
    rank: int = 0
    size: int = 1
    all_reduce: Collective | None = None
    """Sum across ranks (row-parallel outputs, vocabulary-parallel embeddings)."""
    all_gather: Collective | None = None
    """Concatenate the last dimension across ranks (vocabulary-parallel logits)."""
