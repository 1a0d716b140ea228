"""Steps of paged attention under a sliding window, for the kernel tests (CPU kernel, Triton): a mixed batch of
decodes, draft-verifying requests and prefill chunks over scattered blocks, and the dense reference.

The blocks wholly before a request's window (of its first query token) point at a poisoned block, as if the
KV manager had freed them and left a stale id: its K/V are NaN (a quantized cache's scales are), so a kernel
that reads one returns NaN."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.kv_cache.quant import dequantize, quantize_blocks


@dataclass
class WindowedStep:
    common: CommonAttentionMetadata
    cache: torch.Tensor        # [N, BS, 2, Hkv, D] every position's K/V; block N - 1 is the poisoned one
    q: torch.Tensor            # [T, Hq, D]
    k: torch.Tensor            # [T, Hkv, D] the query tokens' own K/V (already in the cache: writing them is a no-op)
    v: torch.Tensor
    slots: list[torch.Tensor]  # per request, the slots of its positions 0..L-1 (real blocks, not the poisoned one)
    query_lens: list[int]      # per request
    poisoned: int              # table entries pointing at the poisoned block

    def kvs(self) -> list[torch.Tensor]:
        """Per request, its K/V [L, 2, Hkv, D] as the cache holds them."""
        flat = self.cache.view(-1, *self.cache.shape[2:])
        return [flat[s] for s in self.slots]

    def quantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) of the cache quantized with one scale per block (the engine's layout; the poisoned
        block's scales NaN); `cache` becomes what they hold, dequantized."""
        values, scales = quantize_blocks(torch.nan_to_num(self.cache, nan=0.0), dtype)
        scales[-1] = float("nan")
        self.cache = dequantize(values, scales[:, None].expand(-1, values.shape[1], -1, -1))
        return values, scales


def windowed_step(seed: int, decodes: list[tuple[int, int]], prefills: list[tuple[int, int]], *, block_size: int,
                  hq: int, hkv: int, d: int, window: int | None, shared_blocks: int = 0,
                  dtype: torch.dtype = torch.float32, stale_id: int | None = None) -> WindowedStep:
    """decodes: (context, rows) per request, rows > 1 a request verifying drafts (one decode row per token);
    prefills: (context, query length) per request. The first `shared_blocks` blocks of every request whose
    context covers them are the same physical blocks (a cached prefix). Blocks wholly before the window of a
    request's first query token point at the poisoned block, or hold `stale_id` (such as -1: no block at all)."""
    g = torch.Generator().manual_seed(seed)
    reqs = decodes + prefills
    need = sum(-(-(c + n) // block_size) for c, n in reqs) + shared_blocks
    cache = torch.randn(need + 1, block_size, 2, hkv, d, generator=g)
    cache[need] = float("nan")
    perm = torch.randperm(need, generator=g).tolist()
    prefix = [perm.pop() for _ in range(shared_blocks)]
    tables, slots, poisoned = [], [], 0
    for c, n in reqs:
        own = prefix[:min(shared_blocks, c // block_size)]
        table = own + [perm.pop() for _ in range(-(-(c + n) // block_size) - len(own))]
        slots.append(torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c + n)]))
        gone = 0 if window is None else max(0, c - window + 1) // block_size
        poisoned += gone
        tables.append([need if stale_id is None else stale_id] * gone + table[gone:])
    common = _metadata(decodes, prefills, tables, block_size)
    cache = cache.to(dtype)
    rows = cache.view(-1, 2, hkv, d)[common.slot_mapping]                                  # [T, 2, Hkv, D]
    q = torch.randn(rows.shape[0], hq, d, generator=g).to(dtype)
    return WindowedStep(common, cache, q, rows[:, 0], rows[:, 1], slots, [n for _, n in reqs], poisoned)


def _metadata(decodes, prefills, tables, block_size) -> CommonAttentionMetadata:
    """The runner's layout: one row per decode token (a verifying request's rows repeat its table, each with its
    own length), then one per prefill request."""
    row_tables, seq_lens, query_lens, slots, groups = [], [], [], [], [0]
    for i, ((c, n), table) in enumerate(zip(decodes + prefills, tables)):
        is_decode = i < len(decodes)
        for j in range(n if is_decode else 1):
            row_tables.append(table)
            seq_lens.append(c + j + 1 if is_decode else c + n)
            query_lens.append(1 if is_decode else n)
        if is_decode:
            groups.append(groups[-1] + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max(len(t) for t in row_tables)
    num_decodes = sum(n for _, n in decodes)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0), seq_lens=torch.tensor(seq_lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in row_tables]), slot_mapping=torch.tensor(slots),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, block_size=block_size, query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens, decode_groups=torch.tensor(groups) if any(n > 1 for _, n in decodes) else None)


def dense_windowed(step: WindowedStep, scale: float, window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Each query token at position p over keys (p - W, p] of its request, in float64: [T, Hq, D] float32."""
    out, row = [], 0
    for kv, n in zip(step.kvs(), step.query_lens):
        length = kv.shape[0]
        q = step.q[row:row + n].double().transpose(0, 1)                                 # [Hq, n, D]
        group = q.shape[0] // kv.shape[2]
        k, v = (kv[:, x].double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (0, 1))
        s = q @ k.transpose(1, 2) * scale                                                 # [Hq, n, L]
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        k_pos, q_pos = torch.arange(length)[None, :], torch.arange(length - n, length)[:, None]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out.append((torch.softmax(s, -1) @ v).transpose(0, 1))
        row += n
    return torch.cat(out).float()
