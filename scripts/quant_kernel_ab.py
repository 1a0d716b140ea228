"""The int8 kernel at decode sizes, this tree's build against another source of it, interleaved in one process:
`python scripts/quant_kernel_ab.py --baseline OLD.cpp` (e.g. `git show REV:kvserve/layers/quant/csrc/quant_linear.cpp
> /tmp/old.cpp`). Prints, per build, the best of `--reps` rounds of: SmolLM2's 30 decoder layers' four
projections at `--rows` input rows (int8, group 32, weights from memory: 106 MB), one 200,000 x 576 layer
(GB/s of int8 weights), and the per-call time of a 32 x 576 layer (the fixed cost of a call).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kvserve.layers.quant.int8 import quantize_int8
from kvserve.utils.cpp_extension import build_extension

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="OLD.cpp")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-fixed-point", action="store_true", help="the float32 kernel instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    here = os.path.join(os.path.dirname(__file__), "..", "kvserve", "layers", "quant", "csrc", "quant_linear.cpp")
    builds = {"baseline": build_extension("kvserve_quant_linear_baseline", args.baseline, "baseline kernel"),
              "this tree": build_extension("kvserve_quant_linear_ab", os.path.abspath(here), "this tree's kernel")}
    fixed = not args.no_fixed_point
    layers = [{n: quantize_int8(torch.randn(o, i) * 0.05, 32) for n, (o, i) in SHAPES.items()} for _ in range(30)]
    x = {576: torch.randn(args.rows, 576), 1536: torch.randn(args.rows, 1536)}
    big = (torch.randint(-127, 128, (200_000, 576), dtype=torch.int8), torch.rand(200_000, 18))
    tiny = quantize_int8(torch.randn(32, 576), 32)

    def model(m):
        for layer in layers:
            for q, s in layer.values():
                m.int8_linear(x[q.shape[1]], q, s, 32, fixed=fixed)

    def small(m):
        for _ in range(200):
            m.int8_linear(x[576], *tiny, 32, fixed=fixed)

    cases = {"30 layers": model, "big": lambda m: m.int8_linear(x[576], *big, 32, fixed=fixed), "call": small}
    best = {b: {c: float("inf") for c in cases} for b in builds}
    for _ in range(args.reps):
        for b, m in builds.items():
            for c, fn in cases.items():
                fn(m)
                start = time.perf_counter()
                fn(m)
                best[b][c] = min(best[b][c], time.perf_counter() - start)
    for b in builds:
        r = best[b]
        print(f"{b:10s} 30 layers {r['30 layers'] * 1e3:6.3f} ms   200000 x 576 {big[0].numel() / r['big'] / 1e9:5.1f} "
              f"GB/s   call {r['call'] / 200 * 1e6:5.2f} us   ({args.rows} rows, {'fixed point' if fixed else 'float32'})")


if __name__ == "__main__":
    main()
