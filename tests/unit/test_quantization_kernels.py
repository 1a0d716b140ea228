"""Weight-only quantization's numbers (`--quantization int8 | int4 | gguf`): each format's quantize ->
dequantize round trip against its reference formula (GGUF blocks against the gguf package's own dequantization);
every quantized method's apply equals F.linear on its dequantized weight (1 to 512 rows, with and without the C++
kernels, float32 and fixed-point rows); the tiles and the dense path take the rows they should."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.linear_methods import OneDNNPackedMethod
from kvserve.layers.quant import kernels
from kvserve.layers.quant.gguf import GGUFMethod
from kvserve.model_loader.gguf_blocks import GGUFWeight, q4_blocks, q8_0_blocks
from kvserve.layers.quant.int4 import Int4WeightOnlyMethod, quantize_int4
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod, quantize_int8
from tests.helpers.quant import linear_layer

Q = gguf.GGMLQuantizationType


@pytest.fixture(params=["kernel", "torch"])
def kernel_path(request, monkeypatch):
    """Run a test on the C++ kernels and on the PyTorch fallback (as where the extension does not build)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "_module", lambda: None)
    elif not kernels.available():
        pytest.skip("the quantized-linear C++ extension does not build here")
    return request.param


# ---- round trips ---------------------------------------------------------------------------------------
def test_int8_round_trip_is_the_per_channel_symmetric_formula():
    torch.manual_seed(0)
    w = torch.randn(96, 160) * torch.rand(96, 1)                              # rows of different ranges
    q, scales = quantize_int8(w)
    ref_scales = w.abs().amax(dim=1, keepdim=True) / 127
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    assert torch.equal(q, torch.round(w / ref_scales).clamp(-127, 127).to(torch.int8))
    deq = kernels.int8_dequantize(q, scales, w.shape[1])
    assert torch.equal(deq, q.float() * ref_scales)
    assert bool(((w - deq).abs() <= ref_scales / 2 + 1e-7).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_group_round_trip_is_the_group_symmetric_formula(group, kernel_path):
    torch.manual_seed(7)
    w = torch.randn(48, 256) * torch.rand(48, 256 // group).repeat_interleave(group, 1)  # groups of different ranges
    q, scales = quantize_int8(w, group)
    g = w.reshape(48, -1, group)
    ref_scales = g.abs().amax(-1) / 127
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    ref_q = torch.round(g / ref_scales[..., None]).clamp(-127, 127).reshape(48, 256)
    assert torch.equal(q.float(), ref_q)
    step = ref_scales.repeat_interleave(group, 1)
    ref = ref_q * step
    assert bool(((w - ref).abs() <= step / 2 + 1e-7).all())
    layer = linear_layer(w, Int8WeightOnlyMethod(group))
    torch.testing.assert_close(layer.method.dequantized_weight(layer), ref, rtol=0, atol=0)
    # Q8_0 is this format at group 32: requantizing Q8_0's own dequantized values finds its codes again
    if group == 32:
        blocks = gguf.quants.quantize(w.numpy(), Q.Q8_0)
        exact = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0).reshape(48, 256))
        q8, s8 = q8_0_blocks(GGUFWeight(blocks, Q.Q8_0, (48, 256)))
        q2, s2 = quantize_int8(exact, 32)
        assert torch.equal(q2, q8)
        torch.testing.assert_close(s2, s8, rtol=2e-7, atol=0)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_the_group_min_scale_formula(group, kernel_path):
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    q, scales, mins = quantize_int4(w, group)
    g = w.reshape(48, -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    torch.testing.assert_close(mins, lo, rtol=0, atol=0)
    torch.testing.assert_close(scales, (hi - lo) / 15, rtol=0, atol=0)
    ref_q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).reshape(48, 256)
    assert torch.equal(q.float(), ref_q)
    ref = ref_q * scales.repeat_interleave(group, 1) + lo.repeat_interleave(group, 1)
    assert bool(((w - ref).abs() <= scales.repeat_interleave(group, 1) / 2 + 1e-6).all())
    layer = linear_layer(w, Int4WeightOnlyMethod(group))
    torch.testing.assert_close(layer.method.dequantized_weight(layer), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_repack_to_gguf_dequantize(ggml_type, kernel_path):
    torch.manual_seed(2)
    w = torch.randn(40, 192)
    weight = GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type, (40, 192))
    ref = torch.from_numpy(gguf.quants.dequantize(weight.blocks, ggml_type).reshape(40, 192))
    if ggml_type == Q.Q8_0:
        q, scales = q8_0_blocks(weight)
        got = kernels.int8_dequantize(q, scales, 32)
    else:
        q, scales, mins = q4_blocks(weight)
        got = kernels.int4_dequantize(q, scales, mins, 32)
    # Q4_0: d * (q - 8) in gguf versus q * d + (-8 d) here, one float32 rounding apart
    torch.testing.assert_close(got, ref, rtol=0, atol=0 if ggml_type != Q.Q4_0 else 1e-6)
    # row and block-aligned column slices (fused parts, row-parallel shards) select the same weights
    torch.testing.assert_close(weight.narrow(0, 8, 16).dequantize(), ref[8:24], rtol=0, atol=0)
    torch.testing.assert_close(weight.narrow(1, 64, 96).dequantize(), ref[:, 64:160], rtol=0, atol=0)
    with pytest.raises(ValueError, match="32-column blocks"):
        weight.narrow(1, 16, 32)


