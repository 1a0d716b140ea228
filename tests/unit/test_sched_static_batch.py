"""Static batching and contiguous reservation in the scheduler, without a model: a fake runner samples one
token per finished row; invariants after every step, every block free at the end."""
from __future__ import annotations

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core_types import ModelRunnerOutput
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

BS = 4


def _scheduler(static=False, num_blocks=64, max_seqs=8, budget=24, reserve=None, max_model_len=64):
    kv = KVCacheManager(BlockPool(num_blocks), BS, False, reserve_blocks=reserve)
    config = SchedulerConfig(max_seqs, budget, max_model_len, static_batching=static)
    return Scheduler(config, kv)


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, [7 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)


def _run(sched: Scheduler, requests: list[Request], after_schedule=None) -> list[dict[str, int]]:
    """Step until idle; returns each step's {request id: tokens}."""
    for r in requests:
        sched.add_request(r)
    steps = []
    while sched.num_unfinished:
        out = sched.schedule()
        if after_schedule is not None:
            after_schedule(sched, out)
        done = [rid for rid, n in out.num_scheduled_tokens.items()
                if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens]
        sched.update(out, ModelRunnerOutput(req_ids=done, sampled_token_ids=[[5] for _ in done]))
        sched.check_invariants()
        steps.append(dict(out.num_scheduled_tokens))
        assert len(steps) < 1000
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    return steps


def test_static_batch_admits_nothing_while_any_runs():
    sched = _scheduler(static=True, max_seqs=4)
    decoded: set[str] = set()  # requests that ran a decode step
    batches: list[set[str]] = []

    def check(s, out):
        new = {rid for rid in out.num_scheduled_tokens if s.requests[rid].num_computed_tokens == 0}
        if new:
            assert not decoded & {r.request_id for r in s.running}, "admitted beside a decoding request"
            if not batches or batches[-1] & decoded:
                batches.append(set())
            batches[-1] |= new
        decoded.update(rid for rid, n in out.num_scheduled_tokens.items()
                       if s.requests[rid].num_computed_tokens >= s.requests[rid].num_prompt_tokens)
    _run(sched, [_request(f"r{i}", 6, 2 + 5 * (i % 3)) for i in range(10)], check)
    assert [len(b) for b in batches] == [4, 4, 2]


def test_static_batch_forms_over_several_steps_and_decodes_together():
    # A 6-token prompt each, budget 8: the batch of 4 is admitted over 3 steps, and nobody decodes before then.
    sched = _scheduler(static=True, max_seqs=4, budget=8)
    steps = _run(sched, [_request(f"r{i}", 6, 3) for i in range(4)])
    decode_steps = [i for i, s in enumerate(steps) if s and all(n == 1 for n in s.values())]
    assert decode_steps[0] >= 3
    assert all(len(steps[i]) == 4 for i in decode_steps[:2])


def test_continuous_batching_admits_into_a_running_batch():
    sched = _scheduler(static=False, max_seqs=4)
    admitted_while_running = []

    def check(s, out):
        admitted_while_running.extend(rid for rid in out.num_scheduled_tokens
                                      if s.requests[rid].num_computed_tokens == 0 and len(s.running) > 1)
    _run(sched, [_request(f"r{i}", 6, 2 + 5 * (i % 3)) for i in range(10)], check)
    assert admitted_while_running


def test_contiguous_reservation_admits_only_whole_slabs():
    # max_model_len 32 = 8 blocks a slab; 20 blocks fit 2 slabs, so at most 2 requests run at once.
    sched = _scheduler(num_blocks=20, reserve=8, max_model_len=32)
    peak = []
    _run(sched, [_request(f"r{i}", 6, 4) for i in range(6)], lambda s, out: peak.append(len(s.running)))
    assert max(peak) == 2
    paged = _scheduler(num_blocks=20, max_model_len=32)
    peak = []
    _run(paged, [_request(f"r{i}", 6, 4) for i in range(6)], lambda s, out: peak.append(len(s.running)))
    assert max(peak) == 6
    assert sched.stats.num_preemptions == 0
