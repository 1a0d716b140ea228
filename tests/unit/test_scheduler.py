"""Scheduler without a model: a fake runner returns scripted tokens while random arrivals, aborts and
finishes run; invariants and budgets are asserted after every step."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core_types import ModelRunnerOutput
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler


@dataclass
class _Entry:
    """One request of a step, as the scheduler decided it (read before update())."""

    request: Request
    num_tokens: int
    block_ids: list[int]
    samples: bool


@dataclass
class _Step:
    scheduled: list[_Entry]
    total_num_scheduled_tokens: int


def _entries(sched: Scheduler, out) -> list[_Entry]:
    entries = []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        entries.append(_Entry(req, n, sched.kv.block_ids(rid), req.num_computed_tokens + n == req.num_tokens))
    return entries


def _scheduler(num_blocks=32, block_size=4, max_seqs=8, budget=24, prefix=True, chunked=True, long_prefill=0):
    kv = KVCacheManager(BlockPool(num_blocks), block_size, prefix)
    return Scheduler(SchedulerConfig(max_seqs, budget, 4096, chunked, long_prefill_token_threshold=long_prefill), kv)


def _fake_tokens(step: _Step) -> ModelRunnerOutput:
    # deterministic "model": next token = (position * 7) % 1000 + 3
    sampling = [s for s in step.scheduled if s.samples]
    return ModelRunnerOutput(req_ids=[s.request.request_id for s in sampling],
                             sampled_token_ids=[[(s.request.num_tokens * 7) % 1000 + 3] for s in sampling])


def _step(sched: Scheduler):
    out = sched.schedule()
    step = _Step(_entries(sched, out), out.total_num_scheduled_tokens)
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ones = [s.num_tokens == 1 for s in step.scheduled]
    assert ones == sorted(ones, reverse=True), "decodes must come first"
    for s in step.scheduled:
        assert len(s.block_ids) * sched.kv.block_size >= s.request.num_computed_tokens + s.num_tokens
    by_id = {s.request.request_id: s.request for s in step.scheduled}
    outputs = sched.update(out, _fake_tokens(step))
    advanced = [by_id[o.request_id] for o in outputs if o.new_token_ids]
    sched.check_invariants()
    return step, advanced


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix", [True, False])
def test_random_arrivals_aborts_and_preemptions(seed, prefix):
    rng = random.Random(seed)
    sched = _scheduler(num_blocks=24, prefix=prefix, long_prefill=3 if seed % 2 else 0)
    shared = [rng.randrange(1000) for _ in range(12)]
    expected: dict[str, list[int]] = {}
    done: dict[str, Request] = {}
    next_id = 0
    for step in range(400):
        if (step < 10 or rng.random() < 0.3) and next_id < 40:
            n = rng.randint(1, 30)
            prompt = (shared[:rng.randint(0, 12)] + [rng.randrange(1000) for _ in range(n)])[:40] or [1]
            req = Request(str(next_id), prompt, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                          max_tokens=0)
            req.max_tokens = req.sampling_params.max_tokens
            sched.add_request(req)
            expected[req.request_id] = [((len(prompt) + i) * 7) % 1000 + 3 for i in range(req.max_tokens)]
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(list(sched.requests))
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            expected.pop(victim)
            sched.check_invariants()
        out, advanced = _step(sched)
        for r in advanced:
            if r.is_finished:
                done[r.request_id] = r
        if next_id >= 40 and not sched.requests:
            break
    assert not sched.requests, "every request finishes (no starvation)"
    assert sched.stats.num_preemptions > 0
    for rid, tokens in expected.items():
        assert done[rid].output_token_ids == tokens  # output unchanged by preemption/recompute
    assert sched.kv.pool.counts()["in_use"] == 0


def test_preempts_most_recently_admitted_and_resumes_first():
    sched = _scheduler(num_blocks=6, block_size=4, budget=64, prefix=False)
    reqs = []
    for i in range(3):
        r = Request(str(i), list(range(7)), SamplingParams(max_tokens=9, ignore_eos=True), max_tokens=9)
        reqs.append(r)
        sched.add_request(r)
    _step(sched)                     # 7-token prefills: 2 blocks each, the pool is full
    _step(sched)                     # the 8th token still fits the second block
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 3
    _step(sched)                     # the 9th needs a third block: the newest request makes room
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert sched.waiting[0] is reqs[2]
    while sched.requests:
        _step(sched)
    assert all(len(r.output_token_ids) == 9 for r in reqs)


def test_fcfs_admission_and_max_num_seqs():
    sched = _scheduler(num_blocks=64, max_seqs=2, budget=100)
    for i in range(4):
        sched.add_request(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=2), max_tokens=2))
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1"]
    _step(sched)
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["2", "3"]


def test_chunked_prefill_splits_long_prompt_and_keeps_decodes_flowing():
    sched = _scheduler(num_blocks=64, budget=8)
    short = Request("s", [1, 2], SamplingParams(max_tokens=10, ignore_eos=True), max_tokens=10)
    sched.add_request(short)
    _step(sched)
    long = Request("l", list(range(30)), SamplingParams(max_tokens=1), max_tokens=1)
    sched.add_request(long)
    chunks = []
    while long.num_computed_tokens < 30:
        out, _ = _step(sched)
        assert any(s.request is short for s in out.scheduled), "the decode runs in every step"
        chunks += [s.num_tokens for s in out.scheduled if s.request is long]
    assert chunks == [7, 7, 7, 7, 2]


def test_long_prefill_threshold_caps_chunks_only_beside_decodes():
    sched = _scheduler(num_blocks=64, budget=24, long_prefill=5)
    first = Request("a", list(range(20)), SamplingParams(max_tokens=10, ignore_eos=True), max_tokens=10)
    sched.add_request(first)
    out, _ = _step(sched)
    assert [s.num_tokens for s in out.scheduled] == [20], "nobody decodes: the whole prompt in one step"
    for rid in "bc":
        sched.add_request(Request(rid, list(range(100, 117)), SamplingParams(max_tokens=1), max_tokens=1))
    chunks: dict[str, list[int]] = {"b": [], "c": []}
    while any(sched.requests[r].num_computed_tokens < 17 for r in "bc" if r in sched.requests):
        out, _ = _step(sched)
        assert out.scheduled[0].request is first, "the decode runs in every step"
        for s in out.scheduled[1:]:
            chunks[s.request.request_id].append(s.num_tokens)
    assert chunks == {"b": [5, 5, 5, 2], "c": [5, 5, 5, 2]}, "two prefills share each step, 5 tokens each"


def test_no_chunking_waits_for_whole_prompt_budget():
    sched = _scheduler(num_blocks=64, budget=40, chunked=False)
    sched.add_request(Request("a", list(range(30)), SamplingParams(max_tokens=1), max_tokens=1))
    sched.add_request(Request("b", list(range(30)), SamplingParams(max_tokens=1), max_tokens=1))
    out, _ = _step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 30)]
