"""CPU attention backend: PyTorch scaled_dot_product_attention over K/V gathered through block tables.

Decodes (one query token each) are batched into one SDPA call over their contexts padded to the longest;
prefill chunks run one SDPA call each. A chunk that starts at position 0 attends to its own k/v directly
(nothing to gather); later chunks gather their context from the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata


# Query rows per SDPA call within a prefill chunk. Each tile attends only to keys up to its own last
# position, which skips most of the masked half: 3.5 vs 4.4 ms per layer for a 512-token chunk with the
# flash kernel on the dev machine (and 4.5 vs 10.3 ms on the math path).
_QUERY_TILE = 128


@dataclass
class QueryTile:
    start: int                   # rows [start, end) of the chunk
    end: int
    num_keys: int                # keys [0, num_keys) of the chunk's sequence are visible to this tile
    mask: torch.Tensor | None    # [end - start, num_keys] bool (bottom-right causal); None: plain causal


@dataclass
class PrefillChunk:
    q_start: int                 # first row of this chunk in the flattened batch
    q_len: int
    context_len: int             # tokens before this chunk (already in the cache)
    gather_idx: torch.Tensor | None  # [context_len + q_len] slots; None when context_len == 0
    tiles: list[QueryTile]


@dataclass
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor        # [T]
    num_decode_tokens: int
    decode_gather_idx: torch.Tensor | None  # [Bd, Lmax] slots (padding points at slot 0, masked out)
    decode_mask: torch.Tensor | None        # [Bd, 1, 1, Lmax] bool, True = attend
    prefills: list[PrefillChunk]
    decode_block_table: torch.Tensor | None = None  # [Bd, max_blocks], for the C++ decode kernel
    decode_seq_lens: torch.Tensor | None = None     # [Bd]


def _query_tiles(q_len: int, ctx: int) -> list[QueryTile]:
    """Query j of the chunk sits at position ctx + j and sees positions <= ctx + j (bottom-right causal)."""
    if ctx == 0 and q_len <= _QUERY_TILE:
        return [QueryTile(0, q_len, q_len, None)]
    tiles = []
    for start in range(0, q_len, _QUERY_TILE):
        end = min(q_len, start + _QUERY_TILE)
        num_keys = ctx + end
        mask = torch.arange(num_keys)[None, :] <= (torch.arange(start, end)[:, None] + ctx)
        tiles.append(QueryTile(start, end, num_keys, mask))
    return tiles


def _token_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table_row[positions // block_size] * block_size + positions % block_size


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat [S, 2, Hkv, D] rows at `slots` (any shape) -> [*slots.shape, 2, Hkv, D].

    NOTE: index_select on a 2-D view copies whole rows; advanced indexing (flat[slots]) on the 4-D tensor
    was 5-10x slower on CPU and dominated decode steps."""
    rows = flat.view(flat.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *flat.shape[1:])


class TorchSDPABackend:
    """`decode_kernel`: the compiled paged decode kernel (cpu_kernels.load_paged_decode()), or None for the
    pure PyTorch gather + SDPA path. Both produce the same attention (tests compare them)."""

    def __init__(self, decode_kernel=None):
        self.decode_kernel = decode_kernel
        self.name = "cpu_paged" if decode_kernel is not None else "torch_sdpa"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        # NOTE: K and V of a slot sit side by side so that one gather fetches both.
        return (num_blocks, block_size, 2, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        bs = common.block_size
        nd = common.num_decodes
        decode_gather_idx = decode_mask = decode_table = decode_lens = None
        if nd and self.decode_kernel is not None:
            decode_table = common.block_table[:nd].contiguous()
            decode_lens = common.seq_lens[:nd].contiguous()
        elif nd:
            seq_lens = common.seq_lens[:nd]                                  # [Bd]
            max_len = max(common.seq_lens_cpu[:nd])
            pos = torch.arange(max_len)                                      # [Lmax]
            valid = pos[None, :] < seq_lens[:, None]                         # [Bd, Lmax]
            pos_c = torch.where(valid, pos[None, :], 0)
            table = common.block_table[:nd]
            decode_gather_idx = torch.gather(table, 1, pos_c // bs) * bs + pos_c % bs
            decode_mask = valid[:, None, None, :]
        prefills = []
        starts = common.query_start_loc.tolist()
        for i in range(nd, len(common.seq_lens_cpu)):
            q_len = common.query_lens_cpu[i]
            seq_len = common.seq_lens_cpu[i]
            ctx = seq_len - q_len
            gather_idx = None
            if ctx > 0:
                gather_idx = _token_slots(common.block_table[i], torch.arange(seq_len), bs)
            prefills.append(PrefillChunk(starts[i], q_len, ctx, gather_idx, _query_tiles(q_len, ctx)))
        return TorchSDPAMetadata(common.slot_mapping, common.num_decode_tokens, decode_gather_idx,
                                 decode_mask, prefills, decode_table, decode_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TorchSDPAMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat = kv_cache.view(-1, 2, num_kv_heads, head_dim)                  # [slots, 2, Hkv, D]
        flat.index_copy_(0, meta.slot_mapping, torch.stack((k, v), dim=1))
        out = torch.empty_like(q)                                           # [T, Hq, D]
        nd = meta.num_decode_tokens
        if nd and self.decode_kernel is not None:
            out[:nd] = self.decode_kernel.paged_decode_attention(
                q[:nd].contiguous(), kv_cache, meta.decode_block_table, meta.decode_seq_lens, scale)
        elif nd:
            out[:nd] = self._decode(q[:nd], flat, meta, scale)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.gather_idx is None:
                ks, vs = k[rows], v[rows]
            else:
                kv = _gather(flat, p.gather_idx)                             # [S, 2, Hkv, D]
                ks, vs = kv[:, 0], kv[:, 1]
            # NOTE: 4-D [1, H, L, D] views: with 3-D inputs torch's CPU SDPA takes its math path (bmm +
            # softmax + masking ops), 2-2.5x slower than the flash kernel that 4-D inputs get.
            qs, ks, vs = (x.unsqueeze(0).transpose(1, 2) for x in (q[rows], ks, vs))
            for t in p.tiles:
                o = F.scaled_dot_product_attention(
                    qs[:, :, t.start:t.end], ks[:, :, :t.num_keys], vs[:, :, :t.num_keys], attn_mask=t.mask,
                    is_causal=t.mask is None, scale=scale, enable_gqa=True)
                out[p.q_start + t.start:p.q_start + t.end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, flat: torch.Tensor, meta: TorchSDPAMetadata, scale: float) -> torch.Tensor:
        bd, num_heads, head_dim = q.shape
        kv = _gather(flat, meta.decode_gather_idx)                           # [Bd, Lmax, 2, Hkv, D]
        num_kv_heads = kv.shape[3]
        group = num_heads // num_kv_heads
        # NOTE: the query heads of one KV head act as SDPA's "sequence" axis, so GQA needs no K/V repeat
        # and one batched call serves every decode.
        qg = q.view(bd, num_kv_heads, group, head_dim)                       # [Bd, Hkv, G, D]
        ks = kv[:, :, 0].transpose(1, 2)                                     # [Bd, Hkv, Lmax, D]
        vs = kv[:, :, 1].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=meta.decode_mask, scale=scale)
        return o.reshape(bd, num_heads, head_dim)
