"""The weight-only matmuls for float32 activations (and bfloat16 weights multiplied in float32: bf16_linear):
the C++ kernels (csrc/quant_linear.cpp) when they build, else PyTorch (dequantize the whole weight, then
F.linear: correct, slower). Both compute a matmul on the dequantized weight, so the two differ only by
summation order, except with `fixed_point` (the methods pass envs.quant_fixed_point(), on unless
KVSERVE_QUANT_FIXED_POINT=0) at up to `fixed_point_rows()` input rows (two with AVX-512, four with AVX2:
single-stream decode): there the C++ kernel rounds each run of 32 input columns to 16-bit fixed point with
its own scale (error <= 2^-16 of the run's largest |x|, 128x finer than bfloat16), which lets it
multiply-add weights as integers: 1.6x the float kernel's rate per core for int8 with AVX-512.

The C++ kernel reads only the quantized bytes: for decode sizes it dequantizes in registers for up to 8 rows
(AVX2: 4) at a time, for batches into L2-sized tiles (or panels, for a layer whose output rows are not whole
tiles of 64) multiplied by oneDNN's GEMM micro-kernel. The tiles take any number of float32 rows; elsewhere,
from `DENSE_ROWS` on (and from BF16_DENSE_ROWS for bfloat16 activations where the CPU multiplies bfloat16
natively), the weight is dequantized into a float32 matrix and handed to oneDNN (MKL's F.linear where oneDNN
is absent), which costs a write and a re-read of the whole weight and oneDNN's reorder of it per call.

The kernels are built for the instruction set utils/cpu_isa.py selects (AVX-512, AVX2 + FMA, or scalar:
`isa()`), read once per process: a test that forces another one with KVSERVE_CPU_ISA clears `_module`'s cache.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "quant_linear.cpp")

DENSE_ROWS = 112
"""Input rows from which a quantized layer the tiles do not fit dequantizes and calls the dense matmul (bench.py
measures both sides: the panels win at batch sizes, oneDNN's blocked GEMM on the whole weight at prefill
sizes)."""

BF16_DENSE_ROWS = 24
"""The same for bfloat16 activations: the kernels compute in float32, the dense bfloat16 matmul at twice the
rate, so it wins from fewer rows."""

DENSE_CHUNK = 1 << 21
"""Most weights dequantized at once on the dense path (8 MiB of float32, into a DenseScratch). A larger
layer (the LM head: 49152 x 576) runs in chunks of DENSE_CHUNK_ROWS output rows."""

DENSE_CHUNK_ROWS = 2048


@dataclasses.dataclass
class DenseScratch:
    """The float32 buffer the dense path dequantizes into, reused across calls (one per linear method, so
    shared by all the decoder layers that run it): a fresh multi-megabyte tensor per call may be a new
    mapping whose page faults are paid every time. For the LM head's whole 113 MB float32 copy they cost
    several times the matmul (`python -m kvserve.layers.quant.bench --lm-head`, row `int8 whole copy`)."""

    buffer: torch.Tensor | None = None

    def take(self, rows: int, k: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < rows * k:
            self.buffer = torch.empty(rows * k, dtype=torch.float32)
        return self.buffer[: rows * k].view(rows, k)


@functools.lru_cache(maxsize=1)
def _module():
    from kvserve.utils.cpp_extension import build_extension

    return build_extension("kvserve_quant_linear", _SOURCE, "weight-only quantized linear")


def available() -> bool:
    return _module() is not None


def isa() -> str | None:
    """The instruction set the loaded kernels use (avx512 | avx2 | scalar; None: PyTorch fallback)."""
    m = _module()
    return None if m is None else m.isa()


def fixed_point_rows() -> int:
    """Input rows up to which the C++ kernels round x to 16-bit fixed point when asked (0: they cannot)."""
    m = _module()
    return 0 if m is None else m.fixed_rows()


def small_rows() -> int:
    """Input rows up to which the C++ kernels dequantize in registers (reading the weight once per 8 rows: a
    row costs more there than in the panels beyond; 0: no such kernel here). The scheduler's step-cost model
    takes it as a knee (scheduler/step_cost.py)."""
    m = _module()
    return 0 if m is None else m.small_rows()


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor, group: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, K] int8, scales [N, K / group] float32 -> w [N, K] float32 = q * scale (into `out` if given:
    the C++ kernel writes it in place; the fallback returns a new tensor)."""
    m = _module()
    if m is not None and q.device.type == "cpu":
        return m.int8_dequantize(q, scales, group, out=out)
    return q.float() * scales.repeat_interleave(group, dim=1)


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, K / 2] uint8 (per 32 weights: low nibbles 0..15, high 16..31), scales / mins [N, K / group]
    -> w [N, K] float32 = code * scale + min (into `out` as int8_dequantize)."""
    m = _module()
    if m is not None and q.device.type == "cpu":
        return m.int4_dequantize(q, scales, mins, group, out=out)
    n = q.shape[0]
    blocks = q.reshape(n, -1, 16)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, -1).float()         # [N, K]
    return codes * scales.repeat_interleave(group, dim=1) + mins.repeat_interleave(group, dim=1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _emulated_bf16(x: torch.Tensor) -> bool:
    """bfloat16 rows on a CPU whose bfloat16 matmul PyTorch emulates (no AVX512_BF16 / AMX): they take the
    float32 paths, the result rounded back to bfloat16."""
    from kvserve.utils import cpu_features

    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_features.native_bf16()


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _emulated_bf16(x):
        return _dense(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    w = w.to(x.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float32 and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        # NOTE: oneDNN on a plain (not prepacked) weight reorders it per call and still beats MKL's sgemm
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


def _dense_chunked(x2: torch.Tensor, n_out: int, dequantize, bias: torch.Tensor | None,
                   scratch: DenseScratch | None) -> torch.Tensor:
    """x2 [M, K] -> [M, n_out] through `_dense`, with dequantize(start, stop, out) -> rows start:stop of the
    weight (written into `out`, a slice of the scratch buffer, or None: a new tensor)."""
    k = x2.shape[1]
    rows = n_out if n_out * k <= DENSE_CHUNK else DENSE_CHUNK_ROWS
    buffer = None if scratch is None else scratch.take(rows, k)

    def part(start: int, stop: int) -> torch.Tensor:
        w = dequantize(start, stop, None if buffer is None else buffer[: stop - start])
        return _dense(x2, w, None if bias is None else bias[start:stop])

    if n_out <= rows:
        return part(0, n_out)
    y = torch.empty(x2.shape[0], n_out, dtype=x2.dtype, device=x2.device)
    for start in range(0, n_out, rows):
        stop = min(n_out, start + rows)
        y[:, start:stop] = part(start, stop)
    return y


@functools.lru_cache(maxsize=None)
def tiles_fit(n_out: int, k: int) -> bool:
    """Whether the C++ kernel's tiles take a [n_out, k] weight at any number of float32 rows (AVX-512 or AVX2, whole
    tiles of output rows, K in vectors): then it runs prefill sizes too, level with prepacked float32."""
    m = _module()
    return m is not None and m.tile_rows() > 0 and n_out % m.tile_block() == 0 and k % 16 == 0


def _kernel_takes(m, x2: torch.Tensor, n_out: int) -> bool:
    """Whether the C++ kernel runs these rows: on the CPU, float32 rows below DENSE_ROWS or any number where
    the tiles fit, bfloat16 ones below BF16_DENSE_ROWS (--dtype bfloat16: the few rows go through it in
    float32; prefill-sized bfloat16 rows take the dense bfloat16 matmul) unless that matmul is emulated here:
    then as float32 rows."""
    if m is None or x2.device.type != "cpu":
        return False
    if x2.dtype == torch.float32 or _emulated_bf16(x2):
        return x2.shape[0] < DENSE_ROWS or tiles_fit(n_out, x2.shape[1])
    return x2.dtype == torch.bfloat16 and x2.shape[0] < BF16_DENSE_ROWS


def _decode_rows(m, x: torch.Tensor) -> bool:
    """The common case, taken before anything else: contiguous float32 [M, K] rows on the CPU below DENSE_ROWS,
    which go to the C++ kernel as they are. A decode step calls a quantized linear four times per layer, and the
    general path's reshapes and checks cost ~6 us a call, as much as the small layers' kernel time."""
    return m is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and x.shape[0] < DENSE_ROWS \
        and x.is_contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None, scratch: DenseScratch | None = None,
                fixed_point: bool = False) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] (x's dtype) with w = int8_dequantize(q, scales, group)."""
    m = _module()
    if _decode_rows(m, x) and group % 32 == 0:
        y = m.int8_linear(x, q, scales, group, fixed_point)  # NOTE: positional: pybind's keyword parsing costs ~0.6 us
        return y if bias is None else y + bias
    x2 = _rows(x)
    if not _kernel_takes(m, x2, q.shape[0]) or group % 32:  # the kernel reads whole runs of 32 weights
        y = _dense_chunked(x2, q.shape[0], lambda a, b, out: int8_dequantize(q[a:b], scales[a:b], group, out),
                           bias, scratch)
    else:
        y = m.int8_linear(x2.float(), q, scales, group, fixed=fixed_point).to(x2.dtype)
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                bias: torch.Tensor | None, scratch: DenseScratch | None = None,
                fixed_point: bool = False) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] (x's dtype) with w = int4_dequantize(q, scales, mins, group)."""
    m = _module()
    if _decode_rows(m, x):
        y = m.int4_linear(x, q, scales, mins, group, fixed_point)
        return y if bias is None else y + bias
    x2 = _rows(x)
    if not _kernel_takes(m, x2, q.shape[0]):
        y = _dense_chunked(x2, q.shape[0],
                           lambda a, b, out: int4_dequantize(q[a:b], scales[a:b], mins[a:b], group, out),
                           bias, scratch)
    else:
        y = m.int4_linear(x2.float(), q, scales, mins, group, fixed=fixed_point).to(x2.dtype)
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


BF16_WIDEN_DENSE_ROWS = 256
"""Input rows from which bf16_linear widens the whole bfloat16 weight to float32 (into a DenseScratch) for one
oneDNN float32 GEMM, where its layer's shape does not fit the tiles: the kernel's panels against bench.py's
`bf16 upcast` row, under the AVX2 build, won at 128 rows and lost at 512."""


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                scratch: DenseScratch | None = None) -> torch.Tensor:
    """x [..., K] bfloat16 or float32, w [N, K] bfloat16 -> [..., N] in x's dtype, computed in float32 (exact
    products, float32 sums, one rounding of the result to x's dtype): a CPU without native bfloat16 keeps
    the half-size weights without PyTorch's emulated bfloat16 matmul. The C++ kernel widens the weight in
    registers (decode sizes) or per panel / tile; prefill sizes whose layer the tiles do not fit widen it
    whole for oneDNN's float32 GEMM."""
    m = _module()
    x2 = _rows(x).float()
    n_out, k = w.shape
    kernel = m is not None and x2.is_cpu and w.dtype == torch.bfloat16 and w.is_contiguous() and k % 32 == 0 \
        and (x2.shape[0] < BF16_WIDEN_DENSE_ROWS or tiles_fit(n_out, k))
    if kernel:
        y = m.bf16_linear(x2, w)
        y = y if bias is None else y + bias
    else:
        y = _dense_chunked(x2, n_out, lambda a, b, out: w[a:b].float() if out is None else out.copy_(w[a:b]),
                           None if bias is None else bias.float(), scratch)
    return y.to(x.dtype).reshape(*x.shape[:-1], n_out)
