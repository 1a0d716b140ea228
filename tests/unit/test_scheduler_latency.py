"""The latency-aware step budget (--target-itl-ms) in the scheduler, with a known cost model injected so
chunk sizes are exact: chunks beside decodes are sized to the target, prompt-only steps use the whole
budget, 0 is the fixed budget exactly, and block accounting holds after every step."""
from __future__ import annotations

import random

from kvserve.config.scheduler import SchedulerConfig
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_cost import MIN_PROMPT_CHUNK, LinearStepCost, StepFeatures
from kvserve.scheduler.step_target import ITL_RATIO
from kvserve.core_types import ModelRunnerOutput
from tests.helpers.scheduler import LINEAR_COST, latency_scheduler, make_request


def _step(sched: Scheduler, seconds: float = 0.0):
    """One step with a fake model (next token = position-derived); returns (schedule, features carried)."""
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    carried = StepFeatures()
    sampling = []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        assert len(sched.kv.block_ids(rid)) * sched.kv.block_size >= req.num_computed_tokens + n
        carried = carried + StepFeatures.of_request(req.num_computed_tokens, n)
        if req.num_computed_tokens + n == req.num_tokens:
            sampling.append(req)
    runner = ModelRunnerOutput(req_ids=[r.request_id for r in sampling],
                               sampled_token_ids=[[(r.num_tokens * 7) % 1000 + 3] for r in sampling],
                               execute_s=seconds)
    sched.update(out, runner)
    sched.check_invariants()
    return out, carried