def test_builtin_q4_1_tensor_repacks_exactly(smollm2_path):
    reader = gguf.GGUFReader(smollm2_path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == Q.Q4_1
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = GGUFWeight(np.array(tensor.data).reshape(shape[0], -1), Q.Q4_1, shape)
    q, scales, mins = q4_blocks(weight)
    ref = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    torch.testing.assert_close(kernels.int4_dequantize(q, scales, mins, 32), ref, rtol=0, atol=0)


# ---- apply vs F.linear on the dequantized weight ---------------------------------------------------------
def _methods():
    yield "int8 per-channel", Int8WeightOnlyMethod(), None
    for group in (32, 128):
        yield f"int8 g{group}", Int8WeightOnlyMethod(group), None
    for group in (32, 64, 128):
        yield f"int4 g{group}", Int4WeightOnlyMethod(group), None
    for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        yield f"gguf {t.name}", GGUFMethod(OneDNNPackedMethod()), t


@pytest.mark.parametrize("name", [name for name, _, _ in _methods()])
# 13: a full and a partial 8-row pass; 25: the panels (160 outputs: two full panels of 64 and a partial one);
# 100: the panels with x in three blocks of input rows (48, 48, 4); 512: the dense path. With 192 outputs (three
# whole tiles of 64) the tiles take every size from kernels' tile_rows (48) on, 512 included.
@pytest.mark.parametrize("rows", [1, 2, 13, 16, 25, 48, 100, 512])
@pytest.mark.parametrize("n", [160, 192])
@pytest.mark.parametrize("fixed_point", [False, True])
def test_quantized_apply_equals_f_linear_on_dequantized_weight(name, rows, n, fixed_point, kernel_path,
                                                               monkeypatch):
    if fixed_point and rows > 2:
        pytest.skip("fixed point only changes one or two rows")
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "1" if fixed_point else "0")
    _, method, ggml_type = next(m for m in _methods() if m[0] == name)
    torch.manual_seed(3)
    k = 384
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    loaded = None if ggml_type is None else GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type, (n, k))
    layer = linear_layer(w, method, bias, loaded)
    assert layer.weight.numel() == 0, "the full-precision weight is freed"
    deq = method.dequantized_weight(layer)
    if loaded is not None:
        torch.testing.assert_close(deq, loaded.dequantize(), rtol=0, atol=1e-6)
    else:
        # within half a step: int4's step is at most 2 max|w| / 15, int8's max|w| / 127
        assert (deq - w).abs().max() <= w.abs().max() / (15 if name.startswith("int4") else 254) * 1.001
    x = torch.randn(rows, k)
    y = layer(x)
    # with fixed point on (the default), at one or two rows the C++ kernel multiplies a 16-bit fixed-point copy
    # of x (kernels.py)
    x_used = _fixed_point(x) if fixed_point and rows <= kernels.fixed_point_rows() else x
    torch.testing.assert_close(y, F.linear(x_used, deq, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.reshape(rows, 1, k)).reshape(rows, n), y, rtol=1e-5, atol=1e-5)


