"""What other scale layouts of the quantized KV cache would cost in quality, measured before building them:
`kvserve bench quality` with the cache's write path (or quantizer) swapped in this process, on the kernels and
layout as they are.

    python scripts/kv_scale_layouts.py LAYOUT [bench quality flags...]

LAYOUT:
  block[:N]     one scale per (block, KV head, K/V), or per N aligned slots of a block (N divides the block
                size), emulated on the per-slot layout by writing the block's scale into all its slots: the
                first write at slot offset 0 of a block resets it; a later token whose absmax needs a larger
                scale grows it, and the block's earlier codes are requantized to the new scale (codes * old /
                new, rounded: a second rounding)
  block-oracle[:N]
                the same scales, but grown blocks are requantized from a full-precision shadow of every
                token written (no second rounding: the best any per-block rule could do); needs 4 bytes
                per cached element, so pass a small --kv-cache-memory
  block-k[:N], block-v[:N]
                block scales for K only (V keeps a scale per token), or for V only
  fp8-tensor    fp8_e4m3 with one fixed scale for every tensor (vLLM's k_scale = v_scale, default 1.0;
                FP8_SCALE=x to change it): codes = clamp(x / scale, +-448), no per-token scale needed
  fp8-nearest   fp8_e4m3 with the per-token bf16 scale rounded to nearest (codes clamped at 448) rather
                than up

Only the --kv-cache-dtype settings change; the reference is the float32 cache as always. Prints the bench's
table, then (block) how often blocks grew.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

import kvserve.attention.cpu_paged as cpu_paged
import kvserve.attention.prefill as prefill
import kvserve.attention.torch_ref as torch_ref
from kvserve.kv_cache import quant
from kvserve.kv_cache.quant import QuantizedKVCache

LAYOUTS = ("block", "block-oracle", "block-k", "block-v", "fp8-tensor", "fp8-nearest")


def _codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    qmax = quant._QMAX[dtype]
    if dtype == torch.int8:
        y = y.round()
    return y.clamp(-qmax, qmax).to(dtype)


class BlockScaleWriter:
    """write_kv with one scale per (group of `group` slots, KV head, K/V), kept in every slot's scale of the
    group; group None: the whole block. A group is aligned within its block ("block" below means a group).
    `parts`: which of K (0) and V (1) share a block's scale; the others keep one per token."""

    def __init__(self, oracle: bool, group: int | None = None, parts: tuple[int, ...] = (0, 1)):
        self.oracle, self.group = oracle, group
        self.parts = torch.tensor([0 in parts, 1 in parts])[:, None]       # [2, 1] bool
        self.shadows: dict[int, torch.Tensor] = {}   # values' data_ptr -> float32 copy of every token written
        self.writes = self.grown_blocks = 0
        self.unquantized = prefill.write_kv

    def __call__(self, cache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if not isinstance(cache, QuantizedKVCache):
            return self.unquantized(cache, slots, k, v)
        kv = torch.stack((k, v), dim=1).float()                              # [T, 2, Hkv, D]
        dtype, qmax = cache.dtype, quant._QMAX[cache.dtype]
        bs = self.group or cache.values.shape[1]
        if cache.values.shape[1] % bs:
            raise ValueError(f"a scale group of {bs} slots must divide the block size {cache.values.shape[1]}")
        num_blocks = cache.values.shape[0] * cache.values.shape[1] // bs
        blocks, inv = torch.unique(slots // bs, return_inverse=True)         # [U], [T]
        amax = kv.abs().amax(-1)                                             # [T, 2, Hkv]
        need = torch.zeros(len(blocks), *amax.shape[1:]).index_reduce_(0, inv, amax, "amax")
        need = quant.round_up_to_bf16(need.clamp_(quant._MIN_AMAX, 3e38).div_(qmax))
        reset = torch.zeros(len(blocks), dtype=torch.bool).index_put_((inv,), slots % bs == 0, accumulate=True)
        block_scales = cache.scales.view(num_blocks, bs, *amax.shape[1:])    # [groups, bs, 2, Hkv]
        block_values = cache.values.view(num_blocks, bs, *kv.shape[1:])     # [groups, bs, 2, Hkv, D]
        old = block_scales[blocks, 0].float()                                # [U, 2, Hkv]
        new = torch.where(reset[:, None, None], need, torch.maximum(old, need))
        grown = ((new > old) & ~reset[:, None, None] & self.parts).flatten(1).any(1)   # [U]
        per_token = quant.round_up_to_bf16(amax.clamp(quant._MIN_AMAX, 3e38).div_(qmax))   # [T, 2, Hkv]
        slot_scales = torch.where(self.parts, new[inv], per_token)          # [T, 2, Hkv]
        if self.oracle:
            shadow = self.shadows.setdefault(cache.values.data_ptr(), torch.zeros(block_values.shape))
            shadow.view(-1, *kv.shape[1:]).index_copy_(0, slots, kv)
        self.writes += 1
        if grown.any():
            ids = blocks[grown]
            self.grown_blocks += len(ids)
            if self.oracle:
                denom = torch.where(self.parts, new[grown][:, None], block_scales[ids].float())  # [G, bs, 2, Hkv]
                y = shadow[ids] / denom[..., None]
            else:
                ratio = torch.where(self.parts, old[grown] / new[grown], 1.0)   # per-token halves stay
                y = block_values[ids].float() * ratio[:, None, :, :, None]
            block_values.view(torch.uint8)[ids] = _codes(y, dtype).view(torch.uint8)
        flat = cache.values.view(-1, *kv.shape[1:])
        codes = _codes(kv / slot_scales[..., None], dtype)
        flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
        mine = block_scales[blocks]                                          # [U, bs, 2, Hkv]
        block_scales[blocks] = torch.where(self.parts, new.to(quant.SCALE_DTYPE)[:, None], mine)
        cache.scales.view(-1, *kv.shape[1:3]).index_copy_(0, slots, slot_scales.to(quant.SCALE_DTYPE))
        return QuantizedKVCache(flat, cache.scales.view(-1, *kv.shape[1:3]))


def fp8_tensor_quantize(scale: float):
    exact = quant.quantize

    def quantize(x: torch.Tensor, dtype: torch.dtype):
        if dtype != torch.float8_e4m3fn:
            return exact(x, dtype)
        return _codes(x.float() / scale, dtype), torch.full(x.shape[:-1], scale, dtype=quant.SCALE_DTYPE)
    return quantize


def fp8_nearest_quantize():
    exact = quant.quantize

    def quantize(x: torch.Tensor, dtype: torch.dtype):
        if dtype != torch.float8_e4m3fn:
            return exact(x, dtype)
        scales = x.detach().abs().amax(-1).float().clamp_(quant._MIN_AMAX, 3e38).div_(448.0).to(quant.SCALE_DTYPE)
        return _codes(x.float() / scales.float().unsqueeze(-1), dtype), scales
    return quantize


def main(argv: list[str]) -> int:
    layout, _, group = (argv[0] if argv else "").partition(":")
    if layout not in LAYOUTS or (group and (not layout.startswith("block") or not group.isdigit() or int(group) < 1)):
        print(f"usage: kv_scale_layouts.py {{{','.join(LAYOUTS)}}}[:GROUP for block*] [bench quality flags...]",
              file=sys.stderr)
        return 2
    rest = argv[1:]
    warnings.filterwarnings("ignore", message="index_reduce")   # beta API, fine for a measurement
    writer = None
    if layout.startswith("block"):
        parts = {"block-k": (0,), "block-v": (1,)}.get(layout, (0, 1))
        writer = BlockScaleWriter(oracle=layout == "block-oracle", group=int(group) if group else None, parts=parts)
        for module in (prefill, cpu_paged, torch_ref):   # each holds write_kv by name
            module.write_kv = writer
    elif layout == "fp8-tensor":
        prefill.quantize = fp8_tensor_quantize(float(os.environ.get("FP8_SCALE", "1.0")))
    else:
        prefill.quantize = fp8_nearest_quantize()
    from kvserve.cli.main import main as kvserve_main

    rc = kvserve_main(["bench", "quality", *rest])
    if writer is not None:
        print(f"{argv[0]}: {writer.grown_blocks} block scales grown over {writer.writes} cache writes")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
