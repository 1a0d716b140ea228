"""Random paged-cache layouts for the attention-kernel tests: scattered block tables over ragged lengths."""
from __future__ import annotations

import torch


def scatter_sequences(flat: torch.Tensor, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                      g: torch.Generator):
    """Sequences of ragged lengths over randomly chosen blocks of a cache whose slots are `flat`
    ([num_blocks * block_size, 2, Hkv, D], as the kernel will read them). Returns one decode query per
    sequence, the padded block table, the lengths, each sequence's block ids and its K and V rows."""
    seq_lens = [1, 17, block_size, 3 * block_size + 5, 100]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n in seq_lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        ks.append(flat[slots, 0])
        vs.append(flat[slots, 1])
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    return q, table, seq_lens, tables, ks, vs
