"""A whole model on the Triton path's batch-invariant pieces, through Triton's interpreter on CPU tensors: linear
layers and the LM head on triton_batch_invariant.linear, norms on its add_rms_norm, attention on triton_paged's
batch-invariant mode. One sequence's hidden states and logits are the same bits however its tokens are
scheduled: one at a time alone, in prefill chunks of 1..24 beside other requests' decodes and chunks, as rows
verifying drafts (decode_groups); and they match transformers. Steps are built by hand (the engine's
`--batch-invariant` wiring is tested with it), so each schedule is exactly the one named."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from tests.helpers.oracles import hf_logits

pytest.importorskip("triton")

_BLOCK = 16
_NUM_BLOCKS = 16
_OTHERS = [(1, 30), (2, 20), (3, 25)]  # other sequences (id, length): their rows only fill the steps


@pytest.fixture(scope="module")
def invariant_model(tmp_path_factory):
    """(model, backend, R's tokens, HF oracle) of a tiny Granite (Llama with multipliers), one layer and a
    vocabulary of 512: the interpreter's cost is per program."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    from kvserve.attention.triton_paged import TritonPagedBackend
    from kvserve.layers import triton_batch_invariant as bi
    from kvserve.model_loader.loader import (
        ModelSource,
        iter_checkpoint_tensors,
        load_hf_config,
    )
    from kvserve.model_loader.weight_loader import load_weights
    from kvserve.models.build import build_model
    from kvserve.models.layer_ops import TritonInvariantLayerOps
    from tests.helpers.architectures import make_checkpoint

    path = str(tmp_path_factory.mktemp("granite_bi"))
    hf = make_checkpoint(path, "granite", seed=3, vocab_size=512, num_hidden_layers=1)
    source = ModelSource("hf", path)
    backend = TritonPagedBackend(importlib.import_module("kvserve.attention.triton_kernels"), batch_invariant=True)
    model = build_model(load_hf_config(source), backend, 128, torch.float32, torch.device("cpu"),
                        bi.TritonBatchInvariantMethod())
    load_weights(model, iter_checkpoint_tensors(source, torch.float32))
    model.ops = TritonInvariantLayerOps()  # what --batch-invariant on CUDA runs
    tokens = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    return model, backend, tokens, hf


def _tokens(seq: int, r_tokens: list[int]) -> list[int]:
    if seq == 0:
        return r_tokens
    return torch.randint(3, 512, (dict(_OTHERS)[seq],), generator=torch.Generator().manual_seed(seq)).tolist()


@torch.inference_mode()
def _run(model, backend, r_tokens: list[int], schedule) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Run the steps of `schedule` (each (parts, verify): parts (sequence, context, query length), decodes
    first; verify: every part as decode rows grouped per part) on fresh caches; returns sequence 0's hidden
    state at every position it computed and its logits where its part ended (the rows the runner samples)."""
    layer = model.layers[0].self_attn
    hkv, d = layer.num_kv_heads, layer.head_dim
    caches = [torch.zeros(backend.kv_cache_shape(_NUM_BLOCKS * 4, _BLOCK, hkv, d)) for _ in model.layers]
    # each sequence owns blocks [4 * seq, 4 * seq + 4), listed backwards so tables are not the identity
    tables = {s: [4 * s + 3 - i for i in range(4)] for s in range(_NUM_BLOCKS)}
    hidden_at, logits_at = {}, {}
    for parts, verify in schedule:
        rows = [(s, c + i, 1) for s, c, n in parts for i in range(n)] if verify else list(parts)
        groups = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0) if verify else None
        lens = [n for _, _, n in rows]
        pos = [(s, p) for s, c, n in rows for p in range(c, c + n)]
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0] + lens).cumsum(0), seq_lens=torch.tensor([c + n for _, c, n in rows]),
            block_table=torch.tensor([tables[s] for s, _, _ in rows]),
            slot_mapping=torch.tensor([tables[s][p // _BLOCK] * _BLOCK + p % _BLOCK for s, p in pos]),
            num_decodes=next((i for i, n in enumerate(lens) if n > 1), len(rows)),
            num_decode_tokens=next((i for i, n in enumerate(lens) if n > 1), len(rows)), block_size=_BLOCK,
            query_lens_cpu=lens, seq_lens_cpu=[c + n for _, c, n in rows], decode_groups=groups)
        ids = torch.tensor([_tokens(s, r_tokens)[p] for s, p in pos])
        hidden = model(ids, torch.tensor([p for _, p in pos]), caches, backend.build_metadata(common))
        ends = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0)[1:] - 1
        logits = model.compute_logits(hidden[ends])
        for i, (s, p) in enumerate(pos):
            if s == 0:
                hidden_at[p] = hidden[i]
        for j, (s, c, n) in enumerate(parts):
            if s == 0:
                logits_at[c + n - 1] = logits[j]
    return hidden_at, logits_at


def _with_others(r_part, step: int, decodes: int = 2, prefill: int = 5):
    """R's part beside `decodes` other decodes (first) and one other prefill chunk, at contexts varying by step
    (R's chunk before or after the other one)."""
    others = [(s, (step * 7 + s) % (n - prefill), 1) for s, n in _OTHERS[:decodes]]
    chunk = [(3, (step * 3) % (25 - prefill), prefill)] if prefill else []
    return others + ([r_part] + chunk if r_part[2] == 1 or step % 2 == 0 else chunk + [r_part])


def test_a_sequence_gets_the_same_bits_in_every_schedule(invariant_model):
    model, backend, r, hf = invariant_model
    n = len(r)
    alone = [([(0, p, 1)], False) for p in range(n)]
    ref_hidden, ref_logits = _run(model, backend, r, alone)
    torch.testing.assert_close(torch.stack([ref_logits[p] for p in range(n)]), hf_logits(hf, r), atol=1e-4, rtol=1e-4)

    def chunks(sizes):
        starts = torch.tensor([0] + sizes).cumsum(0).tolist()
        return [(0, c, s) for c, s in zip(starts, sizes)]

    schedules = {
        "one chunk of 24 beside decodes": [([(1, 9, 1), (2, 4, 1), (0, 0, 24)], False)],
        "chunks of 16, 8 beside decodes and a chunk": [
            (_with_others(part, i), False) for i, part in enumerate(chunks([16, 8]))],
        "chunks of 1..7 and decodes beside others": [
            (_with_others(part, i, decodes=i % 3, prefill=3 * (i % 2)), False)
            for i, part in enumerate(chunks([5, 1, 7, 2, 1, 3, 1, 4]))],
        "prefill 14, then drafts verified as decode rows": [
            ([(0, 0, 14)], False), ([(1, 4, 1), (0, 14, 4)], True), ([(0, 18, 3), (2, 7, 2)], True),
            ([(0, 21, 3)], True)],
        "prefill 17, then drafts verified as a chunk": [
            ([(1, 4, 1), (0, 0, 17)], False), ([(2, 3, 1), (0, 17, 4)], False), ([(0, 21, 3)], False)],
    }
    for name, schedule in schedules.items():
        hidden, logits = _run(model, backend, r, schedule)
        assert sorted(hidden) == list(range(n)), name
        for p, h in hidden.items():
            assert torch.equal(h, ref_hidden[p]), f"{name}: hidden state at {p}"
        for p, row in logits.items():
            assert torch.equal(row, ref_logits[p]), f"{name}: logits at {p}"
