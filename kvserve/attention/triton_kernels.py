"""The Triton kernels of the triton_paged backend: K/V written into their slots, and paged attention over a
mixed batch (decodes and prefill chunks) read in place through the block tables.

KV layout (attention/torch_ref.kv_cache_shape): [num_blocks, block_size, 2, Hkv, D], so a slot's K and V
sit side by side: element (slot, kv, head, d) is at ((slot * 2 + kv) * Hkv + head) * D + d.

Attention: one program per (query tile, KV head). A tile is up to BLOCK_Q consecutive query tokens of one
request; its rows are those tokens times the G = Hq / Hkv query heads that share the KV head (row m: token
m // G, head m % G), so a page of K/V is loaded once for all of them (GQA without repeating K/V). Keys
are walked a page at a time with an online softmax in float32 (FlashAttention's recurrence); the mask is
bottom-right causal (query j of a chunk with `ctx` cached tokens sees positions <= ctx + j), and with a
sliding window W only positions > ctx + j - W: a program then starts at the page of its first query's window
(pages before it may have been freed; they are never loaded). A logit soft cap c (Gemma 2) maps the scaled
scores to c * tanh(s / c) before the mask. Both are compile-time switches, so kernels without them are unchanged.

Importing this module needs triton. With TRITON_INTERPRET=1 set before the import, the kernels run on CPU
tensors through Triton's interpreter (tests/e2e/test_triton_attention.py).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                             NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """One program per token: its k/v [Hkv, D] into slot slot_mapping[t]; a negative slot (a padded row of a
    CUDA-graph batch) writes nowhere."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # NOTE: the slot test is broadcast to a block before the `&`: Triton's interpreter rejects a mask made
    # of a block and a scalar boolean.
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & ((slot + 0 * h[:, None]) >= 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    base = kv_ptr + slot * (2 * NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(base, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + NUM_KV_HEADS * HEAD_DIM, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(x):
    # NOTE: 1 - 2 / (e^2x + 1): exact limits at both ends (e^2x overflowing to inf gives 1), no libdevice
    # call, so it runs in Triton's interpreter as on the GPU.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# NOTE: the block table's row stride (its width, the step's longest table) is not specialised on: a width
# divisible by 16 would otherwise compile a second kernel, and batch-invariant mode wants one for every step.
@triton.jit(do_not_specialize=["stride_bt"])
def paged_attention_kernel(out_ptr, q_ptr, kv_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr, tile_req_ptr,
                           tile_q0_ptr, part_out_ptr, part_lse_ptr, scale, window, soft_cap, stride_qt, stride_qh,
                           stride_ot, stride_oh, stride_bt, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_Q: tl.constexpr, DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr, SOFT_CAP: tl.constexpr,
                           PER_ROW: tl.constexpr = False):
    """DECODE: program i is request i's one query token (tile arrays unused); else program i is the tile
    (tile_req[i], first query tile_q0[i] within that request).

    NUM_SPLITS > 1 (decodes only; split-KV, "flash decoding"): program axis 2 takes one of NUM_SPLITS
    contiguous page ranges and writes its normalised partial output and log2-sum-exp (part_out
    [B, S, Hq, D], part_lse [B, S, Hq], float32) for decode_combine_kernel, so that a small batch still
    fills the GPU (the splits share the pages from the window's first on).

    WINDOWED: `window` (int) is the sliding window; SOFT_CAP: `soft_cap` (float) the logit cap; unused otherwise.

    PER_ROW (with DECODE, batch-invariant mode): program i is query token i of the step, with query_start and
    seq_lens given per token (i and its position + 1) and tile_req[i] the row of its request's block table, so
    every token, whether a decode, a draft being verified or a row of a prefill chunk, is reduced over its keys
    by the same program in the same page order as a decode at its position."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        req = pid
        q0 = 0
    else:
        req = tl.load(tile_req_ptr + pid)
        q0 = tl.load(tile_q0_ptr + pid)
    table_row = req
    if PER_ROW:
        table_row = tl.load(tile_req_ptr + pid)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qi = q0 + m // GROUP                                                      # [M] query index in the request
    head = kvh * GROUP + m % GROUP                                            # [M] query head
    row_ok = (m < BLOCK_Q * GROUP) & (qi < q_len)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)              # [M, D]
    q_pos = ctx + qi                                                          # [M]

    # The keys this tile needs: up to its last query's position (not beyond the sequence).
    num_keys = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
    num_pages = ((num_keys + PAGE - 1) // PAGE).to(tl.int32)
    page0 = 0
    if WINDOWED:  # the page of the tile's first query's first visible key
        page0 = (tl.maximum(ctx + q0 + 1 - window, 0) // PAGE).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634                                    # log2(e): exp2 below
    p_off = tl.arange(0, PAGE)
    row_stride = 2 * NUM_KV_HEADS * HEAD_DIM
    pages_per_split = (num_pages - page0 + NUM_SPLITS - 1) // NUM_SPLITS
    first_page = page0 + split * pages_per_split
    last_page = tl.minimum(first_page + pages_per_split, num_pages)
    for j in range(first_page, last_page):
        block = tl.load(block_table_ptr + table_row * stride_bt + j).to(tl.int64)
        k_pos = j * PAGE + p_off                                              # [P]
        k_ok = k_pos < num_keys
        kv_off = (block * PAGE + p_off)[:, None] * row_stride + kvh * HEAD_DIM + d[None, :]   # [P, D]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + kv_off + NUM_KV_HEADS * HEAD_DIM, mask=kv_mask, other=0.0)
        if SOFT_CAP:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            s = soft_cap * _tanh(s / soft_cap) * 1.4426950408889634
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, P] float32
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOWED:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a row that has seen no visible key yet (padding) keeps m = -inf; shift by 0 there so that
        # exp2(-inf - -inf) never makes a NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        num_heads = NUM_KV_HEADS * GROUP
        part = ((req * NUM_SPLITS + split) * num_heads + head).to(tl.int64)           # [M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def decode_combine_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_ptr, stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (decode request, query head): the splits' partial outputs weighted by their share
    of the softmax mass, exp2(lse_s - max lse); a request with no keys at all (padding) gets zeros."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    part = ((req * NUM_SPLITS + s) * NUM_HEADS + head).to(tl.int64)                   # [S]
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))                          # [S]; -inf -> 0
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)                                                            # [S, D]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tok = tl.load(query_start_ptr + req).to(tl.int64)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
