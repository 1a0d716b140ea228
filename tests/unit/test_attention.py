"""Attention backends: the C++ paged decode kernel and the PyTorch gather path agree with a dense reference,
over random block tables, GQA ratios, ragged lengths and block sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.prefill import write_kv
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv_cache.quant import dequantize, quantize_blocks
from tests.helpers.oracles import dense_decode


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged decode kernel")
    return kernel


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_paged_decode_matches_dense(block_size, num_heads, num_kv_heads, use_kernel):
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    g = torch.Generator().manual_seed(block_size + num_heads)
    head_dim, num_blocks = 64, 40
    seq_lens = [1, 17, block_size, 3 * block_size + 5, 100]
    cache = torch.randn(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()   # scattered, non-contiguous block ids
    tables, ks, vs = [], [], []
    flat = cache.view(-1, 2, num_kv_heads, head_dim)
    for n in seq_lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        ks.append(flat[slots, 0].clone())
        vs.append(flat[slots, 1].clone())
    # the decode token's own K/V is written by forward(): use the last position's slot
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    k_new = torch.stack([k[-1] for k in ks])
    v_new = torch.stack([v[-1] for v in vs])
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slot_mapping = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                                 for t, n in zip(tables, seq_lens)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens), block_table=block_table,
        slot_mapping=slot_mapping, num_decodes=len(seq_lens), num_decode_tokens=len(seq_lens),
        block_size=block_size, query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens)
    out = backend.forward(q, k_new, v_new, cache, backend.build_metadata(common), head_dim ** -0.5)
    torch.testing.assert_close(out, dense_decode(q, ks, vs, head_dim ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ctx, q_len", [(30, 20), (0, 300), (100, 300), (0, 128), (7, 129)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_prefill_chunk_matches_dense(ctx, q_len, use_kernel):
    """Chunks are split into query tiles that each see keys up to their own end; any split must equal
    one dense causal attention."""
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    g = torch.Generator().manual_seed(ctx + q_len)
    bs, hkv, hq, d = 16, 2, 4, 32
    n = ctx + q_len
    num_blocks = -(-n // bs)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks + 3, bs, hkv, d))
    k_all, v_all = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    q = torch.randn(q_len, hq, d, generator=g)
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks].tolist()
    slot = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    cache.view(-1, 2, hkv, d)[slot[:ctx], 0] = k_all[:ctx]
    cache.view(-1, 2, hkv, d)[slot[:ctx], 1] = v_all[:ctx]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, q_len]), seq_lens=torch.tensor([n]), block_table=torch.tensor([table]),
        slot_mapping=slot[ctx:], num_decodes=0, num_decode_tokens=0, block_size=bs, query_lens_cpu=[q_len],
        seq_lens_cpu=[n])
    out = backend.forward(q, k_all[ctx:], v_all[ctx:], cache, backend.build_metadata(common), d ** -0.5)
    mask = torch.arange(n)[None, :] <= torch.arange(ctx, n)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k_all.repeat_interleave(2, 1).transpose(0, 1),
                                         v_all.repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask,
                                         scale=d ** -0.5).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4)])
def test_paged_decode_kernel_with_several_queries_per_sequence(block_size, num_heads, num_kv_heads):
    """Requests verifying drafts: each sequence's consecutive query tokens in one kernel task (K/V read once)
    equal each token run as its own decode (context up to its own position), across block boundaries."""
    kernel = _kernel_or_skip()
    g = torch.Generator().manual_seed(block_size * num_heads)
    head_dim, num_blocks = 64, 64
    cache = torch.randn((num_blocks, block_size, 2, num_kv_heads, head_dim), generator=g)
    queries = [1, 5, 3, 2, 1]                  # per sequence
    seq_lens = [9, 4 * block_size + 1, 5, 2, 3 * block_size]  # of each sequence's last query
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(queries), num_heads, head_dim, generator=g)
    starts = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    grouped = kernel.paged_decode_attention(q, cache, table, torch.tensor(seq_lens), 0.125, starts)
    rows = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor(queries))
    own = torch.tensor([n - (k - 1 - j) for n, k in zip(seq_lens, queries) for j in range(k)])
    alone = kernel.paged_decode_attention(q, cache, table[rows].contiguous(), own, 0.125)
    torch.testing.assert_close(grouped, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 130, 1000])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_queries", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_single_sequence_decode_split_over_threads(seq_len, threads, num_queries, cache_dtype):
    """Fewer decode sequences than threads: the kernel cuts a sequence's blocks into ranges, one per thread
    (4+ blocks each), and merges their partial softmaxes by log-sum-exp. Any cut must equal the dense
    reference (on the dequantized cache for int8), with one or two query rows (a verified draft), beside a
    second, short sequence or alone."""
    kernel = _kernel_or_skip()
    g = torch.Generator().manual_seed(seq_len + threads)
    bs, hkv, hq, d, num_blocks = 16, 3, 9, 64, 80
    cache = torch.randn((num_blocks, bs, 2, hkv, d), generator=g)
    scales = None
    if cache_dtype != torch.float32:
        values, scales = quantize_blocks(cache, cache_dtype)               # one scale per block: the engine's
        cache, values = dequantize(values, scales[:, None].expand(-1, bs, -1, -1)), values
    perm = torch.randperm(num_blocks, generator=g).tolist()
    lens = [seq_len] if threads != 3 else [seq_len, 5]   # with 3 threads, two sequences: the long one splits in 2
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    queries = [min(num_queries, n) for n in lens]
    q = torch.randn(sum(queries), hq, d, generator=g)
    starts = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel.paged_attention(q, cache if scales is None else values, table, torch.tensor(lens), d ** -0.5,
                                     starts, scales)
    finally:
        torch.set_num_threads(before)
    flat = cache.view(-1, 2, hkv, d)
    expected, row = [], 0
    for t, n, k in zip(tables, lens, queries):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)])
        for j in range(k):
            visible = slots[: n - (k - 1 - j)]
            expected.append(dense_decode(q[row:row + 1], [flat[visible, 0]], [flat[visible, 1]], d ** -0.5)[0])
            row += 1
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_kv_matches_index_copy(dtype):
    """The C++ kernel's write of a step's K/V (strided views into a fused qkv, as the model passes them) lands
    exactly where write_kv's torch.stack + index_copy_ puts them, and nowhere else."""
    kernel = _kernel_or_skip()

    torch.manual_seed(0)
    t, hq, hkv, d, blocks, bs = 7, 4, 2, 16, 5, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    _, k, v = qkv.view(t, -1, d).split_with_sizes([hq, hkv, hkv], dim=1)
    assert not k.is_contiguous()
    slots = torch.randperm(blocks * bs)[:t]
    ours = torch.randn(blocks, bs, 2, hkv, d).to(dtype)
    ref = ours.clone()
    kernel.write_kv_(ours, slots, k, v)
    write_kv(ref, slots, k, v)
    assert torch.equal(ours, ref)

    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv_(ours, torch.tensor([0, 1, 2, 3, 4, 5, blocks * bs]), k, v)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.write_kv_(ours, slots, k.float() if dtype == torch.bfloat16 else k.bfloat16(), v)
