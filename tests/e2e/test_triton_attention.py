"""triton_paged against torch_ref (the oracle) through Triton's interpreter, on CPU tensors: mixed batches of
decodes and prefill chunks with cached context, random block tables, ragged lengths, GQA ratios, both
block sizes and padded slots. Skipped when triton is not installed; the same checks run on a GPU in
tests marked `gpu` (and scripts/gpu_check.sh)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.config import EngineArgs
from kvserve.attention.torch_ref import TorchRefBackend

pytest.importorskip("triton")

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def kernels():
    """The kernels under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a machine without
    CUDA, before triton is imported); with CUDA these CPU-tensor tests give way to the `gpu` ones."""
    if not _INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    return importlib.import_module("kvserve.attention.triton_kernels")


def _backend(kernels, splits: int = 1):
    from kvserve.attention.triton_paged import TritonPagedBackend
    return TritonPagedBackend(kernels, decode_splits=splits)


def _batch(g, query_lens, context_lens, block_size, num_blocks, hq, hkv, d, dtype):
    """A step's metadata over random, scattered block tables, a cache whose context slots hold random K/V,
    and the step's q/k/v (decodes first, as the runner orders them)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cache = torch.randn((num_blocks, block_size, 2, hkv, d), generator=g).to(dtype)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, q in zip(tables, context_lens, query_lens) for p in range(c, c + q)]
    t_total = sum(query_lens)
    # strided views of one fused projection, as the model hands them over
    qkv = torch.randn(t_total, hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    num_decodes = sum(1 for x in query_lens if x == 1)
    assert all(x == 1 for x in query_lens[:num_decodes])
    common = CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=torch.tensor(seq_lens), block_table=block_table,
        slot_mapping=torch.tensor(slots), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        block_size=block_size, query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)
    return common, cache, q, k, v


def _run_both(kernels, common, cache, q, k, v, d, splits: int = 1):
    ref_cache, tri_cache = cache.clone(), cache.clone()
    ref = TorchRefBackend()
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(common), d ** -0.5)
    tri = _backend(kernels, splits)
    out = tri.forward(q, k, v, tri_cache, tri.build_metadata(common), d ** -0.5)
    return out, expected, tri_cache, ref_cache


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_reference(kernels, block_size, hq, hkv, splits):
    """splits: the decode launch's split-KV ways (3 leaves some splits of short contexts empty)."""
    g = torch.Generator().manual_seed(block_size * 10 + hq + hkv)
    d = 32
    # decodes (short and multi-block contexts), then prefill chunks: first chunks and later chunks
    query_lens = [1, 1, 1, 19, 5, 33]
    context_lens = [0, 40, block_size - 1, 0, 2 * block_size + 3, 17]
    common, cache, q, k, v = _batch(g, query_lens, context_lens, block_size, 24, hq, hkv, d, torch.float32)
    out, expected, tri_cache, ref_cache = _run_both(kernels, common, cache, q, k, v, d, splits)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_supported_head_dims(kernels, d):
    g = torch.Generator().manual_seed(d)
    common, cache, q, k, v = _batch(g, [1, 1, 9], [20, 3, 11], 16, 8, 4, 2, d, torch.float32)
    out, expected, *_ = _run_both(kernels, common, cache, q, k, v, d)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_random_ragged_batches(kernels):
    """Random batch shapes: how many decodes, chunk lengths and cached contexts."""
    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        num_dec = int(torch.randint(0, 4, (1,), generator=g))
        num_pre = int(torch.randint(0 if num_dec else 1, 3, (1,), generator=g))
        query_lens = [1] * num_dec + torch.randint(2, 24, (num_pre,), generator=g).tolist()
        context_lens = torch.randint(0, 50, (num_dec + num_pre,), generator=g).tolist()
        block_size = (16, 32)[trial % 2]
        common, cache, q, k, v = _batch(g, query_lens, context_lens, block_size, 40, 4, 2, 16, torch.float32)
        out, expected, *_ = _run_both(kernels, common, cache, q, k, v, 16)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"{query_lens=} {context_lens=}")


