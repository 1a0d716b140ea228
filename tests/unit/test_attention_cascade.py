"""The paged attention kernel on whole mixed steps (decodes, draft rows and prefill chunks in one call) and with
shared-prefix (cascade) groups, against dense attention over each sequence's gathered (dequantized) K/V;
the grouping rule; and the engine with prefix-cache hits decoding together, against transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cascade import find_shared_prefixes
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv_cache.quant import dequantize, quantize_blocks

DTYPES = {"float32": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged attention kernel")
    return kernel


def _case(seed, block_size, hq, hkv, d, seqs, shared_blocks=0, dtype=None):
    """seqs: (context length, query length) per sequence. The first `shared_blocks` blocks of every sequence
    long enough are the same physical blocks (a cached prefix); the rest are scattered. Returns the kernel's
    inputs and each sequence's K/V [L, Hkv, D] as the cache holds them."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + q) // block_size) for c, q in seqs) + shared_blocks
    full = torch.randn(need + 2, block_size, 2, hkv, d, generator=g)
    values, scales = (full, None) if dtype is None else quantize_blocks(full, dtype)   # the engine's layout
    held = full if dtype is None else dequantize(values, scales[:, None].expand(-1, block_size, -1, -1))
    perm = torch.randperm(need + 2, generator=g).tolist()
    prefix = [perm.pop() for _ in range(shared_blocks)]
    tables = []
    for c, q in seqs:
        n = -(-(c + q) // block_size)
        own = prefix[:min(shared_blocks, c // block_size)]
        tables.append(own + [perm.pop() for _ in range(n - len(own))])
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    flat = held.view(-1, 2, hkv, d)
    kvs = []
    for t, (c, q) in zip(tables, seqs):
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c + q)])
        kvs.append(flat[slots])
    q = torch.randn(sum(q for _, q in seqs), hq, d, generator=g)
    starts = torch.tensor([0] + torch.tensor([q for _, q in seqs]).cumsum(0).tolist())
    lens = torch.tensor([c + q for c, q in seqs])
    return q, values, scales, table, lens, starts, kvs


def _dense(q, starts, seqs, kvs, scale):
    out = []
    for i, ((c, n), kv) in enumerate(zip(seqs, kvs)):
        qi = q[starts[i]:starts[i + 1]].transpose(0, 1)                     # [Hq, n, D]
        group = qi.shape[0] // kv.shape[2]
        k, v = (kv[:, x].repeat_interleave(group, dim=1).transpose(0, 1) for x in (0, 1))
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        out.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


# decodes, a draft-verifying request, chunks after context (across block boundaries and tiles), a fresh prompt
MIXED = [(20, 1), (99, 1), (0, 1), (40, 3), (30, 20), (100, 300), (7, 129), (0, 37)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 64), (8, 1, 64), (8, 2, 80), (4, 2, 128)])
def test_mixed_step_matches_dense(dtype, block_size, hq, hkv, d):
    kernel = _kernel_or_skip()
    q, values, scales, table, lens, starts, kvs = _case(block_size + hq + d, block_size, hq, hkv, d, MIXED,
                                                        dtype=DTYPES[dtype])
    out = kernel.paged_attention(q, values, table, lens, d ** -0.5, starts, scales)
    torch.testing.assert_close(out, _dense(q, starts, MIXED, kvs, d ** -0.5), atol=2e-5, rtol=1e-5)


