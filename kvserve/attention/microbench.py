"""`python -m kvserve.attention.microbench`: per-layer attention timings behind docs/features/cpu-kernels.md's figures.

- stream: the machine's read bandwidth (a sum over a tensor far larger than the caches, all threads), the
  ceiling a memory-bound decode is measured against;
- decode: the C++ paged attention kernel vs the PyTorch path (gather every context, one batched SDPA call),
  SmolLM2's heads (9 query, 3 KV, head_dim 64), contexts on randomly placed blocks as in a busy pool, with the
  kernel's K/V read rate as a fraction of the stream bandwidth; then the same contexts quantized
  (--kv-cache-dtype int8 and fp8_e4m3, one scale per block as the engine stores them, counted in the bytes);
- shared prefix: decodes behind one cached prefix, read once per group (cascade) vs once per sequence;
- prefill: a chunk after cached context through the kernel vs gather + torch's flash SDPA (the path before).
`--baseline FILE.cpp` also times another build's `paged_decode_attention` on the same decodes (an older
kernel from git: before/after in one run). Best of several repetitions; the tests check that the paths agree.
The first line says which instruction sets ran (KVSERVE_CPU_ISA picks the kernels' build; emulating a whole
machine of a lower class also sets ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA: docs/features/cpu-kernels.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cascade import find_shared_prefixes
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.prefill import gather
from kvserve.attention.torch_ref import TorchRefBackend, _decode
from kvserve.kv_cache.quant import quantize_blocks
from kvserve.utils.cpp_extension import build_extension
from kvserve.utils.cpu_features import describe_isa

HQ, HKV, D, BS = 9, 3, 64, 16
# B=1: single-stream decode, whose blocks the kernel splits over the threads
DECODES = ((64, 400), (32, 1100), (16, 300), (1, 200), (1, 1100))


def _time(fn, reps: int = 20, rounds: int = 5) -> float:
    """ms per call: the best of `rounds` means over `reps` calls (a shared machine's noise only adds)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def stream_gbps(mib: int = 1024) -> float:
    """GB/s read by a sum over `mib` MiB of float32 (every thread; far past the last-level cache)."""
    x = torch.ones(mib * 2**20 // 4)
    ms = _time(lambda: x.sum(), reps=3, rounds=5)
    return x.numel() * 4 / ms / 1e6


def _decode_case(batch: int, ctx: int):
    per_seq = (ctx + BS - 1) // BS
    kv = torch.randn(batch * per_seq + 4, BS, 2, HKV, D)
    table = torch.randperm(batch * per_seq).view(batch, per_seq)
    return kv, table, torch.full((batch,), ctx, dtype=torch.long), torch.randn(batch, HQ, D)


def decode(batch: int, ctx: int, stream: float, baseline=None) -> str:
    kv, table, seq_lens, q = _decode_case(batch, ctx)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1), seq_lens=seq_lens, block_table=table,
        slot_mapping=torch.zeros(batch, dtype=torch.long), num_decodes=batch, num_decode_tokens=batch,
        block_size=BS, query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch)
    meta = TorchRefBackend().build_metadata(common)
    flat = kv.view(-1, 2, HKV, D)
    line = f"decode  B={batch:3d} L={ctx:5d}: PyTorch gather+SDPA {_time(lambda: _decode(q, flat, meta, 0.125)):7.2f} ms"
    gb = batch * ctx * 2 * HKV * D * 4 / 1e6
    if baseline is not None:
        ms = _time(lambda: baseline.paged_decode_attention(q, kv, table, seq_lens, 0.125))
        line += f"   baseline kernel {ms:7.3f} ms ({gb / ms:.1f} GB/s, {gb / ms / stream:.0%})"
    kernel = load_paged_attention()
    if kernel is not None:
        ms = _time(lambda: kernel.paged_attention(q, kv, table, seq_lens, 0.125))
        line += f"   C++ kernel {ms:7.3f} ms ({gb / ms:.1f} GB/s of K/V, {gb / ms / stream:.0%} of stream)"
        for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            values, scales = quantize_blocks(kv, dtype)                      # the engine's layout
            ms = _time(lambda: kernel.paged_attention(q, values, table, seq_lens, 0.125, None, scales))
            scale_bytes = scales.element_size() / BS
            line += f"   {name} {ms:6.2f} ms ({batch * ctx * 2 * HKV * (D + scale_bytes) / ms / 1e6:.1f} GB/s)"
    return line


