"""Shared-prefix (cascade) attention groups: sequences of one step whose block tables begin with the same blocks.

With prefix caching, requests that share a prompt prefix (a system prompt, few-shot examples) point at the same
physical blocks for it. The paged kernel then reads those blocks once for the query rows of the whole group
and merges that partial attention with each sequence's own part by log-sum-exp (FlashInfer's cascade
attention, vLLM's `cascade_attn`): on a memory-bound decode step the shared K/V costs one read instead of one
per request.

Grouping is one level deep (as in vLLM's, unlike FlashInfer's multi-level cascade): sequences are grouped by
their first block, and a group keeps the prefix length that saves the most block reads; members that share
less with the rest are left to read their blocks alone.

Sliding windows: a shared block is read once for all the group's query rows, so it must lie inside every one
of their windows. The groups are found once per step (windows differ per layer), and a windowed layer keeps
them only while every grouped sequence is no longer than its window (then the window hides nothing from them);
otherwise that layer reads each sequence alone from its window's first block (attention/cpu_paged.py). Simple
and correct; a Mistral-style model whose sequences outgrow the window loses the shared read on those steps.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixes:
    """Group c is the sequences seqs[starts[c]:starts[c+1]]; their block tables begin with the same
    blocks[c] blocks, all before every one of their query tokens."""

    seqs: torch.Tensor     # [N] int64 sequence indices, grouped
    starts: torch.Tensor   # [C + 1] int64
    blocks: torch.Tensor   # [C] int64


def find_shared_prefixes(tables: list[list[int]], visible_blocks: list[int]) -> SharedPrefixes | None:
    """`tables[b]`: sequence b's block ids; `visible_blocks[b]`: how many of its leading blocks lie entirely
    before its first query token (only those can be shared: every query row sees all of a shared block).
    None when no two sequences share a block."""
    by_first = defaultdict(list)
    for b, (row, n) in enumerate(zip(tables, visible_blocks)):
        if n > 0:
            by_first[row[0]].append(b)
    seqs, starts, blocks = [], [0], []
    for members in by_first.values():
        if len(members) < 2:
            continue
        lead = tables[members[0]]
        lcp = {}  # member -> blocks it shares with the first member (capped by what both may share)
        for b in members:
            row, cap = tables[b], min(visible_blocks[b], visible_blocks[members[0]])
            n = 0
            while n < cap and row[n] == lead[n]:
                n += 1
            lcp[b] = n
        # The prefix length that saves the most reads: (members sharing it - 1) * its length.
        best = max(sorted(set(lcp.values())), key=lambda n: (sum(v >= n for v in lcp.values()) - 1) * n)
        group = [b for b in members if lcp[b] >= best]
        if len(group) >= 2 and best > 0:
            seqs += group
            starts.append(len(seqs))
            blocks.append(best)
    if not blocks:
        return None
    return SharedPrefixes(torch.tensor(seqs), torch.tensor(starts), torch.tensor(blocks))
