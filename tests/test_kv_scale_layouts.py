"""scripts/kv_scale_layouts.py's per-block scale emulation (the README's per-block quality figures come from it):
tokens appended one write at a time end with their block's exact absmax scale in every slot, earlier codes
requantized when it grows (a rounding per growth: within one step for the few growths here; half a step from
the full-precision shadow), and a write at offset 0 of a reused block starts its scale afresh."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvserve.kv_cache.quant import QuantizedKVCache, dequantize, quantize

_SPEC = importlib.util.spec_from_file_location(
    "kv_scale_layouts", Path(__file__).resolve().parents[1] / "scripts" / "kv_scale_layouts.py")
layouts = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(layouts)

BS, HKV, D = 4, 2, 8


@pytest.mark.filterwarnings("ignore:index_reduce")
@pytest.mark.parametrize("oracle, steps", [(False, 1.0), (True, 0.5)])
def test_block_scales_grow_requantize_and_reset(oracle, steps):
    writer = layouts.BlockScaleWriter(oracle)
    cache = QuantizedKVCache(torch.zeros(3, BS, 2, HKV, D, dtype=torch.int8),
                             torch.ones(3, BS, 2, HKV, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, HKV, D, generator=g)
    x[2] *= 3      # grows block 1's scale after two tokens were written with a smaller one
    x[4] *= 0.1    # block 2 starts small and grows at each of its next tokens
    slots = torch.arange(4, 12)                                       # blocks 1 and 2, in order
    writer(cache, slots[:2], x[:2, 0], x[:2, 1])                     # a two-token chunk, then decodes
    for t in range(2, 8):
        writer(cache, slots[t:t + 1], x[t:t + 1, 0], x[t:t + 1, 1])
    assert writer.grown_blocks >= 2
    for b in (1, 2):
        tokens = x[(b - 1) * BS:b * BS]                                # [BS, 2, Hkv, D]
        _, exact = quantize(tokens.permute(1, 2, 0, 3).reshape(2, HKV, BS * D), torch.int8)
        assert torch.equal(cache.scales[b], exact.expand(BS, 2, HKV))  # the block's scale, in all its slots
    scales = cache.scales.view(-1, 2, HKV)[slots].float()
    err = (dequantize(cache.values, cache.scales).view(-1, 2, HKV, D)[slots] - x).abs()
    assert (err <= scales[..., None] * (steps + 1e-4)).all()
    # block 2 freed and reused: its first write (offset 0) sets a fresh, small scale
    writer(cache, slots[4:5], x[:1, 0] * 1e-3, x[:1, 1] * 1e-3)
    assert (cache.scales[2, 0].float() < 0.01).all()


@pytest.mark.filterwarnings("ignore:index_reduce")
def test_groups_of_slots_within_a_block_have_their_own_scales():
    writer = layouts.BlockScaleWriter(oracle=False, group=2)
    cache = QuantizedKVCache(torch.zeros(2, BS, 2, HKV, D, dtype=torch.int8),
                             torch.ones(2, BS, 2, HKV, dtype=torch.bfloat16))
    x = torch.randn(BS, 2, HKV, D, generator=torch.Generator().manual_seed(1))
    for t in range(BS):
        writer(cache, torch.tensor([BS + t]), x[t:t + 1, 0], x[t:t + 1, 1])
    for grp in range(BS // 2):
        _, exact = quantize(x[2 * grp:2 * grp + 2].permute(1, 2, 0, 3).reshape(2, HKV, 2 * D), torch.int8)
        assert torch.equal(cache.scales[1, 2 * grp:2 * grp + 2], exact.expand(2, 2, HKV))
    with pytest.raises(ValueError, match="must divide the block size"):
        layouts.BlockScaleWriter(oracle=False, group=3)(cache, torch.tensor([0]), x[:1, 0], x[:1, 1])


def test_fp8_tensor_scale_divides_and_clamps():
    quantize_tensor = layouts.fp8_tensor_quantize(0.5)
    x = torch.tensor([[1.0, -300.0, 0.25]])
    values, scales = quantize_tensor(x, torch.float8_e4m3fn)
    assert values.float().tolist() == [[2.0, -448.0, 0.5]] and scales.float().tolist() == [0.5]


@pytest.mark.filterwarnings("ignore:index_reduce")
@pytest.mark.parametrize("part", [0, 1])
def test_block_scales_for_one_of_k_and_v_only(part):
    """block-k / block-v: the chosen half shares its block's scale, the other keeps each token's own."""
    writer = layouts.BlockScaleWriter(oracle=False, parts=(part,))
    cache = QuantizedKVCache(torch.zeros(2, BS, 2, HKV, D, dtype=torch.int8),
                             torch.ones(2, BS, 2, HKV, dtype=torch.bfloat16))
    x = torch.randn(BS, 2, HKV, D, generator=torch.Generator().manual_seed(2))
    x *= torch.arange(1.0, BS + 1)[:, None, None, None]               # every token grows the block's scale
    for t in range(BS):
        writer(cache, torch.tensor([BS + t]), x[t:t + 1, 0], x[t:t + 1, 1])
    _, per_token = quantize(x, torch.int8)                             # [BS, 2, Hkv]
    _, per_block = quantize(x.permute(1, 2, 0, 3).reshape(2, HKV, BS * D), torch.int8)
    assert torch.equal(cache.scales[1, :, part], per_block[part].expand(BS, HKV))
    assert torch.equal(cache.scales[1, :, 1 - part], per_token[:, 1 - part])
    err = (dequantize(cache.values, cache.scales)[1] - x).abs() / cache.scales[1].float()[..., None]   # in steps
    assert (err[:, 1 - part] <= 0.5 + 1e-4).all()   # never requantized when the other half's scale grows
    assert (err[:, part] <= BS / 2).all()           # a rounding per growth, each <= 1/2 step of the final scale