def _fixed_point(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel's fixed-point rows are: each run of 32 columns to int16 steps of max|run| / 32767."""
    runs = x.double().reshape(x.shape[0], -1, 32)
    step = runs.abs().amax(dim=-1, keepdim=True) / 32767
    return (torch.round(runs / step.clamp_min(1e-300)) * step).reshape(x.shape).float()


@pytest.mark.parametrize("name", ["int8 g32", "int4 g32"])
@pytest.mark.parametrize("rows", [1, 13, kernels.BF16_DENSE_ROWS + 3])
def test_bfloat16_activations_run_the_quantized_matmul(name, rows, kernel_path):
    """--dtype bfloat16 with --quantization: decode-sized rows through the kernel in float32 (not the dense
    path's per-call dequantization), prefill-sized ones through a bfloat16 matmul; bfloat16 out either way."""
    _, method, _ = next(m for m in _methods() if m[0] == name)
    torch.manual_seed(6)
    w = torch.randn(64, 256) * 0.05
    layer = linear_layer(w, method, None)
    x = torch.randn(rows, 256).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), method.dequantized_weight(layer)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["int8 g32", "int4 g32"])
def test_bfloat16_rows_without_native_bf16_stay_in_float32(name, kernel_path, monkeypatch):
    """No native bf16 (PyTorch's bf16 matmul emulated): prefill-sized bf16 rows of a quantized layer take the
    float32 kernel where its tiles fit, and the dense path multiplies in float32 where they do not."""
    from kvserve.utils import cpu_features

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    _, method, _ = next(m for m in _methods() if m[0] == name)
    torch.manual_seed(8)
    for n in (192, 160):
        layer = linear_layer(torch.randn(n, 256) * 0.05, method, None)
        x = torch.randn(kernels.DENSE_ROWS + 3, 256).bfloat16()
        m = kernels._module()
        assert kernels._kernel_takes(m, x, n) == (m is not None and kernels.tiles_fit(n, 256))
        y = layer(x)
        assert y.dtype == torch.bfloat16
        ref = F.linear(x.float(), method.dequantized_weight(layer))
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-5)  # one rounding to bf16


@pytest.mark.parametrize("k", [256, 224])  # 224: an odd number of runs of 32 (the kernel pairs them)
def test_fixed_point_rows_are_within_their_rounding_bound(k, kernel_path, monkeypatch):
    """KVSERVE_QUANT_FIXED_POINT=1's only departure from float32: each input run of 32 columns rounded to 2^-16
    of its largest |x| (an outlier column coarsens only its own run), so |y - x W^T| <= sum_k |w_k| step_k / 2."""
    if kernels.fixed_point_rows() == 0:
        pytest.skip("no fixed-point rows on this path")
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "1")
    torch.manual_seed(5)
    n = 96
    w = torch.randn(n, k) * 0.05
    layer = linear_layer(w, Int8WeightOnlyMethod(32), None)
    deq = layer.method.dequantized_weight(layer)
    for rows in range(1, kernels.fixed_point_rows() + 1):
        x = torch.randn(rows, k)
        x[:, 7] = 50.0                                             # an outlier in the first run only
        exact = F.linear(x.double(), deq.double())
        step = x.reshape(rows, -1, 32).abs().amax(-1).double() / 32767            # [rows, runs]
        bound = (deq.double().abs().reshape(n, -1, 32).sum(-1) @ step.T).T / 2     # [rows, n]
        err = (layer(x).double() - exact).abs()
        assert (err <= bound + 1e-5).all()
        assert err.max() > 0, "rounded: not the float32 kernel"
        assert err[:, :].max() < 1e-3


