"""Batch invariance on the Triton path (issue 34 item 3), through Triton's interpreter on CPU tensors: the
matmul and RMSNorm of layers/triton_batch_invariant.py give a row the same bits whatever else is in the
launch, and triton_paged's batch-invariant mode gives a query token the same attention output whether it is
a decode, a draft being verified or a row of a prefill chunk, whatever else the step holds. Each is also
checked against a reference (float64, F.rms_norm, torch_ref, dense windowed attention). The `gpu` tests
run the compiled kernels in bf16 at model sizes (scripts/gpu_check.sh). Skipped when triton is not
installed; e2e because TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py)."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.torch_ref import TorchRefBackend
from tests.helpers.windowed_attention import dense_windowed, windowed_step

pytest.importorskip("triton")

_CUDA = torch.cuda.is_available()
_BATCH_SIZES = (1, 2, 3, 15, 16, 17, 63, 64, 65, 100, 129, 200, 300)


@pytest.fixture(scope="module")
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")


@pytest.fixture(scope="module")
def kernels(interpreted):
    return importlib.import_module("kvserve.attention.triton_kernels")


def _ops():
    return importlib.import_module("kvserve.layers.triton_batch_invariant")


# ---------------------------------------------------------------------------------------------- matmul, norm


def _assert_rows_invariant(fn, x: torch.Tensor, sizes=_BATCH_SIZES) -> None:
    """fn over the first M rows, for every M in sizes: each row equals fn of that row alone, bit for bit."""
    picks = [0, 1, 15, 16, 17, 63, 64, 99, 150, 299]
    alone = {i: fn(x[i:i + 1]) for i in picks if i < x.shape[0]}
    for m in sizes:
        batch = fn(x[:m])
        for i, row in alone.items():
            if i < m:
                assert torch.equal(batch[i:i + 1], row), f"row {i} differs inside a batch of {m}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_do_not_depend_on_the_batch(interpreted, dtype, with_bias):
    """N and K not multiples of the tiles (tails masked); M from 1 to 300 crossing every BLOCK_M boundary."""
    ops = _ops()
    g = torch.Generator().manual_seed(1)
    n, k = 72, 200
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    x = torch.randn(300, k, generator=g).to(dtype)
    _assert_rows_invariant(lambda rows: ops.linear(rows, w, b), x)
    y = ops.linear(x, w, b)
    expected = x.double() @ w.double().t() + (b.double() if with_bias else 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.double(), expected, atol=tol * k ** 0.5, rtol=tol)


def test_linear_takes_leading_dims_strided_inputs_and_matmul(interpreted):
    ops = _ops()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 40, generator=g)
    w = torch.randn(24, 40, generator=g)
    y = ops.linear(x, w)
    assert y.shape == (3, 5, 24)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)
    wide = torch.randn(7, 80, generator=g)
    torch.testing.assert_close(ops.matmul(wide[:, ::2], w.t()), wide[:, ::2] @ w.t(), atol=1e-5, rtol=1e-5)
    assert ops.linear(torch.empty(0, 40), w).shape == (0, 24)


def test_tiles_come_from_the_weight_alone(interpreted):
    ops = _ops()
    assert ops.tile_sizes(4096, 14336) == (64, 64, 64)  # no M argument: a launch of any batch gets these
    block_m, block_n, block_k = ops.tile_sizes(5, 3)
    assert min(block_m, block_n, block_k) >= 16 and block_n == block_k == 16
    with pytest.raises(ValueError, match="differ in dtype"):
        ops.matmul(torch.randn(2, 4), torch.randn(4, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="do not chain"):
        ops.matmul(torch.randn(2, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops.matmul(torch.ones(2, 4, dtype=torch.int32), torch.ones(4, 3, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_rows_do_not_depend_on_the_batch(interpreted, dtype):
    ops = _ops()
    g = torch.Generator().manual_seed(3)
    h = 96
    x, res = (torch.randn(300, h, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(h, generator=g).to(dtype)
    _assert_rows_invariant(lambda rows: ops.rms_norm(rows, w, 1e-6), x, sizes=(1, 2, 17, 300))
    out, total = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, F.rms_norm(x + res, (h,), w, 1e-6), atol=tol, rtol=tol)
    out0, total0 = ops.add_rms_norm(x[:4].view(2, 2, h), None, w, 1e-6)
    assert total0.data_ptr() == x.data_ptr() and out0.shape == (2, 2, h)
    torch.testing.assert_close(out0.view(4, h), F.rms_norm(x[:4], (h,), w, 1e-6), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------- attention


@dataclass
class _Seqs:
    """Whole sequences: every position's q/k/v, its K/V already in `cache` at its own scattered blocks."""

    q: list[torch.Tensor]       # per sequence [L, Hq, D]
    kv: list[torch.Tensor]      # per sequence [L, 2, Hkv, D]
    tables: list[list[int]]
    cache: torch.Tensor         # [N, BS, 2, Hkv, D]
    block_size: int


