"""`python -m kvserve.attention.microbench`: per-layer attention timings behind the README's figures.

- decode: the C++ paged decode kernel vs the PyTorch path (gather every context, one batched SDPA call),
  SmolLM2's heads (9 query, 3 KV, head_dim 64), contexts on randomly placed blocks as in a busy pool; then
  the kernel on the same contexts quantized (--kv-cache-dtype int8 and fp8_e4m3, scales included in the
  bytes counted);
- prefill: torch's CPU SDPA on 3-D inputs (which takes its math path) vs 4-D (its flash kernel), for a
  chunk after cached context, as the CPU backend calls it.
Timings only; the tests check that the paths agree.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.torch_ref import TorchRefBackend, _decode
from kvserve.kv_cache.quant import quantize

HQ, HKV, D, BS = 9, 3, 64, 16


def _time(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def decode(batch: int, ctx: int) -> str:
    per_seq = (ctx + BS - 1) // BS
    kv = torch.randn(batch * per_seq + 4, BS, 2, HKV, D)
    table = torch.randperm(batch * per_seq).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, HQ, D)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1), seq_lens=seq_lens, block_table=table,
        slot_mapping=torch.zeros(batch, dtype=torch.long), num_decodes=batch, num_decode_tokens=batch,
        block_size=BS, query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch)
    meta = TorchRefBackend().build_metadata(common)
    flat = kv.view(-1, 2, HKV, D)
    line = f"decode  B={batch:3d} L={ctx:5d}: PyTorch gather+SDPA {_time(lambda: _decode(q, flat, meta, 0.125)):7.2f} ms"
    kernel = load_paged_attention()
    if kernel is not None:
        ms = _time(lambda: kernel.paged_decode_attention(q, kv, table, seq_lens, 0.125))
        line += f"   C++ kernel {ms:6.2f} ms ({batch * ctx * 2 * HKV * D * 4 / ms / 1e6:.1f} GB/s of K/V)"
        for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            values, scales = quantize(kv, dtype)
            ms = _time(lambda: kernel.paged_decode_attention(q, values, table, seq_lens, 0.125, None, scales))
            line += f"   {name} {ms:6.2f} ms ({batch * ctx * 2 * HKV * (D + 4) / ms / 1e6:.1f} GB/s)"
    return line


def prefill(q_len: int, ctx: int) -> str:
    total = ctx + q_len
    q, kv = torch.randn(q_len, HQ, D), torch.randn(total, 2, HKV, D)
    mask = torch.arange(total)[None, :] <= (torch.arange(q_len)[:, None] + ctx)
    three = (q.transpose(0, 1), kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1))
    four = tuple(x.unsqueeze(0) for x in three)

    def run(args):
        return F.scaled_dot_product_attention(*args, attn_mask=mask, scale=0.125, enable_gqa=True)

    return (f"prefill q={q_len:4d} ctx={ctx:5d}: SDPA 3-D (math path) {_time(lambda: run(three)):6.2f} ms   "
            f"4-D (flash) {_time(lambda: run(four)):6.2f} ms")


if __name__ == "__main__":
    print(f"torch threads: {torch.get_num_threads()}; per layer")
    with torch.inference_mode():
        for b, L in ((64, 400), (32, 1100), (16, 300)):
            print(decode(b, L))
        for q_len, ctx in ((512, 0), (512, 400), (32, 1900)):
            print(prefill(q_len, ctx))