@pytest.mark.parametrize("name", ["int8 g32", "int4 g32", "gguf Q8_0"])
def test_dense_path_in_row_chunks_through_one_shared_scratch(name, kernel_path, monkeypatch):
    """Prefill-sized inputs on a layer bigger than DENSE_CHUNK (the LM head) run in chunks of output rows,
    the last one partial, through the method's one scratch buffer, which layers of other shapes reuse."""
    _, method, ggml_type = next(m for m in _methods() if m[0] == name)
    monkeypatch.setattr(kernels, "DENSE_CHUNK", 64 * 384)
    monkeypatch.setattr(kernels, "DENSE_CHUNK_ROWS", 48)
    torch.manual_seed(4)
    layers = []
    for n, k in ((160, 384), (40, 256), (224, 384)):  # chunked, whole (fits), chunked again
        w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
        loaded = None if ggml_type is None else GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type,
                                                           (n, k))
        layers.append((linear_layer(w, method, bias, loaded), bias, k))
    for _ in range(2):
        for layer, bias, k in layers:
            x = torch.randn(kernels.DENSE_ROWS + 5, k)
            torch.testing.assert_close(layer(x), F.linear(x, method.dequantized_weight(layer), bias),
                                       rtol=1e-5, atol=1e-5)


def test_gguf_layer_with_mixed_parts_falls_back_to_dense():
    """A fused layer whose parts are Q8_0 and Q4_1 (or a dequantized type) runs dense on the exact values."""
    from kvserve.layers.linear import MergedColumnParallelLinear

    torch.manual_seed(4)
    gate, up = torch.randn(64, 96), torch.randn(64, 96)
    layer = MergedColumnParallelLinear(96, [64, 64], False, GGUFMethod(OneDNNPackedMethod()))
    parts = [GGUFWeight(gguf.quants.quantize(w.numpy(), t), t, (64, 96)) for w, t in ((gate, Q.Q8_0), (up, Q.Q4_1))]
    for shard_id, part in enumerate(parts):
        layer.weight_loader("weight", part, shard_id)
    layer.process_weights_after_loading()
    assert layer.quant_format == "dense"
    ref = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(layer.weight, ref, rtol=0, atol=0)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)



def test_fixed_point_rows_are_the_default_and_zero_turns_them_off(monkeypatch):
    monkeypatch.delenv("KVSERVE_QUANT_FIXED_POINT", raising=False)
    assert Int8WeightOnlyMethod(32).fixed_point
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "0")
    assert not Int8WeightOnlyMethod(32).fixed_point


def test_tiles_take_prefill_sized_float32_rows_where_they_fit():
    """From tile_rows on, float32 rows of a layer with whole tiles of output rows stay in the C++ kernel (the
    tiles), any number of them; a layer without whole tiles goes dense from DENSE_ROWS, as bfloat16 rows do from
    BF16_DENSE_ROWS."""
    m = kernels._module()
    if m is None or m.tile_rows() == 0:
        pytest.skip("no tiled kernel here (needs the C++ extension with AVX-512)")
    assert kernels.tiles_fit(192, 384) and not kernels.tiles_fit(160, 384) and not kernels.tiles_fit(192, 376)
    big = torch.randn(2 * kernels.DENSE_ROWS, 384)
    assert kernels._kernel_takes(m, big, 192) and not kernels._kernel_takes(m, big, 160)
    assert not kernels._kernel_takes(m, big.bfloat16(), 192)
