"""Sliding windows and logit soft caps in the CPU attention backends: cpu_paged's C++ kernel and torch_ref (the
oracle) against dense masked attention, on mixed steps (decodes, draft-verifying rows, prefill chunks after
context) whose blocks before each window are poisoned (a kernel that reads a freed block returns NaN): windows
below the block size, not a multiple of it and beyond every sequence, GQA, soft cap on and off, a quantized
cache, decodes split over threads, and shared-prefix groups."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from tests.helpers.windowed_attention import dense_windowed, windowed_step

# decodes (one with a draft-verifying run of 3 rows), then chunks: a fresh prompt, chunks after context, one
# long enough for several query tiles
DECODES = [(40, 1), (3, 1), (70, 3)]
PREFILLS = [(0, 37), (50, 20), (20, 140)]
WINDOWS = [1, 5, 16, 23, 1000]


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged attention kernel")
    return kernel


def _backend(name: str):
    return CPUPagedBackend(_kernel_or_skip()) if name == "cpu_paged" else TorchRefBackend()


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size, hq, hkv, d", [(16, 4, 2, 64), (8, 8, 1, 32), (16, 4, 4, 32)])
def test_mixed_step_matches_dense(backend, window, soft_cap, block_size, hq, hkv, d):
    """Head dims 64 and 32 and block sizes 16 and 8 take the kernel's three inner paths (rows in vector lanes,
    transposed blocks, decode dot products)."""
    be = _backend(backend)
    step = windowed_step(window + block_size + hq, DECODES, PREFILLS, block_size=block_size, hq=hq, hkv=hkv, d=d,
                         window=window)
    assert window > 30 or step.poisoned > 0
    out = be.forward(step.q, step.k, step.v, step.cache, be.build_metadata(step.common), d ** -0.5,
                     sliding_window=window, logits_soft_cap=soft_cap)
    torch.testing.assert_close(out, dense_windowed(step, d ** -0.5, window, soft_cap), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
@pytest.mark.parametrize("window", [5, 23])
def test_table_entries_before_the_window_are_not_read(backend, window):
    """Freed blocks' table entries holding -1 (no block at all): nothing reads them, not even as padding."""
    be = _backend(backend)
    step = windowed_step(window, DECODES, PREFILLS, block_size=8, hq=4, hkv=2, d=64, window=window, stale_id=-1,
                         shared_blocks=2)
    assert (step.common.block_table == -1).any()
    out = be.forward(step.q, step.k, step.v, step.cache, be.build_metadata(step.common), 0.125,
                     sliding_window=window)
    torch.testing.assert_close(out, dense_windowed(step, 0.125, window, None), atol=2e-5, rtol=1e-5)


def test_soft_cap_and_window_change_the_result():
    """Guards the comparison above: the cap and the window are not no-ops on these steps."""
    step = windowed_step(0, DECODES, PREFILLS, block_size=16, hq=4, hkv=2, d=64, window=None)
    plain = dense_windowed(step, 0.125, None, None)
    assert (dense_windowed(step, 0.125, None, 2.0) - plain).abs().max() > 1e-2
    assert (dense_windowed(step, 0.125, 23, None) - plain).abs().max() > 1e-2


def test_window_beyond_every_sequence_is_full_attention():
    """W >= every sequence's length: the same numbers as no window at all, on the kernel."""
    kernel = _kernel_or_skip()
    step = windowed_step(1, DECODES, PREFILLS, block_size=16, hq=4, hkv=2, d=64, window=None)
    be = CPUPagedBackend(kernel)
    meta = be.build_metadata(step.common)
    full = be.forward(step.q, step.k, step.v, step.cache, meta, 0.125)
    torch.testing.assert_close(be.forward(step.q, step.k, step.v, step.cache, meta, 0.125, sliding_window=300),
                               full, atol=0, rtol=0)


