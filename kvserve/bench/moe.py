"""`kvserve bench moe`: one MoE layer through kvserve's expert paths and transformers' eager block, same run.

The layer (router and routed experts) runs through kvserve's FusedMoE and through transformers' eager
Qwen3MoeSparseMoeBlock, on the same random weights, the paths interleaved call by call.

The default shape is Qwen3-30B-A3B's (hidden 2048, expert intermediate 768, 128 experts, 8 per token). At each
batch size every repeat draws new activations, so the experts hit change from call to call and their weights come
from memory, as in a model whose 48 layers do not fit in the caches. Per batch size and path:
- ms per layer (median over --repeat calls, the paths alternating call by call);
- GB/s of the active experts' weight bytes (the distinct experts the batch hit x their three matrices, int8 scales
  included) and that rate as a fraction of the machine's read rate, measured in the same run (a sum over a tensor
  far past the last-level cache, every thread: attention/microbench.py);
- the speed-up over transformers.
`fused` is FusedMoE's default path as the engine runs it: from moe_fused.MAX_ROWS_PER_EXPERT rows per expert
(a batch marked *) that is the sorted path.
Outputs are compared with transformers' first (int8: with kvserve's reference path on the dequantized weights, and
with transformers for scale), and a path that disagrees fails the run before anything is timed.
`--baseline FILE.cpp` also times another build of the expert kernel (layers/csrc/moe.cpp from an older commit) on
the same inputs and weights as `baseline`: before/after in one run, as ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.config.quantization import DEFAULT_GROUP_SIZE
from kvserve.layers import moe_fused
from kvserve.layers.moe import IMPLS, FusedMoE
from kvserve.layers.moe_router import select_experts
from kvserve.utils.cpu_features import describe_isa, isa_info

_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Largest max |ours - reference| / max |reference| a path may show before the run fails."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=768, help="each expert's")
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated tokens per call")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per batch size and path")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations (transformers' and kvserve's)")
    parser.add_argument("--quantization", default=None, choices=("int8",),
                        help="kvserve's experts in int8 (transformers stays in --dtype)")
    parser.add_argument("--quantization-group-size", type=int, default=DEFAULT_GROUP_SIZE["int8"],
                        help="int8 inputs per scale (-1: one per output channel)")
    parser.add_argument("--impls", default="fused,sorted", help=f"kvserve paths to time, of {', '.join(IMPLS)}")
    parser.add_argument("--stream-mib", type=int, default=1024, help="size of the read-rate measurement")
    parser.add_argument("--baseline", metavar="FILE.cpp", default=None,
                        help="also time this build of the expert kernel (layers/csrc/moe.cpp from another commit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")


def transformers_block(args, dtype: torch.dtype, g: torch.Generator):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=args.hidden_size, moe_intermediate_size=args.intermediate_size,
                         num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         experts_implementation="eager")
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(cfg)
    block = block.to_empty(device="cpu")
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return block.to(dtype).eval()


def kvserve_layer(args, block) -> FusedMoE:
    """kvserve's layer on transformers' own tensors (the same [E, 2I, H] / [E, H, I] layout: no copy)."""
    method = None
    if args.quantization == "int8":
        from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
        method = Int8WeightOnlyMethod(args.quantization_group_size)
    layer = FusedMoE(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size, True,
                     impl="reference", method=method)
    layer.w13, layer.w2 = block.experts.gate_up_proj, block.experts.down_proj
    layer.process_weights_after_loading()
    return layer


def _call_ours(layer: FusedMoE, router: torch.Tensor, impl: str, x: torch.Tensor) -> torch.Tensor:
    layer.impl = impl  # one layer (one copy of the weights) for every path
    return layer.forward(x, F.linear(x, router))


def _load_baseline(path: str):
    """The kernel module built from `path` (its own cache entry, keyed by the source text: the current source
    loads the build FusedMoE runs)."""
    from kvserve.utils.cpp_extension import build_extension

    if not os.path.isfile(path):
        raise ValueError(f"--baseline: no such file: {path}")
    module = build_extension("kvserve_moe", path, "baseline MoE experts")
    if module is None or not hasattr(module, "moe_experts"):
        raise ValueError(f"--baseline: {path} did not build as an expert kernel (see the log)")
    return module


def _call_kernel(module, layer: FusedMoE, router: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's routing, then `module`'s expert kernel on the layer's weights (as moe_fused.experts_fused)."""
    weights, ids = select_experts(F.linear(x, router), layer.top_k, layer.renormalize)
    if layer.int8 is not None:
        w13, w2, s13, s2 = layer.int8[0].q, layer.int8[1].q, layer.int8[0].scales, layer.int8[1].scales
    else:
        w13, w2, s13, s2 = layer.w13, layer.w2, torch.empty(0), torch.empty(0)
    out = module.moe_experts(x.float().contiguous(), ids.contiguous(), weights.float().contiguous(), w13, w2, s13, s2,
                             layer.fixed_point and layer.int8 is not None)
    return out.to(x.dtype)


