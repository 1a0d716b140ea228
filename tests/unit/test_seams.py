"""The core's seams: the scheduler -> worker diff, the worker's persistent input batch, layers that
load their own (sharded) weights (the engine-core boundary on a model: tests/engine/test_core_boundary.py)."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from kvserve.config.scheduler import SchedulerConfig
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.layers.linear_methods import DenseMethod, OneDNNPackedMethod
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.core_types import ModelRunnerOutput


# ---- the diff ---------------------------------------------------------------------------------
def _sched(num_blocks=8, block_size=4, budget=64):
    kv = KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(8, budget, 4096), kv)


def _sample_all(sched, out) -> ModelRunnerOutput:
    ids = [rid for rid, n in out.num_scheduled_tokens.items()
           if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids])


def test_scheduler_output_sends_each_request_once_then_only_changes():
    sched = _sched()
    a = Request("a", list(range(10)), SamplingParams(max_tokens=20, ignore_eos=True), max_tokens=20)
    sched.add_request(a)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].prompt_token_ids == list(range(10))
    assert len(out.scheduled_new_reqs[0].block_ids) == 3
    sched.update(out, _sample_all(sched, out))
    out = sched.schedule()  # the 11th token fits the 3rd block: nothing new to send but counts
    assert not out.scheduled_new_reqs
    assert out.scheduled_cached_reqs.req_ids == ["a"] and out.scheduled_cached_reqs.new_block_ids == [[]]
    assert out.scheduled_cached_reqs.num_computed_tokens == [10]
    sched.update(out, _sample_all(sched, out))
    out = sched.schedule()  # the 12th ...
    sched.update(out, _sample_all(sched, out))
    out = sched.schedule()  # the 13th needs a 4th block: only that block is sent
    assert len(out.scheduled_cached_reqs.new_block_ids[0]) == 1
    # a decode step's diff is small whatever the prompt's length
    assert len(pickle.dumps(out)) < 1000
    sched.update(out, _sample_all(sched, out))
    sched.finish_request("a", a.status.FINISHED_ABORTED)
    assert sched.schedule().finished_req_ids == {"a"}


def test_preempted_request_resumes_with_a_whole_new_table():
    sched = _sched(num_blocks=6, budget=64)
    reqs = [Request(str(i), list(range(7)), SamplingParams(max_tokens=9, ignore_eos=True), max_tokens=9)
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted, resumed = None, None
    for _ in range(40):
        out = sched.schedule()
        if out.preempted_req_ids and preempted is None:
            preempted = next(iter(out.preempted_req_ids))
        cached = out.scheduled_cached_reqs
        for rid, res, blocks in zip(cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids):
            if res:
                resumed = (rid, blocks)
        sched.update(out, _sample_all(sched, out))
        sched.check_invariants()
        if not sched.requests:
            break
    assert preempted is not None and resumed is not None and resumed[0] == preempted
    assert len(resumed[1]) >= 2  # the whole table again, not a diff


def test_update_rolls_back_rejected_drafts_and_caches_only_final_tokens():
    kv = KVCacheManager(BlockPool(16), 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(8, 64, 4096), kv)
    r = Request("r", list(range(6)), SamplingParams(max_tokens=20, ignore_eos=True), max_tokens=20)
    sched.add_request(r)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[100]]))  # 7 tokens, 6 computed
    r.spec_token_ids = [101, 102, 103]                    # a proposer's drafts: 4 tokens to verify
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.scheduled_spec_decode_tokens == {"r": [101, 102, 103]}
    # one draft accepted, then a correction
    sched.update(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[101, 555]]))
    assert r.output_token_ids == [100, 101, 555] and r.num_computed_tokens == 8 and not r.spec_token_ids
    # blocks hold only tokens that are final: 8 computed -> 2 full blocks registered, no draft's KV
    assert kv._num_registered["r"] == 2
    sched.check_invariants()


# ---- the input batch -------------------------------------------------------------------------
def _state(rid: str, n: int) -> CachedRequestState:
    return CachedRequestState(rid, list(range(100 * n, 100 * n + n)), SamplingParams(temperature=0.5 + n / 10), (),
                              None, 0)


def test_input_batch_keeps_rows_dense_and_intact():
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_blocks_per_req=8)
    for rid, n, blocks in (("a", 3, [1]), ("b", 5, [2, 3]), ("c", 7, [4, 5, 6])):
        batch.add(_state(rid, n), blocks)
    batch.remove("a")  # the last row ("c") moves into row 0
    assert batch.req_ids == ["c", "b"] and batch.index == {"c": 0, "b": 1}
    assert batch.token_ids[0, :7].tolist() == list(range(700, 707)) and batch.num_tokens[0] == 7
    assert batch.block_table[0, :3].tolist() == [4, 5, 6] and batch.num_blocks[0] == 3
    assert batch.temperature[0] == pytest.approx(1.2)
    batch.append_token(1, 42)
    batch.append_blocks(1, [9])
    assert batch.states[1].output_token_ids == [42] and batch.token_ids[1, 5] == 42
    assert batch.block_table[1, :3].tolist() == [2, 3, 9]
    meta = batch.sampling_metadata(np.array([1, 0]), vocab_size=100, device=torch.device("cpu"))
    assert meta.temperature.tolist() == pytest.approx([1.0, 1.2])


# ---- layers and their shards -----------------------------------------------------------------
def _shards(make, tp: int):
    return [make(rank, tp) for rank in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("method", [DenseMethod, OneDNNPackedMethod])
def test_layers_load_their_parts_and_rank_shards(tp, method):
    if method is OneDNNPackedMethod and not OneDNNPackedMethod.available():
        pytest.skip("no oneDNN")
    g = torch.Generator().manual_seed(tp)
    hidden, head_dim, heads, kv_heads, inter = 32, 4, 8, 2, 24
    x = torch.randn(5, hidden, generator=g)
    wq, wk, wv = (torch.randn(n * head_dim, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    wg, wu = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    wd = torch.randn(hidden, inter, generator=g)

    def load(layer, parts):
        for name, tensor, shard in parts:
            layer.weight_loader(name, tensor, shard)
        layer.process_weights_after_loading()
        return layer

    qkvs = [load(QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, method(), r, tp),
                 [("weight", wq, "q"), ("weight", wk, "k"), ("weight", wv, "v"),
                  ("bias", bq, "q"), ("bias", bk, "k"), ("bias", bv, "v")]) for r in range(tp)]
    outs = [layer(x) for layer in qkvs]
    q_per, kv_per = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    q = torch.cat([o[:, :q_per] for o in outs], dim=1)
    torch.testing.assert_close(q, x @ wq.T + bq, atol=1e-4, rtol=1e-4)
    for r, o in enumerate(outs):  # each rank's KV heads (replicated when there are fewer than ranks)
        kv_head = r * kv_heads // tp if kv_heads >= tp else r // (tp // kv_heads)
        rows = slice(kv_head * head_dim, kv_head * head_dim + kv_per)
        torch.testing.assert_close(o[:, q_per:q_per + kv_per], (x @ wk.T + bk)[:, rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(o[:, q_per + kv_per:], (x @ wv.T + bv)[:, rows], atol=1e-4, rtol=1e-4)

    gate_up = [load(MergedColumnParallelLinear(hidden, [inter, inter], False, method(), r, tp),
                    [("weight", wg, 0), ("weight", wu, 1)]) for r in range(tp)]
    per = inter // tp
    h = [o[:, :per] * o[:, per:] for o in (layer(x) for layer in gate_up)]  # this rank's gate * up
    down = [load(RowParallelLinear(inter, hidden, False, method(), r, tp), [("weight", wd, None)]) for r in range(tp)]
    y = sum(layer(part) for layer, part in zip(down, h))  # the all-reduce
    torch.testing.assert_close(y, ((x @ wg.T) * (x @ wu.T)) @ wd.T, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_embedding_and_lm_head(tp, tied):
    g = torch.Generator().manual_seed(tp)
    vocab, hidden = 16, 8
    emb_w, head_w = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    ids = torch.tensor([0, 5, 8, 15])
    embs, heads = [], []
    for r in range(tp):
        emb = VocabParallelEmbedding(vocab, hidden, r, tp, reduce=lambda t: t)
        emb.weight_loader("weight", emb_w)
        head = ParallelLMHead(vocab, hidden, DenseMethod(), emb if tied else None, r, tp)
        if not tied:
            head.weight_loader("weight", head_w)
        head.process_weights_after_loading()
        embs.append(emb)
        heads.append(head)
    x = sum(e(ids) for e in embs)  # each rank embeds the ids it holds, zeros elsewhere; summed
    torch.testing.assert_close(x, emb_w[ids])
    logits = torch.cat([h(x) for h in heads], dim=-1)  # the all-gather
    torch.testing.assert_close(logits, x @ (emb_w if tied else head_w).T)
