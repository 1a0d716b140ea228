"""The attention-backend contract: how KV is laid out, and how attention reads it through block tables.

The model runner builds one `CommonAttentionMetadata` per step (backend-independent, from the scheduler's
block tables); a backend turns it into its own metadata once, and every attention layer of the step reuses
it. Backends (attention/registry.py): `torch_ref` (PyTorch only, the oracle) and `cpu_paged` (the C++
decode kernel); a GPU kernel backend plugs in behind the same protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.kv_cache.quant import QuantizedKVCache


@dataclass
class CommonAttentionMetadata:
    """Per-step batch layout. Requests with exactly one query token ("decodes") come first."""

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int64, context + query length after this step
    block_table: torch.Tensor      # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor     # [T] int64, KV slot of every query token (block_id * block_size + offset)
    num_decodes: int               # rows [0, num_decodes) have query length 1
    num_decode_tokens: int
    block_size: int
    query_lens_cpu: list[int]      # same as diff(query_start_loc), as Python ints (no host sync to read)
    seq_lens_cpu: list[int]
    decode_groups: torch.Tensor | None = None
    """[S + 1] int64, or None: decode rows [decode_groups[s], decode_groups[s + 1]) are consecutive query
    tokens of one request (it verifies draft tokens). Each row is also a complete decode on its own, so a
    backend may ignore this; one that reads K/V once per request (cpu_paged) uses it."""


class AttentionBackend(Protocol):
    """Reads and writes the paged KV cache of one layer.

    Contract: `forward` first writes k/v of every query token at `slot_mapping`, then computes causal
    attention of each query token over its request's positions [0, its position], reading K/V through
    the block table. GQA: num_heads is a multiple of num_kv_heads.

    A layer with a `sliding_window` W attends only to the last W positions (p - W, p], as transformers'
    sliding_window_overlay does; blocks wholly before every window of a request may have been freed, so a
    windowed read must not touch them. `logits_soft_cap` c (Gemma 2): scores become c * tanh(scores / c)
    after scaling, before the mask and softmax.
    """

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor."""
        ...

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """Shape of one layer's scale tensor for a quantized cache (kv_cache/quant.py): one scale per block,
        K/V and KV head."""
        ...

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for one step; built once, read by every layer."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                meta: Any, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into kv_cache (rotated and quantized when it is
        a QuantizedKVCache, whose reads dequantize: kv_cache/quant.py, kv_cache/rotation.py)."""
        ...
