"""Prompt chunk sizing: how many tokens a request computes this step, within the token budget, the long-prefill
cap and the latency budget (config.target_itl_ms)."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from kvserve.config.scheduler import AUTO, SchedulerConfig
from kvserve.request import Request
from kvserve.core_types import SchedulerOutput
from kvserve.scheduler.step_cost import LatencyBudget, StepCost, StepFeatures
from kvserve.scheduler.step_target import GuardDuty, prompt_slowdown, step_limit_s

# NOTE: the queue is FCFS (or bounded-wait lpm): the prompts that waited longest are at its head, and a
# server under load may queue thousands (a prediction each would cost the step milliseconds).
_WAITING_LOOKED_AT = 8


def _is_decode(req: Request) -> bool:
    return req.num_tokens - req.num_computed_tokens == 1


def prefill_chunk_cap(config: SchedulerConfig, running: list[Request]) -> int:
    """Most prompt tokens one request may compute this step.

    NOTE: a step takes as long as all of its tokens, so a 512-token chunk beside 16 decodes makes each of
    those 16 wait ~8 decode steps for its next token. Capping each prefill's chunk while anyone decodes
    bounds that stall (the `interference` workload); with nobody decoding the cap would only slow the
    prompt down, so it does not apply. Several prefills may still share one step's budget."""
    cap = config.long_prefill_token_threshold
    if cap <= 0 or not config.enable_chunked_prefill:
        return config.max_num_batched_tokens
    return cap if any(_is_decode(r) for r in running) else config.max_num_batched_tokens


def latency_budget(config: SchedulerConfig, step_cost: StepCost, running: list[Request],
                   waiting: Iterable[Request] = (), duty: GuardDuty | None = None) -> LatencyBudget | None:
    """The budget that sizes this step's prompt chunks by predicted time (config.target_itl_ms, see
    scheduler/step_target.py), when the step carries decodes; None (the token budget alone) otherwise, or
    when the target is 0. waiting: the admission queue, in order (its head's prompts wait too); duty: the
    scheduler's GuardDuty (auto), observed here once a step."""
    if not config.target_itl_ms or not config.enable_chunked_prefill:
        return None
    decodes, prompts = StepFeatures(), []
    for r in running:
        if _is_decode(r):
            decodes = decodes + StepFeatures.of_request(r.num_computed_tokens,
                                                        r.num_tokens_with_spec - r.num_computed_tokens)
        elif r.metrics.first_token_time is None:
            prompts.append(r)
    if not decodes.num_seqs:
        return None
    slowdown = 0.0
    if config.target_itl_ms == AUTO:
        prompts += (r for r in islice(waiting, _WAITING_LOOKED_AT) if r.metrics.first_token_time is None)
        if duty is not None:
            duty.observe(any(r.num_prompt_tokens > config.max_num_batched_tokens for r in prompts))
            if duty.lifted:
                return None
        slowdown = prompt_slowdown(step_cost, prompts, time.monotonic())
    limit = step_limit_s(config.target_itl_ms, step_cost.predict(decodes), slowdown)
    return LatencyBudget(step_cost, limit, decodes)


@dataclass
class ChunkSizer:
    """One step's chunk limits, built before the step's first request is sized (from the running decodes)."""

    cap: int
    """prefill_chunk_cap."""
    latency: LatencyBudget | None
    """latency_budget; it counts in each chunk it grants, so requests are sized in scheduling order."""
    whole_up_to: int = 0
    """A request of at most this many tokens (computed + new) computes whole, beside the latency budget, not
    capped by it (--target-itl-ms auto: a prompt that fits one step; scheduler/step_target.py); 0: none."""

    @classmethod
    def for_step(cls, config: SchedulerConfig, step_cost: StepCost, running: list[Request],
                 waiting: Iterable[Request] = (), duty: GuardDuty | None = None) -> ChunkSizer:
        whole = config.max_num_batched_tokens if config.target_itl_ms == AUTO else 0
        return cls(prefill_chunk_cap(config, running), latency_budget(config, step_cost, running, waiting, duty),
                   whole)

    def size(self, num_computed: int, num_new: int, budget: int, verifying: bool = False) -> int:
        """Tokens a request num_computed tokens in, with num_new left to compute, gets out of `budget`; 0: the
        step is full for it (it waits a step). A request verifying drafts is decodes: no latency cap."""
        n = min(num_new, budget, self.cap)
        if self.latency is not None and n > 1 and not verifying:
            if num_computed + num_new <= self.whole_up_to:
                self.latency.count(num_computed, n)
            else:
                n = self.latency.cap(num_computed, n)
        return n


def observe_step_cost(step_cost: StepCost, requests: dict[str, Request], out: SchedulerOutput,
                      execute_s: float) -> None:
    """Fit the step-cost model with a step that took execute_s; call before the requests are advanced."""
    if out.is_empty:
        return
    carried = sum((StepFeatures.of_request(requests[r].num_computed_tokens, n)
                   for r, n in out.num_scheduled_tokens.items() if r in requests), StepFeatures())
    step_cost.observe(carried, execute_s)