def timed_paths(layer: FusedMoE, router: torch.Tensor, impls: list[str], baseline) -> dict:
    """name -> x -> the layer's output, for every kvserve path timed (and the baseline kernel's)."""
    paths = {impl: (lambda x, impl=impl: _call_ours(layer, router, impl, x)) for impl in impls}
    if baseline is not None:
        paths["baseline"] = lambda x: _call_kernel(baseline, layer, router, x)
    return paths


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check_agreement(args, block, layer: FusedMoE, paths: dict, x: torch.Tensor) -> dict[str, float]:
    """max |path - reference| / max |reference| per path: the reference is transformers, or for int8 kvserve's
    reference path on the dequantized weights (`vs transformers` then shows the quantization error)."""
    router = block.gate.weight
    theirs = block(x[None])[0]
    errors = {}
    want = _call_ours(layer, router, "reference", x) if layer.int8 is not None else theirs
    for name, fn in paths.items():
        got = fn(x)
        errors[name] = _relative_error(got, want)
        if layer.int8 is not None:
            errors[f"{name} vs transformers"] = _relative_error(got, theirs)
    return errors


def expert_bytes(layer: FusedMoE, hidden: int) -> int:
    """Weight bytes of one expert as the layer holds it (codes and scales under int8)."""
    if layer.int8 is not None:
        return sum((w.q[0].numel() * w.q.element_size() + w.scales[0].numel() * 4) for w in layer.int8)
    return (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()


def _timed(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def time_batch(args, block, layer: FusedMoE, ours: dict, batch: int, dtype: torch.dtype,
               g: torch.Generator, stream_gbps: float) -> dict:
    """One row: every path on the same `repeat` inputs, alternating call by call."""
    router = block.gate.weight
    paths = dict(ours)
    paths["transformers"] = lambda x: block(x[None])
    xs = [torch.randn(batch, args.hidden_size, generator=g).to(dtype) for _ in range(args.repeat + 1)]
    for fn in paths.values():  # warm-up: kernel builds, allocator, thread pool
        fn(xs[-1])
    seconds = {name: [] for name in paths}
    per_expert, active = expert_bytes(layer, args.hidden_size), []
    names = list(paths)
    for i, x in enumerate(xs[:-1]):
        active.append(torch.topk(F.linear(x, router).float(), args.top_k, dim=-1).indices.unique().numel())
        # each call by a path after the first finds some of these experts' weights in the last-level cache (a
        # batch's experts can fit there): the path that goes first changes from call to call
        for name in names[i % len(names):] + names[:i % len(names)]:
            seconds[name].append(_timed(paths[name], x))
    held = layer.int8[0].q if layer.int8 is not None else layer.w13
    row = {"batch": batch, "active_experts": statistics.mean(active),
           "active_mb": statistics.mean(active) * per_expert / 1e6,
           "fused_kernel": moe_fused.takes(xs[0], held, args.top_k)}
    tf = statistics.median(seconds["transformers"])
    for name, times in seconds.items():
        gbps = statistics.median(n * per_expert / t / 1e9 for n, t in zip(active, times))
        row[name] = {"ms": statistics.median(times) * 1e3, "gbps": gbps, "of_stream": gbps / stream_gbps,
                     "speedup_vs_transformers": tf / statistics.median(times)}
        if "baseline" in seconds:
            row[name]["speedup_vs_baseline"] = statistics.median(seconds["baseline"]) / statistics.median(times)
    return row


def _print_table(rows: list[dict], names: list[str]) -> None:
    head = f"{'batch':>5} {'experts':>7} {'active MB':>9}"
    for name in names:
        head += f" | {name[:12]:>12} ms {'GB/s':>6} {'stream':>6} {'vs tf':>6}"
    print(head)
    for row in rows:
        mark = "" if row["fused_kernel"] else "*"
        line = f"{mark + str(row['batch']):>5} {row['active_experts']:>7.1f} {row['active_mb']:>9.1f}"
        for name in names:
            r = row[name]
            line += (f" | {r['ms']:>15.3f} {r['gbps']:>6.1f} {r['of_stream']:>6.0%} "
                     f"{r['speedup_vs_transformers']:>5.2f}x")
        print(line)
    if "baseline" in names:
        print("vs baseline kernel: " + "; ".join(
            f"batch {row['batch']}: " + ", ".join(f"{n} {row[n]['speedup_vs_baseline']:.2f}x" for n in names
                                                 if n not in ("baseline", "transformers")) for row in rows))
    if not all(row["fused_kernel"] for row in rows):
        print("*: past moe_fused's rows per expert for the kernel: `fused` ran the sorted path, as FusedMoE does")


def _parse(args) -> tuple[list[int], list[str]]:
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        raise ValueError(f"--impls must name some of {', '.join(IMPLS)}, got {args.impls!r}")
    if args.repeat < 1 or args.top_k > args.num_experts:
        raise ValueError("--repeat must be >= 1 and --top-k at most --num-experts")
    return batches, impls


def _disagreeing(errors: dict[str, float], dtype: torch.dtype) -> dict[str, float]:
    return {k: v for k, v in errors.items() if "transformers" not in k and not v <= _TOLERANCE[dtype]}


def run(args) -> int:
    from kvserve.attention.microbench import stream_gbps

    batches, impls = _parse(args)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        block = transformers_block(args, dtype, g)
        layer = kvserve_layer(args, block)
        ours = timed_paths(layer, block.gate.weight, impls, _load_baseline(args.baseline) if args.baseline else None)
        errors = check_agreement(args, block, layer, ours,
                                 torch.randn(max(batches), args.hidden_size, generator=g).to(dtype))
        print("agreement (max |diff| / max |reference|): " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        bad = _disagreeing(errors, dtype)
        if bad:
            print(f"kvserve bench moe: paths disagree with the reference: {bad}; nothing timed")
            return 1
        stream = stream_gbps(args.stream_mib)
        rows = [time_batch(args, block, layer, ours, b, dtype, g, stream) for b in batches]
    quant = f", int8 experts (group {args.quantization_group_size})" if layer.int8 is not None else ""
    print(f"MoE layer: hidden {args.hidden_size}, intermediate {args.intermediate_size}, {args.num_experts} experts, "
          f"top-{args.top_k}, {args.dtype}{quant}; {torch.get_num_threads()} threads; read rate {stream:.1f} GB/s")
    print(f"instruction sets: {describe_isa()}")
    _print_table(rows, list(ours) + ["transformers"])
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                          "threads": torch.get_num_threads(), "isa": isa_info(), "stream_gbps": stream,
                          "agreement": errors,
                          "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    from kvserve.cli.standalone import standalone_main

    sys.exit(standalone_main("python -m kvserve.bench.moe", __doc__.splitlines()[0], add_arguments, run))
