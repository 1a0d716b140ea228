"""torch_ref: the reference attention backend, PyTorch only (the oracle the other backends are tested against).

Decodes (one query token each) are batched into one SDPA call over their contexts, gathered from the cache
(dequantized, for an int8/fp8 cache) and padded to the longest; prefill chunks go through attention/prefill.py.
An int8/fp8 cache holds K/V rotated (kv_cache/rotation.py): q is rotated alike and the output rotated back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.prefill import PrefillChunk, build_prefills, gather, prefill_attention, sdpa, write_kv
from kvserve.kv_cache.layout import slot_mapping
from kvserve.kv_cache.quant import QuantizedKVCache
from kvserve.kv_cache.rotation import rotate


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor              # [T]
    num_decode_tokens: int
    decode_gather_idx: torch.Tensor | None  # [Bd, Lmax] slots (padding points at a real slot, masked out)
    decode_mask: torch.Tensor | None        # [Bd, 1, 1, Lmax] bool, True = attend
    prefills: list[PrefillChunk]
    common: CommonAttentionMetadata | None = None
    windowed: dict[int, TorchRefMetadata] = field(default_factory=dict)
    """The same step seen through a sliding window, built once per window size by the first layer that has it."""

    def for_window(self, window: int | None) -> TorchRefMetadata:
        if window is None:
            return self
        if window not in self.windowed:
            self.windowed[window] = _build(self.common, window)
        return self.windowed[window]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    # NOTE: K and V of a slot sit side by side so that one gather (or one kernel load) fetches both.
    return (num_blocks, block_size, 2, num_kv_heads, head_dim)


def kv_cache_scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
    # NOTE: one scale per block, K/V and KV head (kv_cache/quant.py); block_size is part of the contract only
    return (num_blocks, 2, num_kv_heads)


class TorchRefBackend:
    name = "torch_ref"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return kv_cache_scale_shape(num_blocks, block_size, num_kv_heads)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        return _build(common, None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                meta: TorchRefMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        rotated = isinstance(kv_cache, QuantizedKVCache)
        if rotated:
            q, k, v = rotate(q), rotate(k), rotate(v)
        flat = write_kv(kv_cache, meta.slot_mapping, k, v)                  # [slots, 2, Hkv, D]
        meta = meta.for_window(sliding_window)
        out = torch.empty_like(q)                                           # [T, Hq, D]
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = _decode(q[:nd], flat, meta, scale, logits_soft_cap)
        prefill_attention(q, k, v, flat, meta.prefills, out, scale, logits_soft_cap)
        return rotate(out) if rotated else out


def _build(common: CommonAttentionMetadata, window: int | None) -> TorchRefMetadata:
    """Decodes gather the positions they see: all of them, or with a window W the last W (blocks before a
    window may have been freed: they are never read)."""
    nd = common.num_decodes
    gather_idx = mask = None
    if nd:
        seq_lens = common.seq_lens[:nd]                                      # [Bd]
        first = torch.zeros_like(seq_lens) if window is None else (seq_lens - window).clamp(min=0)
        span = max(common.seq_lens_cpu[:nd]) if window is None else min(window, max(common.seq_lens_cpu[:nd]))
        pos = first[:, None] + torch.arange(span)[None, :]                   # [Bd, Lmax]
        valid = pos < seq_lens[:, None]
        pos_c = torch.where(valid, pos, 0)
        gather_idx = slot_mapping(common.block_table, torch.arange(nd)[:, None], pos_c, common.block_size)
        mask = valid[:, None, None, :]
    return TorchRefMetadata(common.slot_mapping, common.num_decode_tokens, gather_idx, mask,
                            build_prefills(common, window), common)


def _decode(q: torch.Tensor, flat: torch.Tensor | QuantizedKVCache, meta: TorchRefMetadata, scale: float,
            soft_cap: float | None = None) -> torch.Tensor:
    bd, num_heads, head_dim = q.shape
    kv = gather(flat, meta.decode_gather_idx, q.dtype)                       # [Bd, Lmax, 2, Hkv, D]
    num_kv_heads = kv.shape[3]
    group = num_heads // num_kv_heads
    # NOTE: the query heads of one KV head act as SDPA's "sequence" axis, so GQA needs no K/V repeat
    # and one batched call serves every decode.
    qg = q.view(bd, num_kv_heads, group, head_dim)                           # [Bd, Hkv, G, D]
    ks = kv[:, :, 0].transpose(1, 2)                                         # [Bd, Hkv, Lmax, D]
    vs = kv[:, :, 1].transpose(1, 2)
    o = sdpa(qg, ks, vs, meta.decode_mask, scale, soft_cap)
    return o.reshape(bd, num_heads, head_dim)
