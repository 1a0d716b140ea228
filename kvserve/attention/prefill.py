"""Prefill chunks through PyTorch's flash SDPA (the reference backend's path: cpu_paged reads chunks through its
kernel), and the cache writes and gathers both backends share.

A chunk that starts at position 0 attends to its own k/v directly (nothing to gather); a later chunk
gathers its context from the cache. From a quantized cache the gather dequantizes, so a prompt's first
chunk sees its own K/V in full precision and later chunks see what the cache stores, as decodes do (a
quantized cache's K/V, and so the q and the output here, are rotated: kv_cache/rotation.py).
Chunks are cut into query tiles that each attend only up to their own last position, which skips most of
the masked half of a long chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.kv_cache.layout import slot_mapping
from kvserve.kv_cache.quant import QuantizedKVCache, gather_dequantized, write_block_scaled

# Query rows per SDPA call within a prefill chunk (see the module docstring).
_QUERY_TILE = 128


@dataclass
class QueryTile:
    start: int                   # rows [start, end) of the chunk
    end: int
    num_keys: int                # keys [key_start, num_keys) of the chunk's key range are visible to this tile
    mask: torch.Tensor | None    # [end - start, num_keys - key_start] bool; None: plain (bottom-right) causal
    key_start: int = 0


@dataclass
class PrefillChunk:
    q_start: int                 # first row of this chunk in the flattened batch
    q_len: int
    context_len: int             # tokens before this chunk (already in the cache)
    gather_idx: torch.Tensor | None  # [seq_len - first_key] slots; None when context_len == 0
    tiles: list[QueryTile]
    first_key: int = 0           # position of the chunk's key 0 (a sliding window's first visible position)


def _query_tiles(q_len: int, ctx: int, first_key: int = 0, window: int | None = None) -> list[QueryTile]:
    """Query j of the chunk sits at position ctx + j and sees positions <= ctx + j (bottom-right causal), and
    with a window W only those > ctx + j - W. Key indices count from position `first_key`."""
    if ctx == 0 and q_len <= _QUERY_TILE and (window is None or q_len <= window):
        return [QueryTile(0, q_len, q_len, None)]
    tiles = []
    for start in range(0, q_len, _QUERY_TILE):
        end = min(q_len, start + _QUERY_TILE)
        num_keys = ctx + end - first_key
        key_start = 0 if window is None else max(0, ctx + start - window + 1 - first_key)
        k_pos = torch.arange(first_key + key_start, first_key + num_keys)[None, :]
        q_pos = torch.arange(start, end)[:, None] + ctx
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        tiles.append(QueryTile(start, end, num_keys, mask, key_start))
    return tiles


def build_prefills(common: CommonAttentionMetadata, window: int | None = None) -> list[PrefillChunk]:
    """One PrefillChunk per request after the decodes; with a sliding `window`, each gathers only the positions
    its queries can see."""
    prefills = []
    starts = common.query_start_loc.tolist()
    for i in range(common.num_decodes, len(common.seq_lens_cpu)):
        q_len = common.query_lens_cpu[i]
        seq_len = common.seq_lens_cpu[i]
        ctx = seq_len - q_len
        first_key = 0 if window is None else max(0, ctx - window + 1)
        gather_idx = None
        if ctx > 0:
            gather_idx = slot_mapping(common.block_table, i, torch.arange(first_key, seq_len), common.block_size)
        else:
            first_key = 0
        prefills.append(PrefillChunk(starts[i], q_len, ctx, gather_idx,
                                     _query_tiles(q_len, ctx, first_key, window), first_key))
    return prefills


def write_kv(kv_cache: torch.Tensor | QuantizedKVCache, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor | QuantizedKVCache:
    """Write k/v [T, Hkv, D] at `slots` [T]; returns what `gather` reads: the cache as [slots, 2, Hkv, D], or
    the QuantizedKVCache itself (written through its block scales: kv_cache/quant.py)."""
    if isinstance(kv_cache, QuantizedKVCache):
        write_block_scaled(kv_cache, slots, k, v)
        return kv_cache
    kv = torch.stack((k, v), dim=1)                                          # [T, 2, Hkv, D]
    flat = kv_cache.view(-1, *kv.shape[1:])
    flat.index_copy_(0, slots, kv)
    return flat


def gather(flat: torch.Tensor | QuantizedKVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """flat [S, 2, Hkv, D] rows at `slots` (any shape) -> [*slots.shape, 2, Hkv, D] of `dtype` (dequantized
    from a QuantizedKVCache: only the rows gathered).

    NOTE: index_select on a 2-D view copies whole rows; advanced indexing (flat[slots]) on the 4-D tensor
    was 5-10x slower on CPU and dominated decode steps."""
    if isinstance(flat, QuantizedKVCache):
        return gather_dequantized(flat, slots, dtype)
    rows = flat.view(flat.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *flat.shape[1:])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         soft_cap: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (GQA); PyTorch's SDPA, or the same in plain ops where Gemma 2's
    logit soft cap (c * tanh(s / c) on the scaled scores) must go between the product and the softmax."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor | QuantizedKVCache,
                      prefills: list[PrefillChunk], out: torch.Tensor, scale: float,
                      soft_cap: float | None = None) -> None:
    """Attention of every prefill chunk's query rows, written into `out` [T, Hq, D]."""
    for p in prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.gather_idx is None:
            ks, vs = k[rows], v[rows]
        else:
            kv = gather(flat, p.gather_idx, q.dtype)                         # [S, 2, Hkv, D]
            ks, vs = kv[:, 0], kv[:, 1]
        chunk_attention(p, q[rows], ks, vs, out, scale, soft_cap)


def chunk_attention(p: PrefillChunk, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, out: torch.Tensor,
                    scale: float, soft_cap: float | None = None) -> None:
    """One chunk's query rows q [q_len, Hq, D] over its keys ks [S, Hkv, D] and values vs [S, Hkv, Dv] (S: the
    positions from p.first_key on), tile by tile, into its rows of `out` [T, Hq, Dv]."""
    # NOTE: 4-D [1, H, L, D] views: with 3-D inputs torch's CPU SDPA takes its math path (bmm +
    # softmax + masking ops), 2-2.5x slower than the flash kernel that 4-D inputs get.
    qs, ks, vs = (x.unsqueeze(0).transpose(1, 2) for x in (q, ks, vs))
    for t in p.tiles:
        keys = slice(t.key_start, t.num_keys)
        o = sdpa(qs[:, :, t.start:t.end], ks[:, :, keys], vs[:, :, keys], t.mask, scale, soft_cap,
                 is_causal=t.mask is None)
        out[p.q_start + t.start:p.q_start + t.end] = o[0].transpose(0, 1)
