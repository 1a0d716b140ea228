"""How long a step that carries decodes may take: the limit the latency budget sizes prompt chunks to.

Two policies, chosen by --target-itl-ms:
- a number T (ms): the step may take T, or twice its decodes' own predicted time where that is longer.
- `auto` (the default), three rules:
  - a prompt that fits one step (at most --max-num-batched-tokens tokens) is computed whole, not capped
    by the limit (chunking.ChunkSizer.whole_up_to);
  - a longer prompt's chunks keep the step within ITL_RATIO times the decode-only step this machine runs now
    (the cost model's prediction of the same step without prompt tokens);
  - that limit grows in proportion to the wait of the prompt that has waited longest for its first token,
    once it exceeds SLOWDOWN_TOLERATED times that prompt's own predicted time;
  - it is lifted altogether while most decoding steps lately had a long prompt waiting (GuardDuty).

Why relative: a fixed T means something else on every machine (on one whose decode step alone takes 100
ms, 150 ms admits almost nothing). Streaming clients see the decode-only step as their ITL p50 as long as
fewer than half of their steps carry a prompt chunk; bounding a chunk step at ITL_RATIO decode steps keeps
their p99 within 3x that p50, with room for the cost model's error.

Why only long prompts: in a fluid view the decodes pay the same total delay whatever the chunk size (the
same prompt tokens are computed beside them either way); chunking only spreads it, trading a few very long
steps for more steps of a bounded length, at the prompt's TTFT (its work stretches over more steps, each
paying the step's fixed cost). A prompt that fits one step makes one long step however it is cut, so
cutting it buys nothing; one several steps long would make several in a row, which the guard spreads.

Why the wait: under steady arrivals a chunk capped at a multiple of the decode step can fall to the rate
at which prompt tokens arrive (the more requests decode, the more prompts arrive per step): the queue then
grows until requests wait long and stream fast (with a client at a concurrency limit, the queue takes the
place of requests decoding). Measuring the wait against the prompt's own time keeps the guard for a long
prompt (its own time is long) and lifts it soon for a queue. And once most steps carry a chunk, the
clients' ITL p50 is the chunk step anyway (a flat tail of slow steps): the guard then buys nothing and
still costs TTFT, so a steady stream of long prompts runs as under the fixed budget.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.config.scheduler import AUTO
from kvserve.request import Request
from kvserve.scheduler.step_cost import StepCost, StepFeatures

# NOTE: 2.2 decode steps: tests/unit/test_step_cost_replay.py's interference replay keeps short ITL
# p99/p50 under 3 with it on each of its simulated machines, the cost model's error included.
ITL_RATIO = 2.2
# A prompt that waited this many times its own predicted time starts to lift the tail guard. NOTE: 3: a long
# prompt chunked under the guard waits a little over twice its own time by design (the chunks' steps pay
# the decodes' share); less lifted the guard for interference's prompts in the replay and broke its tail.
SLOWDOWN_TOLERATED = 3.0
# NOTE: the guard's duty is averaged over about this many steps: longer than a transient (interference's two
# 2,000-token prompts keep it on for tens of steps), short enough to notice a steady stream within a few
# hundred steps.
DUTY_STEPS = 256
# The guard is lifted while at least this fraction of recent decoding steps had a long prompt pending, and
# comes back below the second (the gap keeps it from flapping).
DUTY_LIFT, DUTY_RESTORE = 0.5, 0.25


@dataclass
class GuardDuty:
    """How often the decoding steps lately had a long prompt waiting for its first token (auto's third
    rule: once that is most of them, the guard is lifted). One per scheduler; observe() once per step."""

    fraction: float = 0.0
    lifted: bool = False

    def observe(self, long_prompt_pending: bool) -> None:
        self.fraction += (float(long_prompt_pending) - self.fraction) / DUTY_STEPS
        if self.fraction >= DUTY_LIFT:
            self.lifted = True
        elif self.fraction <= DUTY_RESTORE:
            self.lifted = False


def prompt_slowdown(cost: StepCost, prompts: Iterable[Request], now: float) -> float:
    """The largest (time waited / time a step computing the prompt alone is predicted to take) among prompts
    that have no first token yet; 0 if none."""
    worst = 0.0
    for r in prompts:
        if r.metrics.first_token_time is not None:
            continue  # preempted after streaming: its TTFT is behind it
        alone = cost.predict(StepFeatures.of_request(0, r.num_prompt_tokens))
        if alone > 0:
            worst = max(worst, max(0.0, now - r.metrics.arrival_time) / alone)
    return worst


def step_limit_s(target_itl_ms: float | str, decode_s: float, slowdown: float = 0.0) -> float:
    """Seconds a step carrying decodes predicted at decode_s may take; slowdown: prompt_slowdown (auto only)."""
    if target_itl_ms == AUTO:
        return decode_s * ITL_RATIO * max(1.0, slowdown / SLOWDOWN_TOLERATED)
    return max(float(target_itl_ms) / 1000, 2.0 * decode_s)