@pytest.mark.parametrize("window", [5, 23])
def test_bf16_cache(window):
    be = CPUPagedBackend(_kernel_or_skip())
    step = windowed_step(window, DECODES, PREFILLS, block_size=16, hq=4, hkv=2, d=64, window=window,
                         dtype=torch.bfloat16)
    out = be.forward(step.q, step.k, step.v, step.cache, be.build_metadata(step.common), 0.125,
                     sliding_window=window, logits_soft_cap=2.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_windowed(step, 0.125, window, 2.0), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("window", [5, 23])
@pytest.mark.parametrize("d", [32, 64])
def test_quantized_cache_matches_dense(dtype, soft_cap, window, d):
    """An int8/fp8 cache (one scale per block; the poisoned block's scales NaN), read by the kernel through the
    backend's per-request sequences, against dense attention over what the cache holds."""
    kernel = _kernel_or_skip()
    step = windowed_step(d + window, DECODES, PREFILLS, block_size=16, hq=4, hkv=2, d=d, window=window)
    values, scales = step.quantized(dtype)
    meta = CPUPagedBackend(kernel).build_metadata(step.common)
    out = kernel.paged_attention(step.q, values, meta.block_table, meta.seq_lens, d ** -0.5, meta.query_start,
                                 scales, sliding_window=window, soft_cap=soft_cap or 0.0)
    torch.testing.assert_close(out, dense_windowed(step, d ** -0.5, window, soft_cap), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("window", [40, 150, 1000])
@pytest.mark.parametrize("rows", [1, 2])
def test_decode_split_over_threads(threads, window, rows):
    """One long decode split over threads (ranges of the window's blocks, merged by log-sum-exp)."""
    be = CPUPagedBackend(_kernel_or_skip())
    step = windowed_step(threads + window, [(400, rows)], [], block_size=16, hq=8, hkv=2, d=64, window=window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = be.forward(step.q, step.k, step.v, step.cache, be.build_metadata(step.common), 0.125,
                         sliding_window=window, logits_soft_cap=3.0)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, dense_windowed(step, 0.125, window, 3.0), atol=2e-5, rtol=1e-5)


# several requests behind a 4-block cached prefix: decodes and a chunk, all shorter than 100 tokens
SHARED_DECODES = [(70, 1), (81, 1), (66, 2)]
SHARED_PREFILLS = [(64, 30)]


@pytest.mark.parametrize("window", [100, 90, 20])
def test_shared_prefix_groups_under_a_window(window):
    """A windowed layer reads a shared prefix once while every grouped sequence fits in the window, and each
    sequence's own blocks past that (the groups found for the step stay for its full-attention layers)."""
    be = CPUPagedBackend(_kernel_or_skip())
    step = windowed_step(window, SHARED_DECODES, SHARED_PREFILLS, block_size=16, hq=8, hkv=2, d=64,
                         window=window, shared_blocks=4)
    meta = be.build_metadata(step.common)
    if window >= 94:
        assert meta.shared is not None and meta.shared_len <= window
    out = be.forward(step.q, step.k, step.v, step.cache, meta, 0.125, sliding_window=window)
    torch.testing.assert_close(out, dense_windowed(step, 0.125, window, None), atol=2e-5, rtol=1e-5)


def test_kernel_refuses_shared_prefixes_longer_than_the_window():
    kernel = _kernel_or_skip()
    step = windowed_step(0, SHARED_DECODES, SHARED_PREFILLS, block_size=16, hq=8, hkv=2, d=64, window=None,
                         shared_blocks=4)
    meta = CPUPagedBackend(kernel).build_metadata(step.common)
    s = meta.shared
    with pytest.raises(RuntimeError, match="sliding window"):
        kernel.paged_attention(step.q, step.cache, meta.block_table, meta.seq_lens, 0.125, meta.query_start, None,
                               s.seqs, s.starts, s.blocks, sliding_window=50)
    with pytest.raises(RuntimeError, match=">= 0"):
        kernel.paged_attention(step.q, step.cache, meta.block_table, meta.seq_lens, 0.125, meta.query_start,
                               soft_cap=-1.0)
