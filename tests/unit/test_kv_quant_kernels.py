"""The quantized KV cache's numbers (--kv-cache-dtype int8 | fp8_e4m3): round-trip error bounds, the block-scale
write rule (PyTorch and C++ byte for byte, growth and requantization, reset of a new block), the rotation, and the
C++ decode kernel and both backends against a dense reference on the dequantized cache. (The engine on a
quantized cache: tests/engine/test_kv_quant.py.)"""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv_cache.quant import (QuantizedKVCache, dequantize, gather_dequantized, quantize, quantize_blocks,
                                    write_block_scaled)
from kvserve.kv_cache.rotation import rotate, rotation
from tests.helpers.attention_isa import check_fp8_write_edges
from tests.helpers.oracles import dense_decode
from tests.helpers.paged_cache import scatter_sequences

QUANT_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged decode kernel")
    return kernel


# --------------------------------------------------------------------------- quantize -> dequantize


def _rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 64, generator=g) * torch.rand(512, 1, generator=g).mul(20).exp2() / 1024  # [N, D]
    x[::37, 5] *= 50          # outliers in some rows
    x[3] = 0                  # an all-zero row
    return x


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = _rows(0)
    values, scales = quantize(x, torch.int8)
    assert values.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (512,)
    err = (dequantize(values, scales) - x).abs()
    assert (err <= scales.float()[:, None] * (0.5 + 1e-4)).all()
    # each row uses the full grid, but for the scale's rounding up to bf16 (at most 2^-7: 127 / (1 + 2^-7) > 126)
    assert values.abs().amax(dim=1)[x.abs().amax(dim=1) > 0].ge(126).all()
    assert (values[3] == 0).all() and (dequantize(values, scales)[3] == 0).all()
    rel = (err.norm(dim=1) / x.norm(dim=1).clamp_min(1e-30))[x.abs().amax(dim=1) > 0]
    assert rel.mean() < 0.01


def test_fp8_round_trip_error_is_within_e4m3_precision():
    x = _rows(1)
    values, scales = quantize(x, torch.float8_e4m3fn)
    assert values.dtype == torch.float8_e4m3fn
    assert not values.float().isnan().any()
    err = (dequantize(values, scales) - x).abs()
    # 3 mantissa bits: half an ulp is <= 2^-4 of the value; below 2^-6 (subnormals) the step is 2^-9.
    assert (err <= x.abs() * 2**-4 + scales.float()[:, None] * 2**-10 + 1e-12).all()
    assert (values.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0] == 448).all()
    rel = (err.norm(dim=1) / x.norm(dim=1).clamp_min(1e-30))[x.abs().amax(dim=1) > 0]
    assert rel.mean() < 0.05


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_scales_are_bf16_rounded_up_so_codes_stay_in_range(dtype):
    """The stored scale is the smallest bf16 >= absmax / qmax: never below it (so no code is clamped), at most
    one bf16 step above it, and the pair (codes, scale) is what dequantize and the kernels multiply back."""
    from kvserve.kv_cache.quant import SCALE_DTYPE, round_up_to_bf16

    assert SCALE_DTYPE == torch.bfloat16
    x = _rows(2)
    values, scales = quantize(x, dtype)
    qmax = 127.0 if dtype == torch.int8 else 448.0
    exact = x.abs().amax(dim=1).clamp_min(1e-30) / qmax
    s = scales.float()
    assert (s >= exact).all() and (s <= exact * (1 + 2**-7)).all()
    assert (s.to(torch.bfloat16).float() == s).all()
    # round_up_to_bf16: exact bf16 values stay, anything else goes to the next bf16 up
    b = torch.tensor([1.0, 1.0 + 2**-7, 3e-30, 0.1])
    up = round_up_to_bf16(b)
    assert up[0] == 1.0 and up[1] == 1.0 + 2**-7 and (up >= b).all()
    assert (up.to(torch.bfloat16).float() == up).all() and (up <= b * (1 + 2**-7)).all()
    # with no rounding-up, x / scale could exceed qmax and be clamped: here, no code is clamped away
    assert (dequantize(values, scales) - x).abs().le(s[:, None] * (0.5 if dtype == torch.int8 else 16)).all()


