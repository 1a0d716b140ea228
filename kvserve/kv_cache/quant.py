"""The quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3`): one byte per element, one bfloat16 scale per
token and KV head, for K and for V.

    stored = quantize(x / scale),  scale = up_to_bf16(absmax(x over head_dim) / qmax),  x ~= stored * scale

int8 is symmetric (round to nearest, qmax 127: error <= scale / 2 per element); fp8_e4m3 is
torch.float8_e4m3fn (qmax 448, 3 mantissa bits: relative error <= 2^-4 per element). A scale per
(slot, kv_head) rather than per block: a token is written once and never rewritten, so its scale is final
when it is written, and one outlier token cannot coarsen its neighbours' grid (measured: a scale per block
of 16, or even per 4 tokens, costs int8 about a point of top-1 agreement on SmolLM2, README "Quantized KV
cache"; scripts/kv_scale_layouts.py).

The scale is bfloat16 (2 bytes: 3.88x a float32 cache's tokens at head_dim 64, against 3.76x with float32
scales) and is rounded *up* to the next bfloat16 before the row is divided by it, so that |x / scale| stays
within qmax and the stored (code, scale) pair is exactly what every reader multiplies back: the step is at
most 2^-7 (0.8%) larger than absmax / qmax.

The scales live in their own tensor beside the values (`QuantizedKVCache`), laid out as the values are
without head_dim; both come from one allocation each for all layers (kv_cache/pool.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
"""--kv-cache-dtype's choices (vLLM's names: its `fp8` is `fp8_e4m3`); auto: the model's dtype, values stored as
they are."""
_QUANTIZED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_MIN_AMAX = 1e-30
SCALE_DTYPE = torch.bfloat16
"""The scales' type: 2 bytes per (token, kv_head, K/V), about 3% on top of a head_dim-64 int8 cache."""


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type K/V are stored in for --kv-cache-dtype `name`."""
    if name == "auto":
        return model_dtype
    if name not in _QUANTIZED:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _QUANTIZED[name]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def dtype_name(dtype: torch.dtype) -> str:
    """int8, fp8_e4m3, or torch's own name (float32, bfloat16, ...): what logs and metrics show."""
    names = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class QuantizedKVCache:
    """One layer's quantized cache: what a backend's `forward` gets as `kv_cache` when the spec is quantized.
    Index i of `scales` belongs to index i of `values` with head_dim dropped."""

    values: torch.Tensor   # [num_blocks, block_size, 2, Hkv, D] int8 | float8_e4m3fn (the backend's shape)
    scales: torch.Tensor   # [num_blocks, block_size, 2, Hkv] bfloat16 (SCALE_DTYPE)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive finite float32 `x` -> the smallest bfloat16 >= x, as float32 (bf16 is float32's top 16 bits:
    adding 0xFFFF before truncating carries into them unless the low bits are already zero)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] of `dtype`, scales [...] SCALE_DTYPE), one scale per row of D."""
    qmax = _QMAX[dtype]
    amax = x.detach().abs().amax(dim=-1).float()                              # [...]
    # NOTE: the floor keeps an all-zero row from dividing 0 by 0 (its values are 0 whatever its scale); the
    # cap keeps the rounded scale finite.
    scales = round_up_to_bf16(amax.clamp_(_MIN_AMAX, 3e38).div_(qmax))        # [...] exactly a bf16 value
    y = x.float() / scales.unsqueeze(-1)                                      # [..., D] within [-qmax, qmax]
    if dtype == torch.int8:
        y = y.round_()
    # NOTE: clamped for fp8 too: 448 * (1 + ulp) from the division would round to NaN in e4m3fn (no inf).
    return y.clamp_(-qmax, qmax).to(dtype), scales.to(SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., D], scales [...] -> [..., D] of `dtype`."""
    return (values.to(torch.float32) * scales.float().unsqueeze(-1)).to(dtype)