# several sequences behind a 5-block prefix (decodes and chunks), one with a shorter context, one unrelated
SHARED = [(100, 1), (81, 1), (90, 3), (120, 40), (85, 200), (30, 1), (60, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(9, 3), (8, 1), (4, 4)])
def test_shared_prefix_groups_match_dense_and_the_ungrouped_kernel(dtype, hq, hkv):
    kernel = _kernel_or_skip()
    bs, d = 16, 64
    q, values, scales, table, lens, starts, kvs = _case(hq, bs, hq, hkv, d, SHARED, shared_blocks=5,
                                                        dtype=DTYPES[dtype])
    visible = [c // bs for c, _ in SHARED]
    shared = find_shared_prefixes(table.tolist(), visible)
    # the 30-token sequence shares only its first block: the group keeps the 5 blocks and leaves it out
    assert shared.starts.tolist() == [0, 5] and shared.blocks.tolist() == [5]
    assert sorted(shared.seqs.tolist()) == [0, 1, 2, 3, 4]
    grouped = kernel.paged_attention(q, values, table, lens, 0.125, starts, scales, shared.seqs, shared.starts,
                                     shared.blocks)
    alone = kernel.paged_attention(q, values, table, lens, 0.125, starts, scales)
    torch.testing.assert_close(grouped, alone, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(grouped, _dense(q, starts, SHARED, kvs, 0.125), atol=2e-5, rtol=1e-5)


def test_grouping_rule():
    # no shared first block, or nothing visible: no groups
    assert find_shared_prefixes([[1, 2], [3, 4]], [2, 2]) is None
    assert find_shared_prefixes([[1, 2], [1, 2]], [0, 2]) is None
    # capped by what every member may share (its blocks before its first query token)
    s = find_shared_prefixes([[1, 2, 3, 9], [1, 2, 3, 8], [5, 6]], [4, 2, 1])
    assert s.seqs.tolist() == [0, 1] and s.starts.tolist() == [0, 2] and s.blocks.tolist() == [2]
    # the length that saves the most reads: 3 members x 1 block (2 saved) < 2 members x 4 blocks (4 saved)
    s = find_shared_prefixes([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 7, 7, 7, 7]], [5, 5, 5])
    assert s.seqs.tolist() == [0, 1] and s.blocks.tolist() == [4]
    # two independent groups
    s = find_shared_prefixes([[1, 2], [4, 5], [1, 2], [4, 5]], [2, 2, 2, 2])
    assert s.seqs.tolist() == [0, 2, 1, 3] and s.starts.tolist() == [0, 2, 4] and s.blocks.tolist() == [2, 2]


def test_kernel_refuses_inconsistent_groups():
    kernel = _kernel_or_skip()
    q, values, _, table, lens, starts, _ = _case(0, 16, 4, 2, 64, [(40, 1), (40, 1)], shared_blocks=2)
    one = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="must begin with the same blocks"):
        kernel.paged_attention(q, values, table.flip(1).contiguous(), lens, 0.125, starts, None,
                               torch.tensor([0, 1]), one, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="must lie before every query token"):
        kernel.paged_attention(q, values, table, lens, 0.125, starts, None, torch.tensor([0, 1]), one,
                               torch.tensor([3]))
    with pytest.raises(RuntimeError, match="in no or several groups"):
        kernel.paged_attention(q, values, table, lens, 0.125, starts, None, torch.tensor([0, 0]), one,
                               torch.tensor([2]))
    with pytest.raises(RuntimeError, match="go together"):
        kernel.paged_attention(q, values, table, lens, 0.125, starts, None, torch.tensor([0, 1]))


def test_backend_finds_groups_and_matches_the_reference_backend():
    """forward() on a step whose decodes and a chunk share cached blocks equals torch_ref (gather + SDPA)."""
    cpu = CPUPagedBackend(_kernel_or_skip())
    bs, hq, hkv, d = 16, 9, 3, 64
    seqs = [(64, 1), (70, 1), (80, 1), (64, 24)]            # decodes first, then a chunk after the prefix
    q, cache, _, table, lens, starts, kvs = _case(3, bs, hq, hkv, d, seqs, shared_blocks=4)
    g = torch.Generator().manual_seed(9)
    k_new = torch.randn(len(q), hkv, d, generator=g)
    v_new = torch.randn(len(q), hkv, d, generator=g)
    tables = table.tolist()
    slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, (c, n) in enumerate(seqs)
                          for p in range(c, c + n)])
    common = CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=lens, block_table=table, slot_mapping=slots, num_decodes=3,
        num_decode_tokens=3, block_size=bs, query_lens_cpu=[n for _, n in seqs], seq_lens_cpu=lens.tolist())
    meta = cpu.build_metadata(common)
    assert meta.shared.seqs.tolist() == [0, 1, 2, 3] and meta.shared.blocks.tolist() == [4]
    assert CPUPagedBackend(cpu.kernel, cascade=False).build_metadata(common).shared is None
    ref_cache = cache.clone()
    out = cpu.forward(q, k_new, v_new, cache, meta, d ** -0.5)
    ref_backend = TorchRefBackend()
    ref = ref_backend.forward(q, k_new, v_new, ref_cache, ref_backend.build_metadata(common), d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_microbench_refuses_a_missing_baseline(capsys):
    from kvserve.attention.microbench import main

    assert main(["--baseline", "/nonexistent/kernel.cpp"]) == 2
    assert "no such file" in capsys.readouterr().err
