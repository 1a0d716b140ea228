"""The weight-only matmuls for float32 activations: the C++ kernels (csrc/quant_linear.cpp) when they build,
else PyTorch (dequantize the whole weight, then F.linear: correct, slower). Both compute a matmul on the
dequantized weight, so the two differ only by summation order.

From `DENSE_ROWS` input rows on, the weight is dequantized into a float32 matrix and handed to oneDNN (MKL's
F.linear where oneDNN is absent): a prefill chunk is compute-bound there, and the extra pass over the weight
costs little next to the matmul; below it (decode, small batches) the kernel reads only the quantized bytes,
dequantizing in registers for up to 8 rows at a time.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "quant_linear.cpp")

DENSE_ROWS = 24
"""Input rows from which a quantized layer dequantizes and calls the dense matmul (bench.py measures both
sides: the register kernel wins at decode sizes, oneDNN's blocked GEMM at prefill sizes)."""


@functools.lru_cache(maxsize=1)
def _module():
    from kvserve.attention.cpu_kernels import build_extension

    return build_extension("kvserve_quant_linear", _SOURCE, "weight-only quantized linear")


def available() -> bool:
    return _module() is not None


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """q [N, K] int8, scales [N, K / group] float32 -> w [N, K] float32 = q * scale."""
    m = _module()
    if m is not None and q.device.type == "cpu":
        return m.int8_dequantize(q, scales, group)
    return q.float() * scales.repeat_interleave(group, dim=1)


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> torch.Tensor:
    """q [N, K / 2] uint8 (per 32 weights: low nibbles 0..15, high 16..31), scales / mins [N, K / group]
    -> w [N, K] float32 = code * scale + min."""
    m = _module()
    if m is not None and q.device.type == "cpu":
        return m.int4_dequantize(q, scales, mins, group)
    n = q.shape[0]
    blocks = q.reshape(n, -1, 16)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, -1).float()         # [N, K]
    return codes * scales.repeat_interleave(group, dim=1) + mins.repeat_interleave(group, dim=1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = w.to(x.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float32 and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        # NOTE: oneDNN on a plain (not prepacked) weight reorders it per call and still beats MKL's sgemm
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] with w = int8_dequantize(q, scales, group)."""
    x2 = _rows(x)
    m = _module()
    if (m is None or x2.shape[0] >= DENSE_ROWS or x2.dtype != torch.float32 or x2.device.type != "cpu"
            or group % 32):  # the kernel reads whole runs of 32 weights
        y = _dense(x2, int8_dequantize(q, scales, group), bias)
    else:
        y = m.int8_linear(x2, q, scales, group)
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] with w = int4_dequantize(q, scales, mins, group)."""
    x2 = _rows(x)
    m = _module()
    if m is None or x2.shape[0] >= DENSE_ROWS or x2.dtype != torch.float32 or x2.device.type != "cpu":
        y = _dense(x2, int4_dequantize(q, scales, mins, group), bias)
    else:
        y = m.int4_linear(x2, q, scales, mins, group)
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
