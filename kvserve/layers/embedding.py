"""Token embedding and LM head, vocabulary-parallel: rank r of tp_size holds rows [r * V/tp, (r + 1) * V/tp)
of the vocabulary (the whole vocabulary on one rank).

The LM head is a linear layer with a method like every other (oneDNN-packed on CPU fp32); tied to the
embedding it shares the embedding's weight.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.linear import LinearBase, _copy, _rank_slice
from kvserve.layers.linear_methods import LinearMethod


def _vocab_shard(vocab_size: int, tp_size: int) -> int:
    if vocab_size % tp_size:
        raise ValueError(f"vocabulary of {vocab_size} is not divisible by tensor_parallel_size {tp_size}")
    return vocab_size // tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = _vocab_shard(vocab_size, tp_size)
        self.start = tp_rank * self.shard
        self.tp_rank, self.tp_size, self.reduce = tp_rank, tp_size, reduce
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.reduce(x)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(self.weight.data, _rank_slice(loaded, 0, self.shard, self.tp_rank))


class ParallelLMHead(LinearBase):
    """hidden [N, H] -> logits [N, V] (float32). `tied_to`: share that embedding's weight (no own tensor)."""

    def __init__(self, vocab_size: int, hidden_size: int, method: LinearMethod | None = None,
                 tied_to: VocabParallelEmbedding | None = None, tp_rank: int = 0, tp_size: int = 1,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__(hidden_size, _vocab_shard(vocab_size, tp_size), False, method, tp_rank, tp_size)
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        self.gather = gather

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden, None)
        if self.gather is not None:
            logits = self.gather(logits)
        return logits.float()

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(self.weight.data, _rank_slice(loaded, 0, self.output_size, self.tp_rank))
