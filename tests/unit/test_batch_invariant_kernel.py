"""The batch-invariant kernels on each instruction set this CPU runs (KVSERVE_CPU_ISA=avx512 | avx2 | scalar:
tests/helpers/kernels.py): the fixed-order matmul against a float64 reference, and every row of it bit-identical
whatever the number of rows (edge tiles included); paged attention's fixed-order mode giving each query row of a
prefill chunk or a draft verification exactly the bits of a lone decode at that position."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.layers.batch_invariant import BatchInvariantMethod, check_rows
from tests.helpers.kernels import build_or_skip, isa_params
from tests.helpers.oracles import dense_decode

pytestmark = pytest.mark.parametrize("isa", isa_params())


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, kernel) -> torch.nn.Module:
    g = torch.Generator().manual_seed(n * 7 + k)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).to(dtype), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype), requires_grad=False) if bias else None
    BatchInvariantMethod(kernel).process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("n,k", [(1, 7), (16, 64), (45, 33), (100, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_float64(isa, n, k, dtype):
    kernel = build_or_skip("batch_invariant", isa)
    layer = _layer(n, k, dtype, True, kernel)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = BatchInvariantMethod(kernel).apply(layer, x, layer.bias)
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    assert out.dtype == dtype and out.shape == (13, n)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_keeps_its_bits_whatever_the_number_of_rows(isa, dtype):
    kernel = build_or_skip("batch_invariant", isa)
    # N = 45: a full AVX-512 tile of two panels, then one panel, the last one partial; K = 1536: where oneDNN's
    # packed matmul is not row-invariant
    layer = _layer(45, 1536, dtype, True, kernel)
    method = BatchInvariantMethod(kernel)
    assert check_rows(lambda x: method.apply(layer, x, layer.bias), 1536, 20, dtype) == []


def test_a_three_dimensional_input_and_an_empty_one(isa):
    kernel = build_or_skip("batch_invariant", isa)
    layer = _layer(20, 24, torch.float32, False, kernel)
    method = BatchInvariantMethod(kernel)
    x = torch.randn(2, 5, 24)
    assert torch.equal(method.apply(layer, x, None)[1], method.apply(layer, x[1], None))
    assert method.apply(layer, x[:0], None).shape == (0, 5, 20)


def _paged_step(bs: int, seqs: list[tuple[int, int]], table: torch.Tensor) -> CommonAttentionMetadata:
    """Sequences (context already cached, new query tokens) over `table` [B, max_blocks]."""
    q_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    slots = [int(table[b, p // bs]) * bs + p % bs for b, (c, q) in enumerate(seqs) for p in range(c, c + q)]
    decodes = sum(q == 1 for q in q_lens)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0), seq_lens=torch.tensor(seq_lens), block_table=table,
        slot_mapping=torch.tensor(slots), num_decodes=decodes, num_decode_tokens=decodes, block_size=bs,
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def test_attention_rows_equal_lone_decodes(isa):
    kernel = build_or_skip("paged_attention", isa)
    backend = CPUPagedBackend(kernel, fixed_order=True)
    g = torch.Generator().manual_seed(0)
    bs, hq, hkv, d, num_blocks = 16, 8, 2, 64, 24
    kv = torch.zeros(num_blocks, bs, 2, hkv, d)
    # two sequences sharing their first two blocks (which cascade would read once), a 37-token chunk after 60
    # cached positions, and one decode
    table = torch.tensor([[3, 7, 1, 9, 12, 14, 20], [3, 7, 5, 0, 0, 0, 0]])
    seqs = [(60, 37), (40, 1)]
    total = [c + q for c, q in seqs]
    ks = [torch.randn(n, hkv, d, generator=g) for n in total]
    vs = [torch.randn(n, hkv, d, generator=g) for n in total]
    # the shared blocks hold the same K/V for both sequences
    ks[1][:32], vs[1][:32] = ks[0][:32], vs[0][:32]
    for b, n in enumerate(total):
        for p in range(n):
            kv[table[b, p // bs], p % bs, 0], kv[table[b, p // bs], p % bs, 1] = ks[b][p], vs[b][p]
    q = torch.randn(38, hq, d, generator=g)
    step = _paged_step(bs, seqs, table)
    k_new = torch.cat([ks[0][60:], ks[1][40:]])
    v_new = torch.cat([vs[0][60:], vs[1][40:]])
    out = backend.forward(q, k_new, v_new, kv, backend.build_metadata(step), 0.125)
    # each row again, alone, as a decode at its position
    for row in (0, 17, 36, 37):
        b, pos = (0, 60 + row) if row < 37 else (1, 40)
        lone = _paged_step(bs, [(pos, 1)], table[b:b + 1])
        alone = backend.forward(q[row:row + 1], k_new[row:row + 1], v_new[row:row + 1], kv,
                                backend.build_metadata(lone), 0.125)
        assert torch.equal(out[row], alone[0]), f"row {row}"
    want = dense_decode(q[36:37], [ks[0][:97]], [vs[0][:97]], 0.125)
    torch.testing.assert_close(out[36:37], want, atol=1e-5, rtol=1e-5)
