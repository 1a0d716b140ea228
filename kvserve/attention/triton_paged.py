"""triton_paged: the GPU attention backend (attention/triton_kernels.py): K/V written into their slots by one
kernel, then attention by one launch for the decodes and one for the prefill chunks, both reading the cache
in place through the block tables.

Same KV layout as the CPU backends (torch_ref.kv_cache_shape). Metadata is built once per step on the host
(the prefill tiles come from query_lens_cpu, no device sync), so no layer syncs with the host. The decode
launch needs nothing but device tensors of a fixed shape, which is what lets a CUDA graph capture a
decode-only step (worker/cuda_graph.py): a padded row there has slot -1 (its K/V are written nowhere) and
seq_len 0 (its output is zeros).

An int8/fp8 cache is not read by these kernels: the registry picks torch_ref for it.

Batch-invariant mode (`batch_invariant=True`, `--batch-invariant`): a token's attention output must not depend
on what else is in the step. The default launches break that twice: the decode launch splits KV by the
batch size and the SM count, and a prefill tile reduces 16 tokens together in a kernel compiled for that
tile. So in this mode there is one launch of the decode kernel over every query token of the step (PER_ROW:
each token with its own position and its request's block-table row) with a fixed number of splits (1 unless
`decode_splits` says otherwise): every row, whether a decode, a draft being verified or a row of a prefill
chunk, runs the same programs over the same pages in the same order, and the split bounds follow from its
position alone. Prefill rows then read their K/V once per token instead of once per tile: the price of the
mode on long prompts.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.torch_ref import kv_cache_scale_shape, kv_cache_shape
from kvserve.kv_cache.quant import QuantizedKVCache

# Query tokens per prefill program (its rows: these tokens x the G query heads of its KV head), and the
# fewest rows of any program: tl.dot on the GPU wants each side at least 16.
_PREFILL_TOKENS = 16
_MIN_ROWS = 16
_MAX_SPLITS = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
HEAD_DIMS = (64, 128)
"""Head dims of the supported models; the kernels take any (padded to a power of two), tests use smaller."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor       # [T] int64; -1: write nowhere
    query_start_loc: torch.Tensor    # [B + 1] int64
    seq_lens: torch.Tensor           # [B] int64
    block_table: torch.Tensor        # [B, max_blocks] int64
    block_size: int
    num_decodes: int                 # requests [0, num_decodes) have one query token each
    tile_req: torch.Tensor | None    # [N] int64: request of each prefill tile
    tile_q0: torch.Tensor | None     # [N] int64: its first query index within the request
    block_q: int                     # query tokens per prefill tile
    rows: TokenRows | None = None    # batch-invariant mode: every query token as a decode of its own


@dataclass
class TokenRows:
    """Batch-invariant mode: query token i as a one-token request (the decode kernel's PER_ROW inputs)."""

    starts: torch.Tensor      # [T + 1] int64: 0..T
    seq_lens: torch.Tensor    # [T] int64: the token's position + 1
    table_rows: torch.Tensor  # [T] int64: its request's row of the block table


