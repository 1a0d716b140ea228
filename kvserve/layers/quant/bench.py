"""Which kernel is fastest at SmolLM2's linear shapes: `python -m kvserve.layers.quant.bench [--layers N]`.

Times the four projections of a decoder layer (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) for
1, 16 and 512 input rows, cycling through `--layers` distinct copies so that the weights come from memory as in
a whole model's decode, not from cache. NOTE: the default 6 copies hold ~21 MB of int8 (~85 MB of fp32), which
a 32 MB L3 keeps: for the quantized rows' memory-bound case (1-2 rows) pass `--layers 30`, SmolLM2's count, as
the in-model figures do. Rows: the fp32 oneDNN method (the default); our int8 / int4 / GGUF
Q8_0 methods (kernels.py); PyTorch's own weight-only kernels with float32 and with bfloat16 activations;
and F.linear on a bfloat16 copy of the weight (bfloat16 activations too); our bfloat16-weight method (float32
compute, for CPUs without native bfloat16) through its kernel and widened whole for oneDNN (`bf16 upcast`); and
the int8 g32 kernel with one of its paths turned off (`float rows`: no fixed point at 1-2 rows; `panels`: no
register kernel; `no tiles`), which is how the row thresholds in csrc/quant_linear.cpp are chosen for each
instruction set (KVSERVE_CPU_ISA=avx2 runs the AVX2 build; ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN's float32
rows an AVX2 machine's too). It also prints how far GGUF
Q8_0 blocks move when rescaled to one scale per output channel (the lossy way onto `_weight_int8pack_mm`).
Figures go to docs and commit messages, not code comments.
"""
from __future__ import annotations

import argparse
import time

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.linear_methods import OneDNNPackedMethod
from kvserve.layers.quant import kernels
from kvserve.layers.quant.bf16 import Bf16WidenMethod
from kvserve.layers.quant.gguf import GGUFMethod
from kvserve.layers.quant.int4 import Int4WeightOnlyMethod, quantize_int4
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod, quantize_int8
from kvserve.model_loader.gguf_blocks import GGUFWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def _layer(weight: torch.Tensor, method=None, loaded=None) -> nn.Module:
    from kvserve.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], False, method)
    layer.weight_loader("weight", weight if loaded is None else loaded)
    layer.process_weights_after_loading()
    return layer


def _torch_int8(w: torch.Tensor, dtype: torch.dtype):
    q, s = quantize_int8(w)
    s = s[:, 0].to(dtype)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dtype), q, s)


def _torch_int4(w: torch.Tensor, dtype: torch.dtype, group: int = 64):
    q, scales, mins = quantize_int4(w, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    sz = torch.stack([scales.t(), (mins + 8 * scales).t()], dim=-1).to(dtype).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, group, sz)


def _bf16(w: torch.Tensor):
    wb = w.bfloat16()
    return lambda x: F.linear(x.bfloat16(), wb)


def _q8_0(w: torch.Tensor):
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return _layer(w, GGUFMethod(OneDNNPackedMethod()), GGUFWeight(blocks, gguf.GGMLQuantizationType.Q8_0, w.shape))


def _int8_raw(w: torch.Tensor, **paths):
    """The int8 g32 C++ kernel called directly, with the given paths (fixed, small, tiles) turned off."""
    q, s = quantize_int8(w, 32)
    m = kernels._module()
    return lambda x: m.int8_linear(x, q, s, 32, **{"fixed": True, "small": True, "tiles": True, **paths})


def _bf16_widen(w: torch.Tensor):
    return _layer(w.bfloat16().float(), Bf16WidenMethod()).to(torch.bfloat16)


def _bf16_upcast(w: torch.Tensor):
    """bf16_linear's dense path at every size: the weight widened whole into a scratch buffer, oneDNN float32."""
    wb, scratch = w.bfloat16(), kernels.DenseScratch()
    return lambda x: kernels._dense_chunked(x, wb.shape[0], lambda a, b, out: out.copy_(wb[a:b]), None, scratch)


