"""cpu_paged: decodes through the C++ paged decode kernel (csrc/paged_decode.cpp: K/V read in place through
the block tables, one pass with an online softmax; an int8/fp8 cache is dequantized as it is read, with its
scales, and a bfloat16 one widened), prefill chunks as in the reference backend."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.prefill import PrefillChunk, build_prefills, prefill_attention, write_kv
from kvserve.attention.torch_ref import kv_cache_scale_shape, kv_cache_shape
from kvserve.kv_cache.quant import QuantizedKVCache


@dataclass
class CPUPagedMetadata:
    slot_mapping: torch.Tensor                # [T]
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None   # [Bd, max_blocks] int64
    decode_seq_lens: torch.Tensor | None      # [Bd] int64
    prefills: list[PrefillChunk]
    decode_query_start: torch.Tensor | None = None  # [Bd + 1] int64 when a request has several decode rows


class CPUPagedBackend:
    """`kernel`: the compiled module (cpu_kernels.load_paged_decode())."""

    name = "cpu_paged"

    def __init__(self, kernel):
        self.kernel = kernel

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return kv_cache_scale_shape(num_blocks, block_size, num_kv_heads)

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUPagedMetadata:
        nd = common.num_decodes
        table = lens = starts = None
        if nd and common.decode_groups is not None:  # one kernel task per request: its K/V read once
            starts = common.decode_groups.contiguous()
            table = common.block_table[starts[:-1]].contiguous()
            lens = common.seq_lens[starts[1:] - 1].contiguous()
        elif nd:
            table = common.block_table[:nd].contiguous()
            lens = common.seq_lens[:nd].contiguous()
        return CPUPagedMetadata(common.slot_mapping, common.num_decode_tokens, table, lens, build_prefills(common),
                                starts)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                meta: CPUPagedMetadata, scale: float) -> torch.Tensor:
        flat = write_kv(kv_cache, meta.slot_mapping, k, v)                  # [slots, 2, Hkv, D]
        out = torch.empty_like(q)                                           # [T, Hq, D]
        nd = meta.num_decode_tokens
        if nd:
            values, scales = ((kv_cache.values, kv_cache.scales) if isinstance(kv_cache, QuantizedKVCache)
                              else (kv_cache, None))
            # NOTE: the kernel takes float32 queries (a bf16 model's are a few rows: cheap to widen) and
            # returns float32; the copy into `out` rounds back to the model's dtype.
            out[:nd] = self.kernel.paged_decode_attention(q[:nd].float().contiguous(), values, meta.decode_block_table,
                                                          meta.decode_seq_lens, scale, meta.decode_query_start,
                                                          scales)
        prefill_attention(q, k, v, flat, meta.prefills, out, scale)
        return out
