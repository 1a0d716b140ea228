"""cpu_paged: every query token of the step through the C++ paged attention kernel (csrc/paged_attention.cpp):
decodes, draft verification and prefill chunks alike read K/V in place through the block tables (no gathered
copy of a chunk's cached context), one pass with an online softmax; an int8/fp8 cache is dequantized as it is
read, with its block scales, and a bfloat16 one widened (an int8/fp8 cache holds K/V rotated, kv_cache/rotation.py:
q is rotated alike and the output rotated back). Sequences that share cached prefix blocks read them once for
all their query rows (attention/cascade.py).

Sliding windows and logit soft caps are kernel arguments of each call (windows differ per layer: the step's
metadata holds none); the kernel starts each sequence at its window's first block. A windowed layer reads
shared prefixes once only while every grouped sequence fits in its window (then the window hides nothing from
them); past that it reads each sequence's blocks alone.

Batch-invariant mode (`fixed_order`, --batch-invariant): every query token is a one-token sequence of its own
(ending at its position), with no shared-prefix groups and no split of a decode over its blocks, so each row,
a decode, a prefill chunk's row or a draft verification row, is reduced over its keys exactly as a lone
decode at that position is, whatever else the step holds (docs/features/batch-invariance.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cascade import SharedPrefixes, find_shared_prefixes
from kvserve.attention.torch_ref import kv_cache_scale_shape, kv_cache_shape
from kvserve.kv_cache.quant import QuantizedKVCache


@dataclass
class CPUPagedMetadata:
    """One kernel sequence per request: a request verifying drafts has one sequence for all its rows."""

    slot_mapping: torch.Tensor                # [T]
    block_table: torch.Tensor                 # [S, max_blocks] int64
    seq_lens: torch.Tensor                    # [S] int64, of each sequence's last query token
    query_start: torch.Tensor                 # [S + 1] int64
    shared: SharedPrefixes | None             # groups of sequences with common leading blocks
    shared_len: int = 0                       # the longest grouped sequence (a window below it drops the groups)


class CPUPagedBackend:
    """`kernel`: the compiled module (cpu_kernels.load_paged_attention()); `cascade`: read the blocks that
    several sequences of a step share once for all of them (off: each sequence reads its own); `fixed_order`:
    the batch-invariant mode (each query token reduced as a lone decode; no cascade)."""

    name = "cpu_paged"

    def __init__(self, kernel, cascade: bool = True, fixed_order: bool = False):
        self.kernel = kernel
        self.cascade = cascade and not fixed_order
        self.fixed_order = fixed_order

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return kv_cache_scale_shape(num_blocks, block_size, num_kv_heads)

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUPagedMetadata:
        if self.fixed_order:
            return _per_token_metadata(common)
        nd = common.num_decodes
        loc = common.query_start_loc
        if nd and common.decode_groups is not None:
            # decode rows of one request are consecutive tokens of one sequence: its K/V read once for them
            dec = common.decode_groups
            rows = torch.cat((dec[:-1], torch.arange(nd, len(common.seq_lens_cpu))))
            last = torch.cat((dec[1:] - 1, torch.arange(nd, len(common.seq_lens_cpu))))
            starts = torch.cat((dec, loc[nd + 1:]))
            table, lens = common.block_table[rows], common.seq_lens[last]
        else:
            table, lens, starts = common.block_table, common.seq_lens, loc
        table, lens, starts = table.contiguous(), lens.contiguous(), starts.contiguous()
        shared, shared_len = None, 0
        if self.cascade and len(lens) > 1:
            q_lens, seq_lens = starts.diff().tolist(), lens.tolist()
            visible = [(n - q) // common.block_size for n, q in zip(seq_lens, q_lens)]
            shared = find_shared_prefixes(table.tolist(), visible)
            if shared is not None:
                shared_len = max(seq_lens[b] for b in shared.seqs.tolist())
        return CPUPagedMetadata(common.slot_mapping, table, lens, starts, shared, shared_len)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                meta: CPUPagedMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        q_dtype = q.dtype
        rotated = isinstance(kv_cache, QuantizedKVCache)
        if rotated:
            rotate = self.kernel.hadamard   # rotation.rotate's R by a fast Walsh-Hadamard transform
            q = rotate(q.float())
            self.kernel.write_kv_quantized_(kv_cache.values, kv_cache.scales, meta.slot_mapping, rotate(k.float()),
                                            rotate(v.float()))
            values, scales = kv_cache.values, kv_cache.scales
        else:
            self.kernel.write_kv_(kv_cache, meta.slot_mapping, k, v)
            values, scales = kv_cache, None
        s = meta.shared
        if sliding_window is not None and meta.shared_len > sliding_window:
            s = None  # some grouped sequence's window begins inside the shared prefix
        cascade = (s.seqs, s.starts, s.blocks) if s else (None, None, None)
        # NOTE: the kernel takes and returns float32 queries; a bf16 model's are widened and the result rounded
        # back (a copy of q, small beside the K/V it reads).
        out = self.kernel.paged_attention(q.float().contiguous(), values, meta.block_table, meta.seq_lens, scale,
                                          meta.query_start, scales, *cascade, sliding_window or 0,
                                          logits_soft_cap or 0.0, self.fixed_order)
        if rotated:
            out = self.kernel.hadamard(out)
        return out if out.dtype == q_dtype else out.to(q_dtype)


def _per_token_metadata(common: CommonAttentionMetadata) -> CPUPagedMetadata:
    """One sequence per query token, ending at that token's position, reading its request's block table."""
    loc = common.query_start_loc
    q_lens = loc.diff()                                                                  # [B]
    num_tokens = int(loc[-1])
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)                     # [T]
    offsets = torch.arange(num_tokens) - loc[req]                                        # [T]
    lens = common.seq_lens[req] - q_lens[req] + offsets + 1                              # [T]
    table = common.block_table[req].contiguous()                                         # [T, max_blocks]
    return CPUPagedMetadata(common.slot_mapping, table, lens.contiguous(), torch.arange(num_tokens + 1), None)
