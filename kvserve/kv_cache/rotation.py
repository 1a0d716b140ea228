"""The rotation a quantized KV cache stores K and V in: an orthonormal Hadamard matrix R over head_dim.

    stored K = K R,  stored V = V R;  the query is rotated too (q R), so q R (K R)^T = q K^T, and the attention
    output, a mix of rotated V rows, is rotated back (o R^T = o R: R is symmetric and its own inverse).

Why: quantization error is set by each scale's range, and K/V rows have a few channels far larger than the
rest (RoPE's low frequencies, the "massive" channels). R spreads every channel over all of head_dim, so a
row's (and a block's) absmax comes down toward its RMS and the same byte holds more of each element
(QuaRot and SpinQuant rotate K/V for the same reason). On SmolLM2 it cut the int8 cache's KL to the fp32
model by 4x at one scale per token, and is what lets one scale per block meet 98% top-1 agreement
(docs/features/kv-cache-quantization.md). The attention itself is unchanged up to float rounding, so an unquantized cache is
never rotated.

R is the Sylvester Hadamard matrix scaled by 1/sqrt(n), for the largest power of two n that divides head_dim,
repeated along the diagonal when n < head_dim (head_dim 80: five blocks of 16; an odd head_dim: no rotation).
"""
from __future__ import annotations

import functools

import torch


def hadamard_size(head_dim: int) -> int:
    """The largest power of two dividing head_dim: the size of R's diagonal blocks."""
    return head_dim & -head_dim


@functools.lru_cache(maxsize=16)
def rotation(head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """R [head_dim, head_dim]: orthonormal and symmetric (R @ R = I)."""
    n = hadamard_size(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    r = torch.block_diag(*[h / n ** 0.5] * (head_dim // n))
    return r.to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> x R in x's dtype, a new contiguous tensor (also the inverse rotation: R is its own
    inverse). Computed in float32: R's entries (1/sqrt(n)) are not all bf16 values, and a bf16 product would
    round every element once more before it is quantized."""
    r = rotation(x.shape[-1], torch.float32, str(x.device))
    return torch.matmul(x.float(), r).to(x.dtype)
