"""Every C++ kernel, built for each instruction set this CPU runs (KVSERVE_CPU_ISA=avx512 | avx2 | scalar),
against its PyTorch reference on a small call: so that an AVX-512 machine (CI) tests the AVX2 and scalar paths
as well. Each variant is compared with the reference, never with another build, at the tolerance of float32
math in another order. The builds are shared with every other test through the kernel cache; all but the
CPU's best variant are `slow` (tests/helpers/kernels.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kv_cache.quant import quantize_blocks
from kvserve.layers.moe import experts_reference, select_experts
from kvserve.layers.moe_fused import quantize_experts
from kvserve.layers.quant import kernels as quant_kernels
from kvserve.layers.quant.common import pack_nibbles
from kvserve.layers.quant.int4 import quantize_int4
from kvserve.layers.quant.int8 import quantize_int8
from kvserve.models.layer_ops import FusedLayerOps, LayerOps
from tests.helpers.kernels import LANES, build_or_skip, isa_params
from tests.helpers.oracles import dense_decode
from tests.helpers.paged_cache import scatter_sequences

pytestmark = pytest.mark.parametrize("isa", isa_params())


def _attention_reference(q, k, v, scale, first_position):
    """Causal attention of queries at positions first_position.. over k/v [L, Hkv, D] (dense, PyTorch)."""
    positions = torch.arange(q.shape[0])[:, None] + first_position
    mask = torch.arange(k.shape[0])[None, :] <= positions
    qs, ks, vs = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[0]


def _rows(flat: torch.Tensor, tables: list[list[int]], seq_lens: list[int], bs: int):
    """Each sequence's K and V rows [L, Hkv, D] from the flat cache slots [slots, 2, Hkv, D]."""
    slots = [torch.tensor([t[p // bs] * bs + p % bs for p in range(n)]) for t, n in zip(tables, seq_lens)]
    return [flat[s, 0] for s in slots], [flat[s, 1] for s in slots]


def test_paged_attention(isa):
    m = build_or_skip("paged_attention", isa)
    g = torch.Generator().manual_seed(0)
    bs, hq, hkv, d, num_blocks = 16, 8, 2, 64, 40
    kv = torch.randn(num_blocks, bs, 2, hkv, d, generator=g)
    q, table, seq_lens, tables, ks, vs = scatter_sequences(kv.view(-1, 2, hkv, d), num_blocks, bs, hq, d, g)
    lens = torch.tensor(seq_lens)
    torch.testing.assert_close(m.paged_attention(q, kv, table, lens, 0.125), dense_decode(q, ks, vs, 0.125),
                               atol=1e-5, rtol=1e-5)
    # a bfloat16 cache, and an int8 one with a scale per block (the engine's layout); the reference reads the
    # values the cache holds
    values, scales = quantize_blocks(kv, torch.int8)
    for cache, scale, held in ((kv.bfloat16(), None, kv.bfloat16().float()),
                               (values, scales, values.float() * scales.float()[:, None, :, :, None])):
        ks, vs = _rows(held.view(-1, 2, hkv, d), tables, seq_lens, bs)
        torch.testing.assert_close(m.paged_attention(q, cache, table, lens, 0.125, None, scale),
                                   dense_decode(q, ks, vs, 0.125), atol=1e-5, rtol=1e-5)

    # a prefill chunk of 37 queries after 60 cached positions (one sequence)
    ctx, q_len = 60, 37
    blocks = -(-(ctx + q_len) // bs)
    table = torch.randperm(num_blocks, generator=g)[:blocks][None].contiguous()
    slots = table[0][torch.arange(ctx + q_len) // bs] * bs + torch.arange(ctx + q_len) % bs
    rows = kv.view(-1, 2, hkv, d)[slots]
    q = torch.randn(q_len, hq, d, generator=g)
    got = m.paged_attention(q, kv, table, torch.tensor([ctx + q_len]), 0.125, torch.tensor([0, q_len]))
    torch.testing.assert_close(got, _attention_reference(q, rows[:, 0], rows[:, 1], 0.125, ctx),
                               atol=1e-5, rtol=1e-5)


def test_paged_attention_writes_kv(isa):
    m = build_or_skip("paged_attention", isa)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(6, 16, 2, 2, 64, dtype=dtype)
        slots = torch.tensor([3, 17, 40, 95])
        k, v = torch.randn(4, 2, 64, generator=g).to(dtype), torch.randn(4, 2, 64, generator=g).to(dtype)
        m.write_kv_(cache, slots, k, v)
        flat = cache.view(-1, 2, 2, 64)
        assert torch.equal(flat[slots, 0], k) and torch.equal(flat[slots, 1], v)
        assert flat.float().abs().sum() == k.float().abs().sum() + v.float().abs().sum()   # nothing else written


@pytest.mark.parametrize("rows", [1, 2, 13, 64])
def test_quant_linear(isa, rows, monkeypatch):
    m = build_or_skip("quant_linear", isa)
    g = torch.Generator().manual_seed(rows)
    n, k, group = 192, 256, 32
    w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(rows, k, generator=g)
    q8, s8 = quantize_int8(w, group)
    q4, s4, mins = quantize_int4(w, group)
    q4 = pack_nibbles(q4)   # as the int4 method holds it
    monkeypatch.setattr(quant_kernels, "_module", lambda: None)    # the dequantization formulas, in PyTorch
    w8 = quant_kernels.int8_dequantize(q8, s8, group)
    w4 = quant_kernels.int4_dequantize(q4, s4, mins, group)
    torch.testing.assert_close(m.int8_linear(x, q8, s8, group, fixed=False), F.linear(x, w8), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.int4_linear(x, q4, s4, mins, group, fixed=False), F.linear(x, w4),
                               atol=1e-5, rtol=1e-5)
    # 16-bit fixed-point inputs (the default at one or two rows, where a build has them): within their rounding
    step = x.reshape(rows, -1, 32).abs().amax(-1) / 32767   # each run of 32 columns rounds to max|run| / 32767
    for got, w_ in ((m.int8_linear(x, q8, s8, group), w8), (m.int4_linear(x, q4, s4, mins, group), w4)):
        bound = (w_.abs().reshape(n, -1, 32).sum(-1) @ step.T).T / 2 + 1e-5   # [rows, n]
        assert ((got - F.linear(x, w_)).abs() <= bound).all()
    assert torch.equal(m.int8_dequantize(q8, s8, group), w8)
    torch.testing.assert_close(m.int4_dequantize(q4, s4, mins, group), w4, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops(isa, dtype):
    ops = FusedLayerOps(build_or_skip("layer_ops", isa))
    assert ops.vector_width == LANES[isa]
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2**-8}
    g = torch.Generator().manual_seed(2)
    for rows, h in ((1, 96), (9, 100), (33, 13)):   # widths with and without a partial last vector
        x, res, w = (torch.randn(rows, h, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype),
                     torch.randn(h, generator=g).to(dtype))
        got_x, got_res = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
        assert torch.equal(got_res, x + res)   # the residual stream, stored in the model's dtype
        want_x, _ = LayerOps.add_rms_norm(got_res.float(), None, w.float(), 1e-5)
        torch.testing.assert_close(got_x.float(), want_x, **tol)
        gate_up = (torch.randn(rows, 2 * h + 8, generator=g) * 3).to(dtype)[:, :2 * h]   # a row-strided view
        for op in ("silu_and_mul", "gelu_tanh_and_mul"):
            torch.testing.assert_close(getattr(ops, op)(gate_up).float(), getattr(LayerOps, op)(gate_up.float()),
                                       **tol)
        heads, d, r = 5, 24, 20   # partial RoPE: the first 20 dims of each head of 24 rotate
        qkv = torch.randn(rows, (heads + 2) * d, generator=g).to(dtype)
        angles = torch.randn(rows, r // 2, generator=g).repeat(1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        got = ops.rope_qk(qkv.clone(), cos, sin, heads, d)
        want = LayerOps.rope_qk(qkv.float(), cos.float(), sin.float(), heads, d)
        torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_moe(isa, dtype):
    m = build_or_skip("moe", isa)
    assert m.vector_width() == LANES[isa]
    g, none = torch.Generator().manual_seed(3), torch.empty(0)
    for e, k, h, i, t in ((8, 2, 64, 32, 1), (10, 3, 64, 40, 9)):
        w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
        x = torch.randn(t, h, generator=g)
        weights, ids = select_experts(torch.randn(t, e, generator=g), k, True)
        if dtype == torch.int8:
            q13, q2 = quantize_experts(w13, 32), quantize_experts(w2, -1)   # groups of 32; per channel
            got = m.moe_experts(x, ids, weights, q13.q, q2.q, q13.scales, q2.scales, False)
            want = experts_reference(x, q13.dequantized(), q2.dequantized(), weights, ids)
        else:
            got = m.moe_experts(x, ids, weights, w13.to(dtype), w2.to(dtype), none, none, False)
            want = experts_reference(x, w13.to(dtype).float(), w2.to(dtype).float(), weights, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
