"""A scheduler with no model, driven by hand, and a known linear step cost, for the latency-budget tests."""
from __future__ import annotations

import random

from kvserve.config.scheduler import SchedulerConfig
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_cost import LinearStepCost

# 10 ms a step, 1 ms a token, 1 us a query-key pair.
LINEAR_COST = LinearStepCost(base=0.010, per_token=0.001, per_pair=1e-6)


def latency_scheduler(target_ms: float | str, cost=LINEAR_COST, budget=512, long_prefill=0, num_blocks=1024) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), 16, True)
    config = SchedulerConfig(64, budget, 8192, long_prefill_token_threshold=long_prefill, target_itl_ms=target_ms)
    return Scheduler(config, kv, step_cost=cost)


def make_request(rid: str, prompt_len: int, max_tokens: int, seed: int = 0) -> Request:
    rng = random.Random(f"{rid}-{seed}")
    return Request(rid, [rng.randrange(1000) for _ in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)