def test_half_precision_accumulates_in_float32(kernels):
    """Half precision (fp16: the interpreter computes through numpy, which has no bf16; bf16 runs in the gpu
    test): the kernel's fp32 softmax and accumulation stay within half-precision rounding of the reference
    computed in float32 on the same (rounded) values."""
    g = torch.Generator().manual_seed(3)
    common, cache, q, k, v = _batch(g, [1, 1, 12], [60, 5, 20], 16, 16, 8, 2, 32, torch.float16)
    tri_cache = cache.clone()
    tri = _backend(kernels)
    out = tri.forward(q, k, v, tri_cache, tri.build_metadata(common), 32 ** -0.5)
    ref = TorchRefBackend()
    expected = ref.forward(q.float(), k.float(), v.float(), cache.float(), ref.build_metadata(common), 32 ** -0.5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_padded_rows_write_nowhere_and_output_zeros(kernels):
    """A CUDA-graph decode batch padded to its bucket: padded rows have slot -1 and seq_len 0."""
    g = torch.Generator().manual_seed(11)
    common, cache, q, k, v = _batch(g, [1, 1, 1], [30, 4, 16], 16, 12, 4, 2, 16, torch.float32)
    pad = 2
    padded = CommonAttentionMetadata(
        query_start_loc=torch.arange(3 + pad + 1),
        seq_lens=torch.cat((common.seq_lens, torch.zeros(pad, dtype=torch.long))),
        block_table=torch.cat((common.block_table, torch.zeros(pad, common.block_table.shape[1], dtype=torch.long))),
        slot_mapping=torch.cat((common.slot_mapping, torch.full((pad,), -1))), num_decodes=3 + pad,
        num_decode_tokens=3 + pad, block_size=16, query_lens_cpu=[1] * (3 + pad),
        seq_lens_cpu=common.seq_lens_cpu + [0] * pad)
    qp, kp, vp = (torch.cat((x, torch.randn(pad, *x.shape[1:], generator=g))) for x in (q, k, v))
    out, expected, tri_cache, ref_cache = _run_both(kernels, common, cache, q, k, v, 16)
    for splits in (1, 4):
        tri_cache = cache.clone()
        tri = _backend(kernels, splits)
        out_p = tri.forward(qp, kp, vp, tri_cache, tri.build_metadata(padded), 16 ** -0.5)
        torch.testing.assert_close(out_p[:3], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(out_p[3:], torch.zeros_like(out_p[3:]))
        torch.testing.assert_close(tri_cache, ref_cache, atol=0, rtol=0)  # only the real rows' slots changed


def test_prefill_tiles_cover_every_query_once():
    from kvserve.attention.triton_paged import prefill_tiles

    req, q0 = prefill_tiles([1, 1, 5, 16, 17, 40], 2, 16)
    assert req.tolist() == [2, 3, 4, 4, 5, 5, 5]
    assert q0.tolist() == [0, 0, 0, 16, 0, 16, 32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_kernels_match_reference(block_size, dtype, splits):
    """The compiled kernels on the GPU, head_dim 128 and Llama-3's GQA ratio, against torch_ref in float32."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    g = torch.Generator().manual_seed(block_size)
    query_lens, context_lens = [1] * 5 + [70, 3, 130], [0, 100, 31, 500, 17, 0, 64, 250]
    common, cache, q, k, v = _batch(g, query_lens, context_lens, block_size, 200, 32, 8, 128, dtype)
    fields = {f: getattr(common, f) for f in common.__dataclass_fields__}
    on_gpu = CommonAttentionMetadata(**{f: x.cuda() if isinstance(x, torch.Tensor) else x for f, x in fields.items()})
    tri = TritonPagedBackend(decode_splits=splits)  # None: the SM-count heuristic (5 decodes: several splits)
    out = tri.forward(q.cuda(), k.cuda(), v.cuda(), cache.cuda(), tri.build_metadata(on_gpu), 128 ** -0.5)
    ref = TorchRefBackend()
    expected = ref.forward(q.float(), k.float(), v.float(), cache.float(), ref.build_metadata(common), 128 ** -0.5)
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_engine_on_triton_paged_matches_transformers(kernels, tiny_llama):
    """The whole engine on the Triton backend (interpreted): chunked prefill, preemption and n-gram drafts
    (decode rows verifying drafts) give transformers' greedy tokens."""
    import random

    from kvserve.engine.engine import Engine
    from tests.helpers.oracles import assert_matches_hf

    path, hf = tiny_llama
    rng = random.Random(5)
    reqs = [([rng.randrange(3, 49152) for _ in range(n)], m) for n, m in [(1, 6), (17, 10), (70, 8), (40, 12)]]
    reqs.append(([7, 8, 9] * 12, 12))  # repetitive: n-gram drafts get proposed and verified
    engine = Engine(EngineArgs(model=path, attention_backend="triton_paged", num_gpu_blocks_override=9,
                               max_num_batched_tokens=32, max_num_seqs=4))
    assert engine.core.executor.worker.backend.name == "triton_paged"
    assert_matches_hf(None, reqs, hf, engine=engine)
    assert engine.scheduler.stats.num_preemptions > 0


def test_registry_offers_triton_paged_where_it_can_run(monkeypatch):
    from kvserve.attention.registry import make_backend

    with pytest.raises(ValueError, match="unquantized"):
        make_backend("triton_paged", "cpu", quantized_kv=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA only"):
        make_backend("triton_paged", "cpu")
    assert make_backend("auto", "cpu").name in ("cpu_paged", "torch_ref")  # the CPU's choice is unchanged