def _decoders(sched: Scheduler, n: int) -> list[Request]:
    reqs = [make_request(f"d{i}", 20, 200) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    _step(sched)
    return reqs


def test_chunks_beside_decodes_are_sized_to_the_target():
    sched = latency_scheduler(target_ms=100)
    _decoders(sched, 8)
    sched.add_request(make_request("long", 2000, 4))
    long = sched.requests["long"]
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out, carried = _step(sched)
        assert sum(n == 1 for n in out.num_scheduled_tokens.values()) == 8, "every decode runs every step"
        chunk = out.num_scheduled_tokens["long"]
        chunks.append(chunk)
        predicted = LINEAR_COST.predict(carried)
        assert predicted <= 0.100 + 1e-9, f"step with decodes predicted {predicted * 1000:.1f} ms"
        computed = long.num_computed_tokens - chunk
        if computed + chunk < long.num_prompt_tokens:  # not the last chunk: one more token would exceed it
            this, grown = StepFeatures.of_request(computed, chunk), StepFeatures.of_request(computed, chunk + 1)
            extra = LINEAR_COST.predict(grown) - LINEAR_COST.predict(this)
            assert predicted + extra > 0.100
    assert chunks[0] == 76 and chunks == sorted(chunks, reverse=True), chunks  # 10 + 8 + 76 + 6 ms; then
    assert sum(chunks) == 2000                                                 # longer contexts cost pairs


def test_prompt_only_steps_use_the_whole_budget():
    sched = latency_scheduler(target_ms=20)
    sched.add_request(make_request("a", 1200, 2))
    out, _ = _step(sched)
    assert out.num_scheduled_tokens == {"a": 512}
    out, _ = _step(sched)
    assert out.num_scheduled_tokens == {"a": 512}


def test_floor_keeps_prompts_moving_when_decodes_fill_the_target():
    sched = latency_scheduler(target_ms=15)   # 8 decodes alone: 18 ms; twice that is the step's limit
    _decoders(sched, 8)
    sched.add_request(make_request("long", 300, 2))
    out, carried = _step(sched)
    assert out.num_scheduled_tokens["long"] == 17      # 18.2 + 17 + 0.3 <= 2 x 18.2 ms
    heavy = latency_scheduler(target_ms=1, cost=LinearStepCost(base=0.010, per_token=0.001, per_pair=1e-3))
    _decoders(heavy, 4)
    heavy.add_request(make_request("long", 300, 2))
    out, _ = _step(heavy)
    assert out.num_scheduled_tokens["long"] == MIN_PROMPT_CHUNK


def test_long_prefill_threshold_still_caps():
    sched = latency_scheduler(target_ms=1000, long_prefill=32)
    _decoders(sched, 2)
    sched.add_request(make_request("long", 300, 2))
    out, _ = _step(sched)
    assert out.num_scheduled_tokens["long"] == 32


def _trace(sched: Scheduler, seed: int) -> list[dict[str, int]]:
    """A random arrival pattern; the schedule of every step."""
    rng = random.Random(seed)
    steps, next_id = [], 0
    for step in range(600):
        if next_id < 30 and (step < 3 or rng.random() < 0.2):
            sched.add_request(make_request(str(next_id), rng.randint(1, 700), rng.randint(1, 40), seed))
            next_id += 1
        out, _ = _step(sched, seconds=0.02)
        steps.append(dict(out.num_scheduled_tokens))
        if next_id >= 30 and not sched.requests:
            break
    assert not sched.requests
    return steps


def test_target_zero_is_the_fixed_budget_exactly():
    for seed in range(3):
        fixed = _trace(Scheduler(SchedulerConfig(64, 512, 8192), KVCacheManager(BlockPool(256), 16, True)), seed)
        off = _trace(latency_scheduler(target_ms=0, num_blocks=256), seed)
        on = _trace(latency_scheduler(target_ms=40, num_blocks=256), seed)
        assert off == fixed
        assert on != fixed  # the same arrivals do get smaller chunks beside decodes with a target


def test_measured_step_times_reach_the_cost_model():
    class Recording(LinearStepCost):
        def observe(self, features, seconds):
            seen.append((features, seconds))

    seen: list = []
    sched = latency_scheduler(target_ms=50, cost=Recording(base=0.01, per_token=0.001))
    _decoders(sched, 2)
    sched.add_request(make_request("x", 30, 2))
    _, carried = _step(sched, seconds=0.033)
    assert seen[-1] == (carried, 0.033)
    assert seen[0][0] == StepFeatures(40, 2, 40, 2 * 20 * 20)  # the two 20-token prompts
    off = latency_scheduler(target_ms=0, cost=Recording())
    seen.clear()
    _decoders(off, 2)
    assert seen == [], "off: nothing is fitted"


def test_auto_computes_a_prompt_that_fits_one_step_whole_beside_decodes():
    sched = latency_scheduler(target_ms="auto")
    _decoders(sched, 8)
    sched.add_request(make_request("short", 400, 2))
    out, _ = _step(sched)
    assert out.num_scheduled_tokens["short"] == 400   # the 150-ms rule would cut it to a few dozen tokens
    assert sum(n == 1 for n in out.num_scheduled_tokens.values()) == 8


def test_auto_chunks_a_long_prompt_at_a_multiple_of_the_decode_step():
    sched = latency_scheduler(target_ms="auto")
    _decoders(sched, 8)
    sched.add_request(make_request("long", 2000, 4))
    long = sched.requests["long"]
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        decodes = sum((StepFeatures.of_request(r.num_computed_tokens, 1) for r in sched.running if r is not long),
                      StepFeatures())
        out, carried = _step(sched)
        chunks.append(out.num_scheduled_tokens["long"])
        within = LINEAR_COST.predict(carried) <= ITL_RATIO * LINEAR_COST.predict(decodes) + 1e-9
        assert within or chunks[-1] <= MIN_PROMPT_CHUNK, chunks  # the floor: the prompt still moves
    assert sum(chunks) == 2000 and 16 < chunks[0] < 100, chunks


def test_auto_lifts_the_guard_for_a_prompt_that_waited_long():
    sched = latency_scheduler(target_ms="auto")
    _decoders(sched, 8)
    sched.add_request(make_request("long", 2000, 4))
    out, _ = _step(sched)
    guarded = out.num_scheduled_tokens["long"]
    sched.requests["long"].metrics.arrival_time -= 600.0  # waited 10 minutes: 100x its own 6 s alone
    out, _ = _step(sched)
    assert out.num_scheduled_tokens["long"] == 512 - 8 > 4 * guarded


def test_auto_with_prompt_only_steps_and_long_prefill_cap():
    sched = latency_scheduler(target_ms="auto")
    sched.add_request(make_request("a", 1200, 2))
    out, _ = _step(sched)
    assert out.num_scheduled_tokens == {"a": 512}     # nobody decodes: the whole budget
    capped = latency_scheduler(target_ms="auto", long_prefill=32)
    _decoders(capped, 2)
    capped.add_request(make_request("b", 300, 2))
    out, _ = _step(capped)
    assert out.num_scheduled_tokens["b"] == 32        # vLLM's cap still applies to a prompt that fits one step


def test_auto_is_the_fixed_budget_exactly_while_every_prompt_fits_one_step():
    """`mixed`'s case: no prompt longer than --max-num-batched-tokens, so auto schedules every step as the
    fixed budget does (its throughput and TTFT are the fixed budget's)."""
    def trace(sched: Scheduler, seed: int) -> list[dict[str, int]]:
        rng, steps = random.Random(seed), []
        for i in range(40):
            sched.add_request(make_request(str(i), rng.randint(1, 512), rng.randint(1, 40), seed))
        while sched.requests:
            steps.append(dict(_step(sched, seconds=0.02)[0].num_scheduled_tokens))
        return steps

    for seed in range(2):
        fixed = trace(latency_scheduler(target_ms=0, num_blocks=512), seed)
        assert trace(latency_scheduler(target_ms="auto", num_blocks=512), seed) == fixed
        assert trace(latency_scheduler(target_ms=150, num_blocks=512), seed) != fixed
