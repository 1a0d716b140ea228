"""The CPU paged attention kernel of one instruction set against torch_ref, in a fresh process
(`python -m tests.helpers.attention_isa`, KVSERVE_CPU_ISA choosing the build: the kernel is loaded once per
process). Mixed steps of decodes, draft-verifying rows and prefill chunks over scattered blocks go through both
backends' forward (the KV write, then attention): head dims 64 and 128 (rows in vector lanes) and 32 (transposed
blocks, decode dot products), every cache dtype (an int8/fp8 one through the Hadamard rotation and the quantized
write, whose bytes must equal torch_ref's), sliding windows, soft caps, shared-prefix groups and a long decode
split over threads; and the fp8 write on every e4m3 value, every tie between two, and a grown scale that
requantizes each code (check_fp8_write_edges). Prints the loaded module's name (it names its instruction set)."""
from __future__ import annotations

import torch

from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv_cache.quant import QuantizedKVCache, write_block_scaled
from kvserve.kv_cache.rotation import rotate
from tests.helpers.windowed_attention import dense_windowed, windowed_step

DECODES = [(40, 1), (3, 1), (70, 3)]
PREFILLS = [(0, 37), (50, 20), (20, 140)]
GEOMETRIES = [(16, 4, 2, 64), (16, 8, 2, 128), (8, 8, 1, 32)]  # block size, query heads, KV heads, head dim
# cache dtype -> (atol, rtol): a bfloat16 step's queries and output are bfloat16 too
DTYPES = {"auto": (2e-5, 1e-5), "bfloat16": (2e-2, 2e-2), "int8": (2e-5, 1e-5), "fp8_e4m3": (2e-5, 1e-5)}


def _compare(step, dtype: str, scale: float, window: int | None, soft_cap: float | None) -> None:
    """Float caches: the backends' forward (write, then attention) agree. Quantized ones: the kernel's attention
    over the quantized blocks against dense attention over what they hold (torch_ref's own write would round the
    rotated K/V differently from the kernel's rotation, moving codes by a step), then the write and the rotation
    against torch_ref's on the same inputs."""
    kernel = load_paged_attention()
    ours = CPUPagedBackend(kernel)
    if dtype in ("auto", "bfloat16"):
        ref = TorchRefBackend()
        got = ours.forward(step.q, step.k, step.v, step.cache.clone(), ours.build_metadata(step.common), scale,
                           sliding_window=window, logits_soft_cap=soft_cap)
        want = ref.forward(step.q, step.k, step.v, step.cache.clone(), ref.build_metadata(step.common), scale,
                           sliding_window=window, logits_soft_cap=soft_cap)
        atol, rtol = DTYPES[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
        return
    values, scales = step.quantized(torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
    meta = ours.build_metadata(step.common)
    shared = (meta.shared.seqs, meta.shared.starts, meta.shared.blocks) if meta.shared and not window else ()
    got = kernel.paged_attention(step.q, values, meta.block_table, meta.seq_lens, scale, meta.query_start, scales,
                                 *(shared or (None, None, None)), window or 0, soft_cap or 0.0)
    torch.testing.assert_close(got, dense_windowed(step, scale, window, soft_cap), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(kernel.hadamard(step.q), rotate(step.q), atol=1e-5, rtol=1e-5)
    k, v = rotate(step.k), rotate(step.v)
    theirs = QuantizedKVCache(values.clone(), scales.clone())
    kernel.write_kv_quantized_(values, scales, step.common.slot_mapping, k, v)
    write_block_scaled(theirs, step.common.slot_mapping, k, v)
    assert torch.equal(values.view(torch.uint8), theirs.values.view(torch.uint8)), "the quantized write's codes"
    assert torch.equal(scales[:-1], theirs.scales[:-1]), "the quantized write's scales"  # [-1]: poisoned, NaN


def fp8_edge_rows(d: int = 64) -> torch.Tensor:
    """[T, 1, d] rows whose values over the block scale 2^-3 (set by the 448 among them) are every finite e4m3
    value, each midpoint between neighbours (a tie: round half to even) and the floats just either side of it,
    both signs, zero padded."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()    # 0 .. 448, subnormals too
    mids = (codes[1:] + codes[:-1]) / 2
    near = torch.cat((torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9))))
    values = torch.cat((codes, mids, near))
    values = torch.cat((values, -values)) * 2**-3
    rows = torch.zeros(-(-values.numel() // d) * d)
    rows[:values.numel()] = values
    return rows.view(-1, 1, d)


def check_fp8_write_edges(kernel) -> None:
    """The fp8 write's codes equal write_block_scaled's on fp8_edge_rows, written into fresh blocks, then after a
    token at the last slot that triples the scale of its block (which holds 448: every code requantized by 1/3)."""
    rows = fp8_edge_rows()
    t, bs = rows.shape[0], 16
    blocks = -(-t // bs)
    ours = QuantizedKVCache(torch.zeros(blocks, bs, 2, 1, rows.shape[-1], dtype=torch.float8_e4m3fn),
                            torch.ones(blocks, 2, 1, dtype=torch.bfloat16))
    theirs = QuantizedKVCache(ours.values.clone(), ours.scales.clone())
    slots = torch.arange(t)
    big = torch.full_like(rows[:1], 3 * 448 * 2**-3)
    for k, v, at in ((rows, rows.flip(0), slots), (big, big, torch.tensor([t - 1]))):
        kernel.write_kv_quantized_(ours.values, ours.scales, at, k.contiguous(), v.contiguous())
        write_block_scaled(theirs, at, k, v)
        assert torch.equal(ours.values.view(torch.uint8), theirs.values.view(torch.uint8)), "the fp8 write's codes"
        assert torch.equal(ours.scales, theirs.scales), "the fp8 write's scales"
    assert theirs.scales[0, 0, 0].item() == 3 * 448 * 2**-3 / 448, "the last write grew block 0's scale"


def check(seed: int = 0) -> int:
    """Runs every case (an assertion error on the first mismatch); returns how many ran."""
    cases = 0
    for bs, hq, hkv, d in GEOMETRIES:
        for dtype in DTYPES:
            for window, soft_cap, shared in ((None, None, 0), (None, 2.0, 2), (5, None, 0), (23, 2.0, 0)):
                step = windowed_step(seed + cases, DECODES, PREFILLS, block_size=bs, hq=hq, hkv=hkv, d=d,
                                     window=window, shared_blocks=shared,
                                     dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
                _compare(step, dtype, d ** -0.5, window, soft_cap)
                cases += 1
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # one long decode's blocks split over the threads, merged by log-sum-exp
    try:
        for dtype in DTYPES:
            step = windowed_step(seed, [(900, 1)], [], block_size=16, hq=8, hkv=2, d=64, window=None,
                                 dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
            _compare(step, dtype, 0.125, None, 3.0)
            cases += 1
    finally:
        torch.set_num_threads(before)
    return cases


def main() -> None:
    module = load_paged_attention()
    assert module is not None, "the paged attention kernel did not build (see the log above)"
    with torch.inference_mode():
        cases = check()
        check_fp8_write_edges(module)
    print(f"kernel {module.__name__}: {cases} cases match torch_ref")


if __name__ == "__main__":
    main()