def _seqs(seed: int, lengths: list[int], *, block_size: int, hq: int, hkv: int, d: int, dtype) -> _Seqs:
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(counts), generator=g).tolist()
    tables = [[perm.pop() for _ in range(c)] for c in counts]
    cache = torch.zeros(sum(counts), block_size, 2, hkv, d, dtype=dtype)
    qs, kvs = [], []
    for n, table in zip(lengths, tables):
        qs.append(torch.randn(n, hq, d, generator=g).to(dtype))
        kvs.append(torch.randn(n, 2, hkv, d, generator=g).to(dtype))
        for p in range(n):
            cache[table[p // block_size], p % block_size] = kvs[-1][p]
    return _Seqs(qs, kvs, tables, cache, block_size)


def _step(s: _Seqs, parts: list[tuple[int, int, int]], *, verify_groups: bool = False):
    """A step over parts (sequence, context, query length), decodes first as the runner orders them; with
    verify_groups every part is decode rows, one per token, grouped per part (draft verification,
    decode_groups). Returns (metadata, q, k, v, first row of each part)."""
    rows, groups = [], [0]
    for seq, ctx, n in parts:
        rows += [(seq, ctx + i, 1) for i in range(n)] if verify_groups else [(seq, ctx, n)]
        groups.append(len(rows))
    bs = s.block_size
    width = max(len(t) for t in s.tables)
    query_lens = [n for _, _, n in rows]
    num_decodes = next((i for i, n in enumerate(query_lens) if n > 1), len(rows))
    pos = [(seq, p) for seq, ctx, n in rows for p in range(ctx, ctx + n)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0),
        seq_lens=torch.tensor([c + n for _, c, n in rows]),
        block_table=torch.tensor([s.tables[seq] + [0] * (width - len(s.tables[seq])) for seq, _, _ in rows]),
        slot_mapping=torch.tensor([s.tables[seq][p // bs] * bs + p % bs for seq, p in pos]),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, block_size=bs, query_lens_cpu=query_lens,
        seq_lens_cpu=[c + n for _, c, n in rows],
        decode_groups=torch.tensor(groups) if verify_groups else None)
    q = torch.stack([s.q[seq][p] for seq, p in pos])
    kv = torch.stack([s.kv[seq][p] for seq, p in pos])
    starts = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0).tolist()
    return common, q, kv[:, 0], kv[:, 1], starts


def _attend(backend, s: _Seqs, parts, **kw):
    common, q, k, v, starts = _step(s, parts, **kw)
    d = q.shape[-1]
    out = backend.forward(q, k, v, s.cache.clone(), backend.build_metadata(common), d ** -0.5)
    return out, starts, (common, q, k, v)


def _invariant(kernels):
    from kvserve.attention.triton_paged import TritonPagedBackend
    return TritonPagedBackend(kernels, batch_invariant=True)


def _others(rng: torch.Generator, lengths: list[int], want_decodes: int, want_prefills: int):
    """Parts of the other sequences (1..): some decodes, then some short prefill chunks, at random contexts."""
    parts = []
    for i in range(want_decodes + want_prefills):
        seq = 1 + i % (len(lengths) - 1)
        n = 1 if i < want_decodes else min(lengths[seq], int(torch.randint(2, 7, (1,), generator=rng)))
        ctx = int(torch.randint(0, lengths[seq] - n + 1, (1,), generator=rng))
        parts.append((seq, ctx, n))
    return parts


def _check_row_shapes(backend, s: _Seqs, lengths, positions, chunks, rng, *, max_mixed_chunk: int = 17) -> None:
    """Sequence 0's token at each position, as a lone decode (the expected bits), then: a decode among other
    decodes and prefill chunks; each row of the prefill chunks (context, length) of `chunks` that covers it,
    alone and (up to max_mixed_chunk tokens) after other requests; a row verifying drafts, as decode rows
    grouped by decode_groups and as a multi-token query."""
    expected = {p: _attend(backend, s, [(0, p, 1)])[0][0] for p in positions}
    for p in positions:
        for nd, npf in ((3, 0), (2, 1)):
            others = _others(rng, lengths, nd, npf)
            parts = others[:nd] + [(0, p, 1)] + others[nd:]
            out, starts, _ = _attend(backend, s, parts)
            assert torch.equal(out[starts[nd]], expected[p]), f"decode at {p} among {parts}"
    for ctx, n in chunks:
        seen = [p for p in positions if ctx <= p < ctx + n]
        assert seen, f"chunk [{ctx}, {ctx + n}) covers no checked position"
        for others in ([], _others(rng, lengths, 2, 1)) if n <= max_mixed_chunk else ([],):
            parts = others[:2] + [(0, ctx, n)] + others[2:]
            out, starts, _ = _attend(backend, s, parts)
            for p in seen:
                assert torch.equal(out[starts[min(2, len(others))] + p - ctx], expected[p]), \
                    f"row {p} of a chunk [{ctx}, {ctx + n}) in {parts}"
    for verify in (False, True):  # a request checking 2 drafts (rows p-2..p) beside decodes
        for p in positions:
            ctx = max(0, p - 2)
            lead = [(1, 5, 1)] if verify else [(1, 5, 1), (2, 9, 1)]
            out, starts, _ = _attend(backend, s, lead + [(0, ctx, p + 1 - ctx)], verify_groups=verify)
            assert torch.equal(out[starts[len(lead)] + p - ctx], expected[p]), f"verification row {p} ({verify=})"


def test_a_token_gets_the_same_bits_in_every_step_shape(kernels):
    """Chunk sizes 1..70 at several contexts; GQA group 3; positions on and beside page boundaries."""
    lengths = [80, 24, 16, 12]
    s = _seqs(21, lengths, block_size=16, hq=6, hkv=2, d=16, dtype=torch.float32)
    chunks = [(0, 1), (16, 1), (15, 2), (69, 2), (0, 17), (10, 7), (60, 17), (5, 33), (1, 70)]
    _check_row_shapes(_invariant(kernels), s, lengths, positions=[0, 16, 70], chunks=chunks,
                      rng=torch.Generator().manual_seed(2))


def test_half_precision_rows_are_invariant(kernels):
    """fp16 (the interpreter's tl.dot reads no bf16: the gpu test runs bf16), block size 32."""
    lengths = [72, 20, 12]
    s = _seqs(5, lengths, block_size=32, hq=4, hkv=1, d=16, dtype=torch.float16)
    _check_row_shapes(_invariant(kernels), s, lengths, positions=[3, 40, 71], chunks=[(0, 5), (33, 9), (2, 70)],
                      rng=torch.Generator().manual_seed(6))


def test_split_kv_is_what_the_mode_removes(kernels):
    """The check has teeth: by default a decode's KV range is split (here 3 ways) and the parts combined, so
    the same token as a row of a prefill chunk (never split) gets other bits; both are correct."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    s = _seqs(8, [80, 20], block_size=16, hq=4, hkv=1, d=16, dtype=torch.float32)
    for backend, same in ((TritonPagedBackend(kernels, decode_splits=3), False), (_invariant(kernels), True)):
        decode = _attend(backend, s, [(0, 70, 1)])[0][0]
        row = _attend(backend, s, [(0, 60, 11)])[0][10]
        assert torch.equal(decode, row) is same
        torch.testing.assert_close(decode, row, atol=1e-5, rtol=1e-5)


def test_invariant_and_default_modes_match_the_reference(kernels):
    """The same mixed step (decodes, prefill chunks after context) in both modes against torch_ref."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    lengths = [60, 40, 20]
    s = _seqs(9, lengths, block_size=16, hq=4, hkv=2, d=16, dtype=torch.float32)
    parts = [(1, 30, 1), (2, 11, 1), (0, 20, 40), (1, 3, 9)]
    common, q, k, v, _ = _step(s, parts)
    ref = TorchRefBackend()
    expected = ref.forward(q, k, v, s.cache.clone(), ref.build_metadata(common), 0.25)
    for backend in (_invariant(kernels), TritonPagedBackend(kernels, decode_splits=3)):
        out = backend.forward(q, k, v, s.cache.clone(), backend.build_metadata(common), 0.25)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, soft_cap, splits", [(5, 2.0, 1), (23, None, 3)])
def test_invariant_mode_matches_dense_attention_with_windows(kernels, window, soft_cap, splits):
    """Windows (blocks before each window poisoned with NaN: never read), soft caps, verifying decodes."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    step = windowed_step(17, [(40, 1), (3, 1), (50, 3)], [(0, 20), (50, 9), (20, 24)], block_size=16, hq=4, hkv=1,
                         d=32, window=window)
    backend = TritonPagedBackend(kernels, decode_splits=splits, batch_invariant=True)
    out = backend.forward(step.q, step.k, step.v, step.cache.clone(), backend.build_metadata(step.common),
                          32 ** -0.5, sliding_window=window, logits_soft_cap=soft_cap)
    torch.testing.assert_close(out, dense_windowed(step, 32 ** -0.5, window, soft_cap), atol=1e-5, rtol=1e-5)


def test_decode_only_metadata_is_views_of_the_step(kernels):
    """A CUDA graph captures the decode-only launch over its buffers: the mode may add no tensor of its own."""
    from kvserve.attention.triton_paged import TritonPagedBackend, token_rows

    s = _seqs(4, [40, 30, 20], block_size=16, hq=4, hkv=2, d=16, dtype=torch.float32)
    common = _step(s, [(0, 9, 1), (1, 29, 1), (2, 0, 1)])[0]
    rows = token_rows(common)
    assert rows.starts is common.query_start_loc and rows.seq_lens is common.seq_lens
    assert rows.table_rows.data_ptr() == common.query_start_loc.data_ptr()
    mixed = token_rows(_step(s, [(0, 9, 1), (1, 26, 4), (2, 3, 2)])[0])
    assert mixed.starts.tolist() == list(range(8))
    assert mixed.seq_lens.tolist() == [10, 27, 28, 29, 30, 4, 5]
    assert mixed.table_rows.tolist() == [0, 1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="at least 1"):
        TritonPagedBackend(kernels, decode_splits=0, batch_invariant=True)
    assert TritonPagedBackend(kernels, batch_invariant=True).decode_splits == 1


def test_a_fixed_split_count_keeps_rows_invariant(kernels):
    """decode_splits=3 in the mode: every token's keys in 3 ranges whose bounds follow from its position (some
    empty at short contexts), combined in one order; rows still agree across step shapes and with torch_ref."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    lengths = [72, 20, 12]
    s = _seqs(12, lengths, block_size=16, hq=4, hkv=1, d=16, dtype=torch.float32)
    backend = TritonPagedBackend(kernels, decode_splits=3, batch_invariant=True)
    _check_row_shapes(backend, s, lengths, positions=[2, 40, 71], chunks=[(0, 3), (35, 9), (30, 42)],
                      rng=torch.Generator().manual_seed(13))
    common, q, k, v, _ = _step(s, [(1, 9, 1), (0, 30, 20), (2, 0, 12)])
    ref = TorchRefBackend()
    expected = ref.forward(q, k, v, s.cache.clone(), ref.build_metadata(common), 0.25)
    out = backend.forward(q, k, v, s.cache.clone(), backend.build_metadata(common), 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_gpu_invariance_bench_runs_on_the_interpreter():
    """scripts/gpu_invariance_bench.py (gpu_check.sh's stage 3) smoke-tested, so the GPU run does not rot."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "scripts/gpu_invariance_bench.py", "--smoke"], cwd=repo, env=env,
                         check=True, timeout=300, capture_output=True, text=True).stdout
    rows = [line for line in out.splitlines() if " INFO " in line]
    assert len(rows) == 4 and all("of default" in r for r in rows), out


# ---------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_gpu_linear_and_norm_are_batch_invariant():
    """The compiled kernels in bf16 at a model's width: rows alone vs inside M = 1..300, bit for bit."""
    from kvserve.layers import triton_batch_invariant as ops

    g = torch.Generator(device="cuda").manual_seed(0)
    k, n = 2048, 3072
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    x = torch.randn(300, k, generator=g, device="cuda").bfloat16()
    _assert_rows_invariant(lambda rows: ops.linear(rows, w), x, sizes=range(1, 301))
    torch.testing.assert_close(ops.linear(x, w).double(), x.double() @ w.double().t(), atol=3e-2, rtol=2e-2)
    nw = torch.randn(k, generator=g, device="cuda").bfloat16()
    x_res = torch.cat((x, x.flip(0)), dim=1)  # each row with its residual beside it
    _assert_rows_invariant(lambda rows: ops.add_rms_norm(rows[:, :k], rows[:, k:], nw, 1e-5)[0], x_res)
    torch.testing.assert_close(ops.rms_norm(x, nw, 1e-5), F.rms_norm(x, (k,), nw, 1e-5), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_attention_rows_are_batch_invariant(splits):
    """head_dim 128, Llama-3's GQA ratio, bf16, contexts up to 600 on the compiled kernel; one KV split and a
    fixed four."""
    import kvserve.attention.triton_kernels as kern
    from kvserve.attention.triton_paged import TritonPagedBackend

    lengths = [600, 300, 200, 130]
    s = _seqs(0, lengths, block_size=16, hq=32, hkv=8, d=128, dtype=torch.bfloat16)
    gpu = _Seqs([t.cuda() for t in s.q], [t.cuda() for t in s.kv], s.tables, s.cache.cuda(), 16)
    backend = _GpuSteps(TritonPagedBackend(kern, decode_splits=splits, batch_invariant=True))
    chunks = [(p - n + 1, n) for n in range(1, 71, 3) for p in (255, 599)] + [(0, 512), (88, 512)]
    _check_row_shapes(backend, gpu, lengths, positions=[0, 17, 255, 599], chunks=chunks,
                      rng=torch.Generator().manual_seed(1), max_mixed_chunk=512)


class _GpuSteps:
    """The backend with each step's metadata moved to the GPU (the test builds it on the host)."""

    def __init__(self, backend):
        self.backend = backend

    def build_metadata(self, common):
        moved = {f: getattr(common, f) for f in common.__dataclass_fields__}
        moved = {f: x.cuda() if isinstance(x, torch.Tensor) else x for f, x in moved.items()}
        return self.backend.build_metadata(CommonAttentionMetadata(**moved))

    def forward(self, q, k, v, cache, meta, scale):
        return self.backend.forward(q.cuda(), k.cuda(), v.cuda(), cache, meta, scale)
