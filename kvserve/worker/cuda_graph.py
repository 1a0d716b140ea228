"""CUDA graphs for decode-only steps: one graph per size of a ladder of padded batch sizes, captured once after
the KV cache exists; a decode-only step of n requests replays the smallest captured size >= n.

A step's inputs are copied into static buffers (the graphs read only those); the rows past n are padding:
token 0 at position 0, KV slot -1 (written nowhere) and sequence length 0 (attention output zeros), so a
padded row touches no request's cache and its hidden state is dropped. Mixed steps (prefill chunks),
steps verifying drafts, and batches above the ladder run eagerly, as does everything with
`--enforce-eager`. Only a backend whose metadata is views of the step's tensors with no host-side shape
in it (`supports_cuda_graphs`, attention/triton_paged.py) can be captured.

Nothing here runs without CUDA; the ladder, the bucket choice and the padding are plain functions, tested
on CPU.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend, CommonAttentionMetadata

logger = logging.getLogger("kvserve")

MAX_CAPTURE_SIZE = 512
"""Largest decode batch captured (vLLM's default cap); bigger batches run eagerly."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The ladder (vLLM's): 1, 2, 4, then every multiple of 8, up to the first size covering max_num_seqs
    (capped at MAX_CAPTURE_SIZE)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    # the first rung at or above top: a batch of max_num_seqs always has a graph (below the cap)
    sizes.append(next(s for s in (1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 8, 8)) if s >= top))
    return sizes


def bucket_for(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds num_reqs rows; None: run eagerly."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeGraphBuffers:
    """The static inputs every graph reads, sized for the largest one."""

    input_ids: torch.Tensor         # [N] int64
    positions: torch.Tensor         # [N] int64
    slot_mapping: torch.Tensor      # [N] int64; -1 on padded rows
    seq_lens: torch.Tensor          # [N] int64; 0 on padded rows
    query_start_loc: torch.Tensor   # [N + 1] int64: 0, 1, ..., N (one query token per row), never changes
    block_table: torch.Tensor       # [N, max_blocks] int64

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> "DecodeGraphBuffers":
        def z(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)
        return cls(z(max_size), z(max_size), torch.full((max_size,), -1, dtype=torch.int64, device=device),
                   z(max_size), torch.arange(max_size + 1, dtype=torch.int64, device=device), z(max_size, max_blocks))

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, attn: CommonAttentionMetadata) -> None:
        """This step's n = len(input_ids) decode rows, then padding up to `size` (device-to-device copies)."""
        n = input_ids.shape[0]
        width = attn.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.block_table[:n, :width].copy_(attn.block_table)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()

    def metadata(self, size: int, block_size: int) -> CommonAttentionMetadata:
        """Views of the first `size` rows: what a graph of that size is captured with."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size], num_decodes=size,
            num_decode_tokens=size, block_size=block_size, query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size)


def graphable(attn: CommonAttentionMetadata, num_tokens: int, max_blocks: int) -> bool:
    """A decode-only step (one query token per request, no drafts) whose block tables fit the buffers."""
    return (attn.num_decodes == num_tokens and len(attn.query_lens_cpu) == num_tokens
            and attn.decode_groups is None and attn.block_table.shape[1] <= max_blocks)


class CudaGraphRunner:
    """Captures `model` over the decode ladder and replays it; `run` returns None where a step runs eagerly."""

    def __init__(self, model, backend: AttentionBackend, kv_caches: list, max_num_seqs: int, max_blocks: int,
                 block_size: int, device: torch.device):
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {backend.name} cannot be captured in a CUDA graph")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeGraphBuffers.allocate(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        meta = self.backend.build_metadata(b.metadata(size, self.block_size))
        return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        # NOTE: largest first, so the smaller graphs reuse the memory the largest one's pool already holds.
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, cuBLAS picks kernels
                self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.1f MiB",
                    len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - start, used / 2**20)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: CommonAttentionMetadata) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only step by replay; None: not graphable, run it eagerly.
        The tensor is the graph's own output: read it before the next replay."""
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        if size is None or not graphable(attn, n, self.buffers.block_table.shape[1]):
            return None
        self.buffers.fill(size, input_ids, positions, attn)
        graph, out = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return out[:n]