def token_rows(common: CommonAttentionMetadata) -> TokenRows:
    """Every query token of the step as a decode at its position, computed on the host (no device sync)."""
    lens = np.asarray(common.query_lens_cpu, dtype=np.int64)
    if common.num_decodes == len(lens):
        # NOTE: a decode-only step's tokens are its requests and query_start_loc is 0..B: views of the step's
        # tensors, no copy, so a CUDA graph captured on the decode buffers keeps reading the live values.
        qsl = common.query_start_loc
        return TokenRows(qsl, common.seq_lens, qsl[:-1])
    req = np.repeat(np.arange(len(lens)), lens)
    first = np.repeat(np.cumsum(lens) - lens, lens)
    ctx = np.asarray(common.seq_lens_cpu, dtype=np.int64) - lens
    pos = ctx[req] + np.arange(int(lens.sum())) - first
    t = len(pos)
    # NOTE: one host-to-device copy of both arrays, each row padded to an even length so that both start
    # 16-byte aligned: Triton compiles a kernel per pointer alignment, and one kernel serves every step.
    packed = np.zeros((2, t + t % 2), dtype=np.int64)
    packed[0, :t], packed[1, :t] = pos + 1, req
    device = common.seq_lens.device
    rows = torch.from_numpy(packed).to(device)
    return TokenRows(torch.arange(t + 1, device=device), rows[0, :t], rows[1, :t])


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def prefill_tiles(query_lens: list[int], num_decodes: int, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, first query index) of every tile of block_q query tokens of the requests after the decodes."""
    lens = np.asarray(query_lens[num_decodes:], dtype=np.int64)
    counts = -(-lens // block_q)                                              # tiles per request
    req = np.repeat(np.arange(num_decodes, num_decodes + len(lens)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    q0 = (np.arange(int(counts.sum())) - first) * block_q
    return req, q0


class TritonPagedBackend:
    """`kernels`: the kernels module (tests pass one imported under TRITON_INTERPRET=1); default: imported."""

    name = "triton_paged"
    supports_cuda_graphs = True

    def __init__(self, kernels=None, decode_splits: int | None = None, batch_invariant: bool = False):
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"triton_paged: decode_splits must be at least 1, got {decode_splits}")
        self.kernels = kernels or importlib.import_module("kvserve.attention.triton_kernels")
        self.decode_splits = (decode_splits or 1) if batch_invariant else decode_splits
        """Split-KV ways of the decode launch; None: chosen from the batch and the device's SM count. In
        batch-invariant mode every query token's keys are read in this many ways (1 unless given): the split
        bounds then depend on the token's position alone, never on the batch (the partial results take
        tokens x splits x heads x head_dim float32 of scratch per step, prefill rows included)."""
        self.batch_invariant = batch_invariant

    def num_decode_splits(self, num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
        """Enough (request, KV head, split) programs for about two per SM, at most _MAX_SPLITS. It depends on
        the batch size alone (not on sequence lengths), so a CUDA graph of a batch size keeps it."""
        if self.decode_splits is not None:
            return self.decode_splits
        if device.type != "cuda":
            return 1
        programs = num_decodes * num_kv_heads
        return max(1, min(_MAX_SPLITS, -(-2 * _sm_count(device) // programs)))

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        return kv_cache_scale_shape(num_blocks, block_size, num_kv_heads)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonMetadata:
        nd = common.num_decodes
        if self.batch_invariant:
            return TritonMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens, common.block_table,
                                  common.block_size, nd, None, None, 1, rows=token_rows(common))
        # NOTE: tiles are cut in tokens, not rows: the GQA group is known only in forward, whose programs
        # have block_q x group rows.
        block_q = _PREFILL_TOKENS
        tile_req = tile_q0 = None
        if len(common.query_lens_cpu) > nd:
            req, q0 = prefill_tiles(common.query_lens_cpu, nd, block_q)
            dev = common.seq_lens.device
            tile_req, tile_q0 = torch.from_numpy(req).to(dev), torch.from_numpy(q0).to(dev)
        return TritonMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens, common.block_table,
                              common.block_size, nd, tile_req, tile_q0, block_q)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                meta: TritonMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        if isinstance(kv_cache, QuantizedKVCache):
            raise ValueError("triton_paged reads an unquantized KV cache only (use torch_ref for int8/fp8)")
        kern = self.kernels
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        block_d = _next_pow2(head_dim)
        kern.reshape_and_cache_kernel[(num_tokens,)](
            k, v, kv_cache, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=block_d)
        out = torch.empty_like(q)                                             # [T, Hq, D]
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        common = (out, q, kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens)
        scalars = (scale, sliding_window or 0, float(logits_soft_cap or 0.0), q.stride(0), q.stride(1),
                   out.stride(0), out.stride(1), meta.block_table.stride(0))
        consts = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                      PAGE=meta.block_size, DOT_PRECISION=precision, WINDOWED=sliding_window is not None,
                      SOFT_CAP=logits_soft_cap is not None)
        if meta.rows is not None:
            r = meta.rows
            self._decode_launch((out, q, kv_cache, meta.block_table, r.starts, r.seq_lens, r.table_rows), num_tokens,
                                self.decode_splits, True, scalars, consts)
            return out
        nd = meta.num_decodes
        if nd:
            self._decode_launch((*common, meta.seq_lens), nd, self.num_decode_splits(nd, num_kv_heads, q.device),
                                False, scalars, consts)
        if meta.tile_req is not None:
            kern.paged_attention_kernel[(meta.tile_req.shape[0], num_kv_heads, 1)](
                *common, meta.tile_req, meta.tile_q0, out, out, *scalars,
                BLOCK_M=max(_MIN_ROWS, _next_pow2(meta.block_q * group)), BLOCK_Q=meta.block_q, DECODE=False,
                NUM_SPLITS=1, **consts)
        return out

    def _decode_launch(self, args: tuple, n: int, splits: int, per_row: bool, scalars: tuple, consts: dict) -> None:
        """The decode kernel over n rows (requests, or with per_row the step's tokens), `splits` ways each,
        then the splits' combination. args: out, q, kv_cache, block_table, query_start, seq_lens, tile_req."""
        kern = self.kernels
        out, q = args[0], args[1]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = consts["NUM_KV_HEADS"]
        part_out = part_lse = out  # unused with one split
        if splits > 1:
            part_out = torch.empty((n, splits, num_heads, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((n, splits, num_heads), dtype=torch.float32, device=q.device)
        kern.paged_attention_kernel[(n, num_kv_heads, splits)](
            *args, args[5], part_out, part_lse, *scalars, BLOCK_M=max(_MIN_ROWS, _next_pow2(consts["GROUP"])),
            BLOCK_Q=1, DECODE=True, NUM_SPLITS=splits, PER_ROW=per_row, **consts)
        if splits > 1:
            kern.decode_combine_kernel[(n, num_heads)](
                out, part_out, part_lse, args[4], out.stride(0), out.stride(1), NUM_HEADS=num_heads,
                HEAD_DIM=head_dim, BLOCK_D=consts["BLOCK_D"], NUM_SPLITS=splits, BLOCK_S=_next_pow2(splits))
