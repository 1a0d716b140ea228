"""What batch-invariant mode's kernels cost on the GPU (scripts/gpu_check.sh stage 3): each fixed-order op
timed against the default one in the same run, at Llama-3-8B's shapes in bf16, printed as summary-table rows
(name, INFO, "invariant x.xx of default": the default's time over the invariant one's, so 0.5 = twice as slow).

- linear: F.linear (cuBLAS) vs triton_batch_invariant.linear at M = 1, 64, 2048 on the qkv, gate_up and down
  projections;
- attention: TritonPagedBackend by default vs batch_invariant=True (one KV split, and a fixed 4) on decode
  batches (64 at 2k context, 4 at 16k), a 2k-token prefill chunk and a mixed step.

`--smoke`: tiny shapes through Triton's interpreter on the CPU (checks the script runs; its times mean
nothing)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _time_ms(fn, device: torch.device, repeat: int) -> float:
    fn()  # compile, warm up
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _row(name: str, default_ms: float, invariant_ms: float) -> None:
    text = f"invariant {default_ms / invariant_ms:.2f} of default ({invariant_ms:.3f} vs {default_ms:.3f} ms)"
    print(f"{name[:34]:<34} {'INFO':<6} {text}", flush=True)


def bench_linear(device: torch.device, dtype: torch.dtype, shapes, sizes, repeat: int) -> None:
    import torch.nn.functional as F

    from kvserve.layers import triton_batch_invariant as bi

    for name, n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        for m in sizes:
            x = torch.randn(m, k, device=device, dtype=dtype)
            default = _time_ms(lambda x=x, w=w: F.linear(x, w), device, repeat)
            _row(f"invariant linear {name} M={m}", default, _time_ms(lambda x=x, w=w: bi.linear(x, w), device, repeat))


def _attention_step(device, dtype, query_lens, context_lens, block_size, hq, hkv, d):
    from kvserve.attention.backend import CommonAttentionMetadata

    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    counts = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(counts)).tolist()
    tables = [[perm.pop() for _ in range(c)] for c in counts]
    width = max(counts)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, q in zip(tables, context_lens, query_lens) for p in range(c, c + q)]
    num_decodes = sum(1 for q in query_lens if q == 1)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens, device=device).cumsum(0),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        slot_mapping=torch.tensor(slots, device=device), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        block_size=block_size, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    cache = torch.randn(sum(counts), block_size, 2, hkv, d, device=device, dtype=dtype)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    return common, q, k, v, cache


def bench_attention(device, dtype, steps, block_size, hq, hkv, d, repeat: int, kernels=None) -> None:
    from kvserve.attention.triton_paged import TritonPagedBackend

    for name, query_lens, context_lens in steps:
        common, *tensors = _attention_step(device, dtype, query_lens, context_lens, block_size, hq, hkv, d)
        times = []
        for backend in (TritonPagedBackend(kernels), TritonPagedBackend(kernels, batch_invariant=True),
                        TritonPagedBackend(kernels, decode_splits=4, batch_invariant=True)):
            step = (*tensors, backend.build_metadata(common), d ** -0.5)
            times.append(_time_ms(lambda b=backend, step=step: b.forward(*step), device, repeat))
        _row(f"invariant attention {name}", times[0], times[1])
        _row(f"  4 splits: {name}", times[0], times[2])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes through Triton's interpreter on the CPU")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("gpu_invariance_bench: --smoke needs TRITON_INTERPRET=1 set before it starts")
        import importlib
        kernels = importlib.import_module("kvserve.attention.triton_kernels")
        dev, dtype = torch.device("cpu"), torch.float16
        bench_linear(dev, dtype, [("tiny", 48, 40)], (1, 65), 1)
        bench_attention(dev, dtype, [("tiny mixed", [1, 3], [20, 4])], 16, 4, 1, 16, 1, kernels)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_invariance_bench: needs a CUDA device (or --smoke)")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    shapes = [("qkv 6144x4096", 6144, 4096), ("gate_up 28672x4096", 28672, 4096), ("down 4096x14336", 4096, 14336)]
    bench_linear(dev, dtype, shapes, (1, 64, 2048), args.repeat)
    steps = [("decode 64 x 2k ctx", [1] * 64, [2048] * 64), ("decode 4 x 16k ctx", [1] * 4, [16384] * 4),
             ("prefill 2k chunk", [2048], [0]),
             ("mixed 32 decodes + 512 chunk", [1] * 32 + [512], [2048] * 32 + [1024])]
    bench_attention(dev, dtype, steps, 16, 32, 8, 128, args.repeat)


if __name__ == "__main__":
    main()
