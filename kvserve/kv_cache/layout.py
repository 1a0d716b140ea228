"""Where a token's K/V lives: the KV-cache spec every layer's tensor is allocated from, and the one
definition of a token's slot.

    slot = block_id * block_size + position % block_size,  block_id = block_table[position // block_size]

The backend chooses the tensor's shape (`AttentionBackend.kv_cache_shape`); the spec carries what the
shape is made of, the cache's dtype and, for a quantized cache (kv_cache/quant.py), the type of its scales:
one per block, KV head and K/V, in a tensor of their own beside the values
(`AttentionBackend.kv_cache_scale_shape`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv_cache.quant import is_quantized
from kvserve.kv_cache.sizing import kv_bytes


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The element type K/V are stored in."""
    scale_dtype: torch.dtype | None = None
    """The scales' type for a quantized cache (int8/fp8: one per block, KV head and K/V); None: the values are
    stored as they are."""
    latent: bool = False
    """MLA (attention/mla.py): one latent vector of head_dim elements per token and layer, not K and V
    (num_kv_heads 1)."""

    def __post_init__(self) -> None:
        if self.latent and (self.num_kv_heads != 1 or self.scale_dtype is not None):
            raise ValueError("a latent (MLA) KV cache holds one unquantized vector per token: num_kv_heads 1, "
                             "no scales")
        if (self.scale_dtype is None) == is_quantized(self.dtype):
            raise ValueError(f"a {self.dtype} KV cache {'needs' if is_quantized(self.dtype) else 'takes no'} "
                             f"scale_dtype, got {self.scale_dtype}")

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def scale_size(self) -> int:
        """Bytes of one scale (0: unquantized)."""
        return torch.empty((), dtype=self.scale_dtype).element_size() if self.quantized else 0

    @property
    def bytes_per_block(self) -> int:
        """2 (K and V) x layers x kv_heads x (block_size x head_dim x element size + scale size): scales included;
        a latent cache: layers x block_size x head_dim x element size."""
        if self.latent:
            return self.num_layers * self.block_size * self.head_dim * self.element_size
        return kv_bytes(self.num_layers, self.num_kv_heads, self.head_dim * self.block_size, self.element_size,
                        self.scale_size)

    @property
    def bytes_per_token(self) -> float:
        """A block's bytes shared by its tokens (a fraction for a quantized cache: its scales are per block)."""
        per_block = self.bytes_per_block
        return per_block // self.block_size if per_block % self.block_size == 0 else per_block / self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def slot_mapping(block_table, rows, positions, block_size: int):
    """Slots of the tokens at `positions` of the requests whose block-table rows are `rows` (numpy or torch;
    rows and positions broadcast against each other). The only place the formula is written."""
    return block_table[rows, positions // block_size] * block_size + positions % block_size