def _int8_whole_copy(w: torch.Tensor):
    """The dense path as it was: the whole weight dequantized into a new float32 tensor per call."""
    method = Int8WeightOnlyMethod()
    method.scratch = None
    layer = _layer(w, method)

    def run(x: torch.Tensor) -> torch.Tensor:
        chunk, kernels.DENSE_CHUNK = kernels.DENSE_CHUNK, w.numel()
        try:
            return layer(x)
        finally:
            kernels.DENSE_CHUNK = chunk
    return run


KERNELS = {
    "fp32 onednn": lambda w: _layer(w, OneDNNPackedMethod()),
    "int8 (ours)": lambda w: _layer(w, Int8WeightOnlyMethod()),
    "int8 whole copy": _int8_whole_copy,
    "int4 g32 (ours)": lambda w: _layer(w, Int4WeightOnlyMethod(32)),
    "int4 g64 (ours)": lambda w: _layer(w, Int4WeightOnlyMethod(64)),
    "gguf q8_0 (ours)": _q8_0,
    "int8 g32 float rows": lambda w: _int8_raw(w, fixed=False),
    "int8 g32 panels": lambda w: _int8_raw(w, small=False, fixed=False),
    "int8 g32 no tiles": lambda w: _int8_raw(w, tiles=False),
    "bf16 widen (ours)": _bf16_widen,
    "bf16 upcast": _bf16_upcast,
    "torch int8 f32": lambda w: _torch_int8(w, torch.float32),
    "torch int8 bf16": lambda w: _torch_int8(w, torch.bfloat16),
    "torch int4 f32": lambda w: _torch_int4(w, torch.float32),
    "torch int4 bf16": lambda w: _torch_int4(w, torch.bfloat16),
    "bf16 F.linear": _bf16,
}


def _time(fns, reps: int) -> float:
    with torch.inference_mode():
        for f in fns:
            f()
        t = time.perf_counter()
        for _ in range(reps):
            for f in fns:
                f()
        return (time.perf_counter() - t) / reps


def _q8_0_per_channel_error(w: torch.Tensor) -> float:
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    exact = GGUFWeight(blocks, gguf.GGMLQuantizationType.Q8_0, tuple(w.shape)).dequantize()
    q, s = quantize_int8(exact)
    return float((q.float() * s - exact).norm() / exact.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6,
                        help="distinct decoder layers cycled through (30: more int8 weight than a 32 MB L3 holds)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared machine, where a descheduled OpenMP "
                             "thread stalls every parallel region)")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--lm-head", action="store_true", help="time the LM head's shape (49152 x 576) instead")
    args = parser.parse_args()
    shapes = [LM_HEAD] if args.lm_head else SHAPES
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for n, k in shapes] for _ in range(args.layers)]
    print(f"C++ quantized kernels: {kernels.isa() or 'unavailable (PyTorch fallback)'}; "
          f"threads {args.threads}; {args.layers} layers cycled")
    print(f"GGUF Q8_0 rescaled to per-channel int8: relative weight error "
          f"{max(_q8_0_per_channel_error(w) for w in weights[0]):.2e}")
    print(f"{'kernel':18s} " + " ".join(f"{'M=' + str(m):>14s}" for m in args.rows) + ("   ms per LM head" if args.lm_head else "   ms per decoder layer"))
    base: dict[int, float] = {}
    for name in args.kernels:
        fns = [KERNELS[name](w) for layer in weights for w in layer]
        cells = []
        for m in args.rows:
            xs = [torch.randn(m, k) for _ in range(args.layers) for _, k in shapes]
            reps = args.reps if m < 512 or not name.startswith("torch") or "bf16" in name else 1
            dt = _time([lambda f=f, x=x: f(x) for f, x in zip(fns, xs)], reps) / args.layers
            base.setdefault(m, dt)
            cells.append(f"{dt * 1e3:8.3f} {base[m] / dt:4.2f}x")
        print(f"{name:18s} " + " ".join(f"{c:>14s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