# --------------------------------------------------------------------------- the decode kernel


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_kernel_reads_every_code_exactly(dtype):
    """A one-token context's output is its V row: every one of the 256 codes (fp8: 254, NaN aside, subnormals
    included) comes back as torch converts it, times its scale."""
    kernel = _kernel_or_skip()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if dtype == torch.float8_e4m3fn:
        codes = codes[~codes.float().isnan()]
    d = 64
    rows = -(-codes.numel() // d)
    v = torch.zeros(rows * d, dtype=torch.uint8).view(dtype)
    v[:codes.numel()] = codes
    values = torch.zeros(rows, 1, 2, 1, d, dtype=dtype)              # one block of one slot per sequence
    values.view(torch.uint8)[:, 0, 1, 0] = v.view(torch.uint8).view(rows, d)
    scales = torch.full((rows, 1, 2, 1), 0.5, dtype=torch.bfloat16)
    out = kernel.paged_decode_attention(torch.randn(rows, 1, d), values, torch.arange(rows)[:, None],
                                        torch.ones(rows, dtype=torch.int64), 0.125, None, scales)
    torch.testing.assert_close(out[:, 0], v.float().view(rows, d) * 0.5, atol=0, rtol=0)


def _quantized_case(dtype, block_size, num_heads, num_kv_heads, head_dim, seed, per_block=True):
    """A random quantized cache (one scale per block, the engine's layout, or per slot, which the kernel also
    reads), scattered block tables, ragged lengths; returns what a decode step needs plus each sequence's
    dequantized K/V (the reference's input)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    full = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=g)
    full *= torch.rand(num_blocks, block_size, 2, num_kv_heads, 1, generator=g) * 4   # per-token magnitudes
    if per_block:
        values, scales = quantize_blocks(full, dtype)
        deq = dequantize(values, scales[:, None].expand(-1, block_size, -1, -1))
    else:
        values, scales = quantize(full, dtype)
        deq = dequantize(values, scales)
    deq = deq.view(-1, 2, num_kv_heads, head_dim)
    q, table, seq_lens, tables, ks, vs = scatter_sequences(deq, num_blocks, block_size, num_heads, head_dim, g)
    return q, QuantizedKVCache(values, scales), table, seq_lens, tables, ks, vs


# (block_size, num_heads, num_kv_heads, head_dim): test_attention.py's block sizes and GQA ratios at head_dim
# 64, and the kernel's other two code paths (128 compiled in, 80 sized at run time) once each.
GEOMETRIES = [(bs, hq, hkv, 64) for bs in (16, 32) for hq, hkv in ((9, 3), (4, 4), (8, 1))] + \
    [(16, 9, 3, 128), (16, 9, 3, 80)]


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim", GEOMETRIES)
@pytest.mark.parametrize("per_block", [True, False], ids=["block-scales", "slot-scales"])
def test_kernel_on_quantized_cache_matches_dense_on_dequantized(dtype, block_size, num_heads, num_kv_heads,
                                                                head_dim, per_block):
    kernel = _kernel_or_skip()
    q, cache, table, seq_lens, _, ks, vs = _quantized_case(dtype, block_size, num_heads, num_kv_heads, head_dim,
                                                           seed=block_size + num_heads + head_dim,
                                                           per_block=per_block)
    scale = head_dim ** -0.5
    out = kernel.paged_decode_attention(q, cache.values, table, torch.tensor(seq_lens), scale, None, cache.scales)
    torch.testing.assert_close(out, dense_decode(q, ks, vs, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
def test_kernel_on_quantized_cache_with_several_queries_per_sequence(dtype):
    """Draft verification rows (query_start) on a quantized cache equal each row decoded alone."""
    kernel = _kernel_or_skip()
    q, cache, table, seq_lens, _, _, _ = _quantized_case(dtype, 16, 9, 3, 64, seed=7)
    queries = [1, 1, 3, 2, 4]
    q = torch.randn(sum(queries), 9, 64)
    starts = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    grouped = kernel.paged_decode_attention(q, cache.values, table, torch.tensor(seq_lens), 0.125, starts,
                                            cache.scales)
    rows = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor(queries))
    own = torch.tensor([n - (k - 1 - j) for n, k in zip(seq_lens, queries) for j in range(k)])
    alone = kernel.paged_decode_attention(q, cache.values, table[rows].contiguous(), own, 0.125, None, cache.scales)
    torch.testing.assert_close(grouped, alone, atol=1e-5, rtol=1e-5)


def _dequantized_slots(cache: QuantizedKVCache) -> torch.Tensor:
    """Every slot of the cache, dequantized: [num_blocks * block_size, 2, Hkv, D]."""
    n, bs = cache.values.shape[:2]
    return gather_dequantized(cache, torch.arange(n * bs), torch.float32)


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("use_kernel", [False, True])
def test_backend_decode_writes_quantized_and_matches_dense_on_dequantized(dtype, use_kernel):
    """forward() rotates the decode token's own K/V and quantizes them into the cache, then attends over what
    the cache holds with a rotated query, and rotates the result back."""
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    block_size, hq, hkv, d = 16, 9, 3, 64
    q, cache, table, seq_lens, tables, _, _ = _quantized_case(dtype, block_size, hq, hkv, d, seed=3)
    g = torch.Generator().manual_seed(4)
    k_new, v_new = torch.randn(len(seq_lens), hkv, d, generator=g), torch.randn(len(seq_lens), hkv, d, generator=g)
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for t, n in zip(tables, seq_lens)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens), block_table=table,
        slot_mapping=slots, num_decodes=len(seq_lens), num_decode_tokens=len(seq_lens), block_size=block_size,
        query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens)
    out = backend.forward(q, k_new, v_new, cache, backend.build_metadata(common), d ** -0.5)
    deq = _dequantized_slots(cache)
    written = rotate(deq[slots])                                      # [B, 2, Hkv, D], rotated back
    assert (written[:, 0] - k_new).abs().max() < 0.07 * k_new.abs().max()   # quantized, not dropped
    ks, vs = [], []
    for t, n in zip(tables, seq_lens):
        s = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(n)])
        ks.append(deq[s, 0])
        vs.append(deq[s, 1])
    ref = rotate(dense_decode(rotate(q), ks, vs, d ** -0.5))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_prefill_chunk_gathers_dequantized_context(use_kernel):
    """A later prefill chunk attends to its context, and to its own K/V, as the cache stores them
    (dequantized as they are gathered, in the rotated basis)."""
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    g = torch.Generator().manual_seed(5)
    bs, hkv, hq, d, ctx, q_len = 16, 2, 4, 32, 40, 20
    n = ctx + q_len
    cache = QuantizedKVCache(torch.zeros(8, bs, 2, hkv, d, dtype=torch.int8),
                             torch.ones(8, 2, hkv, dtype=torch.bfloat16))
    k_all, v_all = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    table = [5, 2, 7, 0]
    slot = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    write_block_scaled(cache, slot[:ctx], rotate(k_all[:ctx]), rotate(v_all[:ctx]))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, q_len]), seq_lens=torch.tensor([n]), block_table=torch.tensor([table]),
        slot_mapping=slot[ctx:], num_decodes=0, num_decode_tokens=0, block_size=bs, query_lens_cpu=[q_len],
        seq_lens_cpu=[n])
    q = torch.randn(q_len, hq, d, generator=g)
    out = backend.forward(q, k_all[ctx:], v_all[ctx:], cache, backend.build_metadata(common), d ** -0.5)
    # the chunk's own K/V come back from the cache too (its gather spans the whole sequence)
    kv = _dequantized_slots(cache)[slot]                              # [n, 2, Hkv, D] rotated
    assert (rotate(kv[:, 0]) - k_all).abs().max() < 0.1 * k_all.abs().max()
    mask = torch.arange(n)[None, :] <= torch.arange(ctx, n)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        rotate(q).transpose(0, 1), kv[:, 0].repeat_interleave(2, 1).transpose(0, 1),
        kv[:, 1].repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask, scale=d ** -0.5).transpose(0, 1)
    torch.testing.assert_close(out, rotate(ref), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the write rule and the rotation


def _write_in_steps(dtype, seed, write):
    """One request's 6 blocks filled over random chunk sizes (1-39 tokens) of tokens whose magnitudes vary by
    2^8, through `write(cache, slots, k, v)`; returns the cache and every token's full-precision K/V."""
    g = torch.Generator().manual_seed(seed)
    n_blocks, bs, h, d = 12, 16, 3, 64
    cache = QuantizedKVCache(torch.zeros(n_blocks, bs, 2, h, d, dtype=dtype),
                             torch.ones(n_blocks, 2, h, dtype=torch.bfloat16))
    table = torch.randperm(n_blocks, generator=g)[:6]
    pos, slots, kvs = 0, [], []
    while pos < 6 * bs:
        n = min(int(torch.randint(1, 40, (1,), generator=g)), 6 * bs - pos)
        p = torch.arange(pos, pos + n)
        s = table[p // bs] * bs + p % bs
        k = torch.randn(n, h, d, generator=g) * torch.rand(n, h, 1, generator=g).mul(8).exp2()
        v = torch.randn(n, h, d, generator=g) * torch.rand(n, h, 1, generator=g).mul(8).exp2()
        write(cache, s, k, v)
        slots.append(s)
        kvs.append(torch.stack((k, v), 1))
        pos += n
    return cache, torch.cat(slots), torch.cat(kvs)


@pytest.mark.parametrize("dtype", QUANT_DTYPES.values(), ids=QUANT_DTYPES.keys())
@pytest.mark.parametrize("seed", range(4))
def test_kernel_write_rule_matches_pytorch_byte_for_byte(dtype, seed):
    """The C++ writer (cpu_paged) and write_block_scaled (torch_ref, the oracle) store the same bytes and scales
    through chunk sizes that grow block scales mid-block, and the error stays within one step of the final
    scale (the grown blocks' second rounding included)."""
    kernel = _kernel_or_skip()
    ref, slots, kv = _write_in_steps(dtype, seed, write_block_scaled)
    got, _, _ = _write_in_steps(dtype, seed, lambda c, s, k, v: kernel.write_kv_quantized_(c.values, c.scales, s, k, v))
    assert torch.equal(ref.values.view(torch.uint8), got.values.view(torch.uint8))
    assert torch.equal(ref.scales, got.scales)
    err = (gather_dequantized(ref, slots, torch.float32) - kv).abs()
    step = ref.scales.float()[slots // 16]                                    # [T, 2, H]
    bound = step[..., None] * (1.0 if dtype == torch.int8 else 0.0) + kv.abs() * (0 if dtype == torch.int8 else 2**-3)
    assert (err <= bound + step[..., None] * 2**-9).all()


def test_kernel_fp8_write_on_every_code_and_tie():
    """The fp8 write's vector lanes against the PyTorch rule on every e4m3 value, every tie between neighbours and
    the floats beside it, then requantized by a grown scale (tests/helpers/attention_isa.py; the e2e test runs the
    same on the AVX2 build)."""
    check_fp8_write_edges(_kernel_or_skip())


def test_block_scale_grows_requantizes_and_resets():
    """A later token that needs a larger scale grows its block's scale and requantizes the earlier codes to
    it; a write at a block's offset 0 starts the block afresh (its old scale, however large, is dropped)."""
    cache = QuantizedKVCache(torch.zeros(2, 4, 2, 1, 2, dtype=torch.int8), torch.ones(2, 2, 1, dtype=torch.bfloat16))
    one = torch.tensor([[[127.0, -63.5]]]) / 128                             # [1, H=1, D=2]; scale 2^-7 exactly
    write_block_scaled(cache, torch.tensor([0]), one, one)
    assert cache.scales[0, 0, 0].item() == 2**-7
    assert cache.values[0, 0, 0, 0].tolist() == [127, -64]                    # -63.5 rounds to even
    write_block_scaled(cache, torch.tensor([1]), 2 * one, 2 * one)            # grows to 2^-6
    assert cache.scales[0, 0, 0].item() == 2**-6
    assert cache.values[0, 0, 0, 0].tolist() == [64, -32]                     # requantized: codes x old / new
    assert cache.values[0, 1, 0, 0].tolist() == [127, -64]
    write_block_scaled(cache, torch.tensor([2]), one / 4, one / 4)            # smaller: the scale stays
    assert cache.scales[0, 0, 0].item() == 2**-6 and cache.values[0, 2, 0, 0].tolist() == [16, -8]
    two = (one / 128).expand(2, -1, -1)
    write_block_scaled(cache, torch.tensor([0, 1]), two, two)                 # offset 0: a new block
    assert cache.scales[0, 0, 0].item() == 2**-14
    assert cache.values[0, 0, 0, 0].tolist() == cache.values[0, 1, 0, 0].tolist() == [127, -64]
    assert (cache.values[1] == 0).all()                                       # other blocks untouched


@pytest.mark.parametrize("head_dim", [64, 128, 80, 16, 8, 7])
def test_kernel_hadamard_equals_the_rotation_on_strided_views(head_dim):
    """cpu_paged rotates by the C++ fast Walsh-Hadamard transform, torch_ref by a matmul with R: the same R."""
    kernel = _kernel_or_skip()
    qkv = torch.randn(33, 15, head_dim)
    q, k, _ = qkv.split_with_sizes([9, 3, 3], dim=1)                          # views: token stride 15 x D
    for x in (q, k, torch.randn(4, 2, head_dim)):
        got = kernel.hadamard(x)
        assert got.is_contiguous()
        torch.testing.assert_close(got, rotate(x), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.hadamard(q.double())


@pytest.mark.parametrize("head_dim", [64, 128, 80, 16, 7])
def test_rotation_is_orthonormal_symmetric_and_spreads_an_outlier(head_dim):
    r = rotation(head_dim)
    torch.testing.assert_close(r @ r, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(r, r.T)
    x = torch.zeros(head_dim)
    x[3] = 1.0
    n = head_dim & -head_dim                                                  # the Hadamard blocks' size
    assert rotate(x).abs().max().item() == pytest.approx(n ** -0.5)          # one channel spread over n
    q, k = torch.randn(5, head_dim), torch.randn(7, head_dim)
    torch.testing.assert_close(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_mismatched_quantized_inputs():
    kernel = _kernel_or_skip()
    q, table, lens = torch.randn(1, 4, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    values = torch.zeros(2, 16, 2, 2, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8/fp8 need kv_scales"):
        kernel.paged_decode_attention(q, values, table, lens, 0.125)
    with pytest.raises(RuntimeError, match="shaped as kv without head_dim"):
        kernel.paged_decode_attention(q, values, table, lens, 0.125, None,
                                      torch.ones(2, 16, 2, 1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        kernel.paged_decode_attention(q, values, table, lens, 0.125, None, torch.ones(2, 16, 2, 2))  # float32
    with pytest.raises(RuntimeError, match="must be int8 or float8_e4m3fn"):
        kernel.paged_decode_attention(q, values.float(), table, lens, 0.125, None,
                                      torch.ones(2, 16, 2, 2, dtype=torch.bfloat16))
