"""Batch-invariant Triton ops for the GPU path (`--batch-invariant`, issue 34): a matmul and RMSNorm whose
result for one row does not depend on how many other rows share the launch.

Why the default ops are not: cuBLAS picks its kernel, tile shape and split-K factor from M (the batch), and
each choice sums the K products in another order, so a token's logits change in the last bits when the batch
grows. Here every choice is a function of N and K alone (the weight's shape):
- tiles: BLOCK_M is fixed, BLOCK_N from N, BLOCK_K from K; one program per output tile, no split-K, so
  every output element is one fp32 accumulation over K in BLOCK_K steps, in order;
- M is excluded from Triton's specialisation (`do_not_specialize`): an M of 1, or a multiple of 16, would
  otherwise compile a kernel of its own;
- fp32 inputs multiply in IEEE fp32 (no TF32), bf16/fp16 with fp32 accumulation.
RMSNorm: one program per row, the whole row in one block, so the sum of squares has one order per width.

Importing this module needs triton. With TRITON_INTERPRET=1 set before the import the kernels run on CPU
tensors through Triton's interpreter (tests/e2e/test_triton_batch_invariant.py; tl.dot there reads no bf16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

_BLOCK_M = 64
_MAX_BLOCK_N = 64
_MAX_BLOCK_K = 64
_MIN_BLOCK = 16  # tl.dot wants every side >= 16
_NUM_WARPS = 4
_NUM_STAGES = 3


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_sizes(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a [M, K] x [K, N] product: from N and K only, never from M."""
    return (_BLOCK_M, min(_MAX_BLOCK_N, max(_MIN_BLOCK, _next_pow2(n))),
            min(_MAX_BLOCK_K, max(_MIN_BLOCK, _next_pow2(k))))


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per [BLOCK_M, BLOCK_N] tile of c = a @ b (+ bias): K walked from 0 up in BLOCK_K steps."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        # NOTE: masked K tails load zeros on both sides, so they add exact zeros: a row's sum is the same
        # whatever else is in its tile.
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"batch-invariant matmul: {what} must be float32, bfloat16 or float16, got {t.dtype}")


def _matmul_into(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype; b may be a transposed view (a weight's .t())."""
    _check_dtype(a, "the input")
    if b.dtype != a.dtype:
        raise ValueError(f"batch-invariant matmul: operands differ in dtype ({a.dtype} vs {b.dtype})")
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"batch-invariant matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    block_m, block_n, block_k = tile_sizes(n, k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _matmul_kernel[grid](a, b, c, bias if bias is not None else c, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                         b.stride(1), c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                         num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    return c


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], each row of the result independent of M."""
    return _matmul_into(a, b, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's y = x W^T + b (x [..., K], weight [N, K]), each row of y independent of the rows beside it."""
    lead = x.shape[:-1]
    y = _matmul_into(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return y.reshape(*lead, weight.shape[0])


class TritonBatchInvariantMethod:
    """The linear method (layers/linear_methods.LinearMethod) of `--batch-invariant` on CUDA."""

    name = "triton_batch_invariant"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, sum_ptr, w_ptr, eps, stride_x, stride_r, stride_o, stride_s,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One program per row: s = x (+ residual), written to sum_ptr when there is a residual; out =
    (s * rsqrt(mean(s^2) + eps)) rounded to the input's dtype, times the weight (torch's F.rms_norm order)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    s = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        s = s + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=ok)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / N + eps)
    normed = (sf * inv).to(s.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_ops.LayerOps.add_rms_norm's contract: (rms_norm(x + residual) * weight, x + residual); with no
    residual, x itself is the residual. Each row is reduced alone, in one order per hidden size."""
    _check_dtype(x, "the input")
    width = x.shape[-1]
    xs = _rows(x)
    out = torch.empty_like(xs)
    total = xs if residual is None else torch.empty_like(xs)
    rs = xs if residual is None else _rows(residual)
    if xs.shape[0]:
        _rms_norm_kernel[(xs.shape[0],)](xs, rs, out, total, weight, eps, xs.stride(0), rs.stride(0), out.stride(0),
                                         total.stride(0), N=width, BLOCK=_next_pow2(width),
                                         HAS_RESIDUAL=residual is not None)
    return out.view(x.shape), (x if residual is None else total.view(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (H,), weight, eps), each row reduced alone."""
    return add_rms_norm(x, None, weight, eps)[0]
