"""The quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3`): one byte per element, one bfloat16 scale per
block, KV head and K/V; K and V stored rotated (kv_cache/rotation.py).

    stored = quantize(x / scale),  scale = up_to_bf16(absmax(x over the block's tokens and head_dim) / qmax)

int8 is symmetric (round to nearest, qmax 127: error <= scale / 2 per element); fp8_e4m3 is
torch.float8_e4m3fn (qmax 448, 3 mantissa bits: relative error <= 2^-4 per element).

A scale per block rather than per token: 2 bytes per 16 tokens instead of per token, so a head_dim-64 cache
holds 3.99x a float32 cache's tokens instead of 3.88x. Without the rotation one scale per block cost int8
a point of top-1 agreement on SmolLM2 (a token with a large channel coarsened its 15 neighbours' grid);
with it the block layout is within 0.2 points of a scale per token and above 98% top-1 agreement
(docs/features/kv-cache-quantization.md).

Tokens reach a block over several writes (chunks, decodes), so its scale is set by the first write at its
offset 0 and grows when a later write needs more: the block's earlier codes are then requantized to the
new scale (codes * old / new, rounded once more). A block is written only by the one request that owns
it while it is partial (prefix caching shares full blocks only), and a full block is never written
again, so a block's codes never change under a reader that did not write them.

The scale is rounded *up* to the next bfloat16 before values are divided by it, so that |x / scale| stays
within qmax and the stored (code, scale) pair is exactly what every reader multiplies back.

`write_block_scaled` is the write rule in PyTorch (the torch_ref backend's, and the oracle of the C++
kernel's `write_kv_quantized_`, which must produce the same bytes). `quantize` / `dequantize` work on rows
with a scale each: the per-token layout the C++ kernel also reads (its tests use it).
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
"""The scales' type: 2 bytes per (block, kv_head, K/V)."""


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
    scales[b, i, h] is the scale of every slot of block b's part i (0: K, 1: V) of KV head h."""

    values: torch.Tensor   # [num_blocks, block_size, 2, Hkv, D] int8 | float8_e4m3fn (the backend's shape)
    scales: torch.Tensor   # [num_blocks, 2, Hkv] bfloat16 (SCALE_DTYPE)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive finite float32 `x` -> the smallest bfloat16 >= x, as float32 (bf16 is float32's top 16 bits:
    adding 0xFFFF before truncating carries into them unless the low bits are already zero)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale (float32, exactly a bf16 value) that maps absmax `amax` onto the code range of `dtype`."""
    # NOTE: the floor keeps an all-zero row from dividing 0 by 0 (its values are 0 whatever its scale); the
    # cap keeps the rounded scale finite.
    return round_up_to_bf16(amax.float().clamp(_MIN_AMAX, 3e38).div_(_QMAX[dtype]))


def encode(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (float32, already divided by its scale) -> codes of `dtype`: int8 rounds to nearest (half to even)."""
    qmax = _QMAX[dtype]
    if dtype == torch.int8:
        y = y.round()
    # NOTE: clamped for fp8 too: 448 * (1 + ulp) from the division would round to NaN in e4m3fn (no inf).
    return y.clamp(-qmax, qmax).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] of `dtype`, scales [...] SCALE_DTYPE), one scale per row of D."""
    scales = scale_for(x.detach().abs().amax(dim=-1), dtype)                 # [...] exactly a bf16 value
    return encode(x.float() / scales.unsqueeze(-1), dtype), scales.to(SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., D], scales [...] -> [..., D] of `dtype`."""
    return (values.to(torch.float32) * scales.float().unsqueeze(-1)).to(dtype)


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks x [N, BS, 2, Hkv, D] -> (values [N, BS, 2, Hkv, D] of `dtype`, scales [N, 2, Hkv]
    SCALE_DTYPE): what write_block_scaled stores for blocks written whole (rotated or not: x as given)."""
    scales = scale_for(x.detach().abs().amax(dim=(1, 4)), dtype)             # [N, 2, Hkv]
    return encode(x.float() / scales[:, None, :, :, None], dtype), scales.to(SCALE_DTYPE)


def write_block_scaled(cache: QuantizedKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize k/v [T, Hkv, D] (already rotated) into `cache` at `slots` [T], one scale per block (module
    docstring): per (block, K/V, head), the write's tokens take the scale max(old, theirs), or theirs alone
    when the write reaches the block's offset 0 (a new block); a grown scale requantizes the block's codes."""
    values, scales = cache.values, cache.scales                               # [N, BS, 2, H, D], [N, 2, H]
    bs = values.shape[1]
    kv = torch.stack((k, v), dim=1).float()                                   # [T, 2, H, D]
    blocks, inv = torch.unique(slots // bs, return_inverse=True)              # [U], [T]
    token_amax = kv.abs().amax(-1)                                            # [T, 2, H]
    amax = torch.zeros(len(blocks), *kv.shape[1:3], device=kv.device)
    amax.scatter_reduce_(0, inv[:, None, None].expand_as(token_amax), token_amax, "amax")   # [U, 2, H]
    need = scale_for(amax, cache.dtype)
    reset = torch.zeros(len(blocks), dtype=torch.bool, device=kv.device)
    reset.index_fill_(0, inv[slots % bs == 0], True)                          # [U]
    old = scales[blocks].float()                                              # [U, 2, H]
    new = torch.where(reset[:, None, None], need, torch.maximum(old, need))
    grown = (new > old) & ~reset[:, None, None]                               # [U, 2, H]
    # NOTE: bytes through uint8 views: torch's CPU index ops have no float8 kernels (a byte copy either way).
    as_bytes = values.view(torch.uint8)
    if grown.any():
        held = as_bytes[blocks]                                               # [U, BS, 2, H, D]
        ratio = torch.where(grown, old / new, 1.0)[:, None, :, :, None]
        requantized = encode(held.view(cache.dtype).float() * ratio, cache.dtype).view(torch.uint8)
        as_bytes.index_copy_(0, blocks, torch.where(grown[:, None, :, :, None], requantized, held))
    scales.index_copy_(0, blocks, new.to(SCALE_DTYPE))
    codes = encode(kv / new[inv][..., None], cache.dtype)                     # [T, 2, H, D]
    as_bytes.view(-1, *kv.shape[1:]).index_copy_(0, slots, codes.view(torch.uint8))


def gather_dequantized(cache: QuantizedKVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The K/V rows at `slots` (any shape) -> [*slots.shape, 2, Hkv, D] of `dtype`, dequantized (still rotated).

    NOTE: index_select on 2-D views copies whole rows; advanced indexing on the 5-D tensor was 5-10x slower
    on CPU."""
    values, scales = cache.values, cache.scales
    flat = slots.reshape(-1)
    rows = values.view(torch.uint8).view(-1, values[0, 0].numel()).index_select(0, flat)
    rows = rows.view(values.dtype).view(*slots.shape, *values.shape[2:])
    block_scales = scales.view(scales.shape[0], -1).index_select(0, flat // values.shape[1])
    return dequantize(rows, block_scales.view(*slots.shape, *scales.shape[1:]), dtype)