def shared_prefix(batch: int, prefix: int, own: int) -> str:
    """`batch` decodes whose first `prefix` tokens are the same cached blocks, then `own` tokens each."""
    kernel = load_paged_attention()
    p_blocks, o_blocks = prefix // BS, -(-own // BS)
    kv = torch.randn(p_blocks + batch * o_blocks + 4, BS, 2, HKV, D)
    perm = torch.randperm(kv.shape[0] - 4)
    shared_ids = perm[:p_blocks]
    table = torch.cat((shared_ids.expand(batch, -1), perm[p_blocks:p_blocks + batch * o_blocks].view(batch, -1)), 1)
    seq_lens = torch.full((batch,), prefix + own, dtype=torch.long)
    q = torch.randn(batch, HQ, D)
    s = find_shared_prefixes(table.tolist(), [(prefix + own - 1) // BS] * batch)
    alone = _time(lambda: kernel.paged_attention(q, kv, table, seq_lens, 0.125))
    grouped = _time(lambda: kernel.paged_attention(q, kv, table, seq_lens, 0.125, None, None, s.seqs, s.starts,
                                                   s.blocks))
    return (f"shared prefix B={batch:3d} prefix={prefix:5d} own={own:4d}: per sequence {alone:6.2f} ms   "
            f"cascade {grouped:6.2f} ms ({alone / grouped:.1f}x)")


def prefill(q_len: int, ctx: int) -> str:
    total = ctx + q_len
    blocks = -(-total // BS)
    kv = torch.randn(blocks + 4, BS, 2, HKV, D)
    table = torch.randperm(blocks + 4)[:blocks][None].contiguous()
    slots = table[0][torch.arange(total) // BS] * BS + torch.arange(total) % BS
    q = torch.randn(q_len, HQ, D)
    mask = torch.arange(total)[None, :] <= (torch.arange(q_len)[:, None] + ctx)

    def sdpa():
        g = gather(kv.view(-1, 2, HKV, D), slots, torch.float32)
        qs, ks, vs = (x.unsqueeze(0).transpose(1, 2) for x in (q, g[:, 0], g[:, 1]))
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True)

    line = f"prefill q={q_len:4d} ctx={ctx:5d}: gather + SDPA (flash) {_time(sdpa, reps=5):6.2f} ms"
    kernel = load_paged_attention()
    if kernel is not None:
        starts, lens = torch.tensor([0, q_len]), torch.tensor([total])
        line += f"   C++ kernel {_time(lambda: kernel.paged_attention(q, kv, table, lens, 0.125, starts), reps=5):6.2f} ms"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.attention.microbench", description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", metavar="FILE.cpp",
                        help="also time this C++ source's paged_decode_attention on the decodes (before/after)")
    args = parser.parse_args(argv)
    baseline = None
    if args.baseline:
        if not os.path.isfile(args.baseline):
            print(f"--baseline: no such file: {args.baseline}", file=sys.stderr)
            return 2
        baseline = build_extension("kvserve_microbench_baseline", args.baseline, "microbench baseline")
        if baseline is None:
            print(f"--baseline: {args.baseline} did not build (see the log)", file=sys.stderr)
            return 2
    print(f"instruction sets: {describe_isa()}", flush=True)
    with torch.inference_mode():
        stream = stream_gbps()
        print(f"torch threads: {torch.get_num_threads()}; stream read {stream:.1f} GB/s; per layer")
        for b, L in DECODES:
            print(decode(b, L, stream, baseline))
        for b, p, o in ((64, 384, 16), (32, 1024, 76)):
            print(shared_prefix(b, p, o))
        for q_len, ctx in ((512, 0), (512, 400), (32, 1900)):
            print(prefill(q_len, ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
