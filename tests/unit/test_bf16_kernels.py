"""--dtype bfloat16's numbers on the CPU: the paged decode kernel on a bf16 cache against a dense reference, and the
fused layer ops in bf16 against float32 math rounded once. (The model and the engine in bf16:
tests/engine/test_bf16.py.)"""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.models.layer_ops import LayerOps, load_fused_layer_ops
from tests.helpers.oracles import dense_decode
from tests.helpers.paged_cache import scatter_sequences


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged decode kernel")
    return kernel


# --------------------------------------------------------------------------- the decode kernel


def test_kernel_reads_every_bf16_value_exactly():
    """A one-token context's output is its V row: every finite bf16 bit pattern comes back as its float."""
    kernel = _kernel_or_skip()
    codes = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = codes[codes.float().isfinite()]
    d = 64
    rows = -(-codes.numel() // d)
    v = torch.zeros(rows * d, dtype=torch.bfloat16)
    v[:codes.numel()] = codes
    cache = torch.zeros(rows, 1, 2, 1, d, dtype=torch.bfloat16)    # one block of one slot per sequence
    cache[:, 0, 1, 0] = v.view(rows, d)
    out = kernel.paged_decode_attention(torch.randn(rows, 1, d), cache, torch.arange(rows)[:, None],
                                        torch.ones(rows, dtype=torch.int64), 0.125)
    torch.testing.assert_close(out[:, 0], v.float().view(rows, d), atol=0, rtol=0)


def _bf16_case(block_size, num_heads, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    flat = cache.view(-1, 2, num_kv_heads, head_dim).float()
    q, table, seq_lens, tables, ks, vs = scatter_sequences(flat, num_blocks, block_size, num_heads, head_dim, g)
    return q, cache, table, seq_lens, tables, ks, vs


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim",
                         [(16, 9, 3, 64), (32, 8, 1, 64), (16, 4, 4, 128), (16, 9, 3, 80)])
def test_kernel_on_bf16_cache_matches_dense(block_size, num_heads, num_kv_heads, head_dim):
    kernel = _kernel_or_skip()
    q, cache, table, seq_lens, _, ks, vs = _bf16_case(block_size, num_heads, num_kv_heads, head_dim,
                                                      seed=block_size + head_dim)
    scale = head_dim ** -0.5
    out = kernel.paged_decode_attention(q, cache, table, torch.tensor(seq_lens), scale)
    torch.testing.assert_close(out, dense_decode(q, ks, vs, scale), atol=1e-5, rtol=1e-5)
    queries = [1, 1, 3, 2, 4]   # draft verification rows on a bf16 cache equal each row decoded alone
    q = torch.randn(sum(queries), num_heads, head_dim)
    starts = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    grouped = kernel.paged_decode_attention(q, cache, table, torch.tensor(seq_lens), scale, starts)
    rows = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor(queries))
    own = torch.tensor([n - (k - 1 - j) for n, k in zip(seq_lens, queries) for j in range(k)])
    alone = kernel.paged_decode_attention(q, cache, table[rows].contiguous(), own, scale)
    torch.testing.assert_close(grouped, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_backend_decode_on_bf16_cache(use_kernel):
    """forward() with bf16 q/k/v writes the token's K/V into the bf16 cache and attends over it; both backends
    equal the dense float32 reference on the cache's values to bf16 output precision."""
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    bs, hq, hkv, d = 16, 9, 3, 64
    q, cache, table, seq_lens, tables, _, _ = _bf16_case(bs, hq, hkv, d, seed=3)
    q = q.to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    k_new, v_new = (torch.randn(len(seq_lens), hkv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, seq_lens)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens), block_table=table,
        slot_mapping=slots, num_decodes=len(seq_lens), num_decode_tokens=len(seq_lens), block_size=bs,
        query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens)
    out = backend.forward(q, k_new, v_new, cache, backend.build_metadata(common), d ** -0.5)
    assert out.dtype == torch.bfloat16
    flat = cache.view(-1, 2, hkv, d)
    assert torch.equal(flat[slots, 0], k_new) and torch.equal(flat[slots, 1], v_new)
    ks, vs = [], []
    for t, n in zip(tables, seq_lens):
        s = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)])
        ks.append(flat[s, 0].float())
        vs.append(flat[s, 1].float())
    ref = dense_decode(q.float(), ks, vs, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


# --------------------------------------------------------------------------- the fused layer ops


def _fused_or_skip():
    fused = load_fused_layer_ops()
    if fused is None:
        pytest.skip("the C++ extension does not build here")
    return fused


def _bf16_close(got, want_fp32):
    """Computed in float and rounded once: within one bf16 rounding of the float32 result."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want_fp32, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 300])
def test_fused_ops_in_bf16(rows):
    fused = _fused_or_skip()
    torch.manual_seed(rows)
    x, res, w = (torch.randn(rows, 96).bfloat16(), torch.randn(rows, 96).bfloat16(), torch.randn(96).bfloat16())
    got_x, got_res = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(got_res, x + res)            # the residual stream stored in bf16, as transformers does
    want_x, _ = LayerOps.add_rms_norm(got_res.float(), None, w.float(), 1e-5)
    _bf16_close(got_x, want_x)

    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).bfloat16()
    angles = torch.randn(rows, d // 2).repeat(1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = fused.rope_qk(qkv.clone(), cos, sin, heads + kv_heads, d)
    _bf16_close(got, LayerOps.rope_qk(qkv.float(), cos.float(), sin.float(), heads + kv_heads, d))

    gate_up = torch.randn(rows, 2 * 40 + 8).bfloat16()[:, :80]   # a row-strided view
    _bf16_close(fused.silu_and_mul(gate_up), LayerOps.silu_and_mul(gate_up.float()))
    _bf16_close(fused.gelu_tanh_and_mul(gate_up), LayerOps.gelu_tanh_and_mul(gate_up.float()))


def test_fused_ops_refuse_mixed_dtypes():
    fused = _fused_or_skip()
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        fused.add_rms_norm(x, x.clone(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))
