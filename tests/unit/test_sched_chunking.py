"""Prompt chunk sizing alone: the long-prefill cap, the latency budget, the step-cost fit's input."""
from __future__ import annotations

import pytest

from kvserve.config.scheduler import SchedulerConfig
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.chunking import ChunkSizer, latency_budget, observe_step_cost, prefill_chunk_cap
from kvserve.core_types import CachedRequestData, SchedulerOutput
from kvserve.scheduler.step_cost import MIN_PROMPT_CHUNK, LinearStepCost, StepFeatures


def _cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 4096, **kw})


def _req(rid: str, prompt: int, computed: int) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=4), max_tokens=4)
    r.num_computed_tokens = computed
    return r


DECODE, PREFILL = _req("d", 10, 9), _req("p", 100, 0)


def test_the_long_prefill_cap_applies_only_beside_decodes():
    cfg = _cfg(long_prefill_token_threshold=32)
    assert prefill_chunk_cap(cfg, [DECODE, PREFILL]) == 32
    assert prefill_chunk_cap(cfg, [PREFILL]) == 256
    assert prefill_chunk_cap(_cfg(), [DECODE]) == 256
    assert prefill_chunk_cap(_cfg(long_prefill_token_threshold=32, enable_chunked_prefill=False), [DECODE]) == 256


def test_the_latency_budget_exists_only_with_a_target_chunking_and_decodes():
    cost = LinearStepCost(per_token=1e-3)
    assert latency_budget(_cfg(), cost, [DECODE]) is None
    assert latency_budget(_cfg(target_itl_ms=50, enable_chunked_prefill=False), cost, [DECODE]) is None
    assert latency_budget(_cfg(target_itl_ms=50), cost, [PREFILL]) is None
    budget = latency_budget(_cfg(target_itl_ms=50), cost, [DECODE, PREFILL])
    assert budget.carried == StepFeatures.of_request(9, 1) and budget.target_s == 0.05


def test_chunk_sizer_takes_the_smallest_limit_and_counts_granted_chunks():
    cfg = _cfg(long_prefill_token_threshold=64, target_itl_ms=50)
    sizer = ChunkSizer.for_step(cfg, LinearStepCost(per_token=1e-3), [DECODE])
    assert sizer.cap == 64
    assert sizer.size(0, 100, budget=200) == 49   # 1 decode + 49 prompt tokens = 50 ms
    assert sizer.size(0, 100, budget=200) == 0    # the step is full (the floor went to the first chunk)
    assert sizer.size(0, 3, budget=200, verifying=True) == 3  # drafts are decodes: no latency cap
    assert sizer.size(5, 1, budget=200) == 1


def test_chunk_sizer_without_latency_is_the_token_budget_and_the_cap():
    sizer = ChunkSizer.for_step(_cfg(long_prefill_token_threshold=64), LinearStepCost(), [DECODE])
    assert sizer.latency is None
    assert sizer.size(0, 100, budget=200) == 64 and sizer.size(0, 100, budget=10) == 10
    assert sizer.size(0, 5, budget=200) == 5


def test_the_first_chunk_gets_the_floor_even_over_the_target():
    sizer = ChunkSizer.for_step(_cfg(target_itl_ms=1), LinearStepCost(per_token=1.0), [DECODE])
    assert sizer.size(0, 100, budget=200) == MIN_PROMPT_CHUNK
    assert sizer.size(0, 100, budget=200) == 0


class _Recorder:
    def __init__(self):
        self.seen = []

    def observe(self, features, seconds):
        self.seen.append((features, seconds))


def test_observe_step_cost_uses_the_counts_before_the_step():
    cost, requests = _Recorder(), {"d": DECODE, "p": PREFILL}
    out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"d": 1, "p": 32, "gone": 5}, total_num_scheduled_tokens=38)
    observe_step_cost(cost, requests, out, 0.02)
    assert cost.seen == [(StepFeatures.of_request(9, 1) + StepFeatures.of_request(0, 32), 0.02)]
    empty = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                            num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    observe_step_cost(cost, requests, empty, 0.01)
    assert len(cost.seen) == 1


def test_auto_sizes_a_prompt_that_fits_the_token_budget_whole_and_counts_it_in():
    sizer = ChunkSizer.for_step(_cfg(target_itl_ms="auto"), LinearStepCost(base=0.01, per_token=1e-3), [DECODE])
    assert sizer.whole_up_to == 256 and sizer.latency.target_s == pytest.approx(2.2 * 0.011)
    assert sizer.size(0, 200, budget=255) == 200          # fits one step: whole, over the 24 ms limit
    assert sizer.latency.carried == StepFeatures.of_request(9, 1) + StepFeatures.of_request(0, 200)
    assert sizer.size(0, 300, budget=55) == 0             # a longer one: the step is over its limit already
    fixed = ChunkSizer.for_step(_cfg(target_itl_ms=30), LinearStepCost(base=0.01, per_token=1e-3), [DECODE])
    assert fixed.whole_up_to == 0 and fixed.size(0, 200, budget=255) == 19   # 11 + 19 = 30 ms
