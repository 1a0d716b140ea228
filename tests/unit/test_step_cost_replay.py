"""The online cost model and the latency budget on replayed `interference` traffic (16 short requests
decoding, then two 2,000-token prompts arrive), with step times drawn from a known ground truth shaped
like SmolLM2-135M on this 2-core CPU: the weights are read once a step, so the linears cost
max(32 ms, 0.85 ms a token) -- a 16-decode step ~57 ms, a 64-decode step ~93 ms, a 512-token prompt ~470 ms.
Checked: the fitted model predicts chunks beside the decodes within 25%, the chunks are what the ground
truth allows under the target (or under twice the decode step where that is longer), and the long prompts
keep moving. Deterministic (seeded noise), and no model: the scheduler is driven by hand."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.scheduler.step_cost import OnlineStepCost, StepFeatures, largest_chunk
from kvserve.core_types import ModelRunnerOutput
from tests.helpers.scheduler import latency_scheduler, make_request


class _Truth:
    def __init__(self, slowdown: float = 1.0):
        self.slowdown = slowdown

    def predict(self, f: StepFeatures) -> float:
        linears = max(0.032, 0.00085 * f.num_tokens)
        return self.slowdown * (0.018 + linears + 0.0003 * f.num_seqs + 2e-7 * f.num_context_tokens
                                + 3e-7 * f.num_pairs)


def _replay(truth: _Truth, target_ms: float, noise: float, spikes: float, seed: int = 0):
    """Returns the cost model and, per step: (decodes' features, first long prompt's chunk and its computed
    tokens, all long prompts' tokens, the step's true seconds)."""
    cost = OnlineStepCost()
    sched = latency_scheduler(target_ms, cost=cost, budget=512, num_blocks=4096)
    rng = np.random.default_rng(seed)
    for i in range(16):
        sched.add_request(make_request(f"s{i}", 32, 256))
    steps = []
    for k in range(400):
        if k == 30:  # interference: the long prompts arrive while the short ones decode
            for j in range(2):
                sched.add_request(make_request(f"long{j}", 2000, 16))
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        decodes, carried, first, long_tokens = StepFeatures(), StepFeatures(), None, 0
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            f = StepFeatures.of_request(req.num_computed_tokens, n)
            carried = carried + f
            if n == 1:
                decodes = decodes + f
            elif rid.startswith("long"):
                long_tokens += n
                first = first or (n, req.num_computed_tokens, req.num_prompt_tokens - req.num_computed_tokens)
        jitter = float(rng.lognormal(0.0, noise))
        seconds = truth.predict(carried) * jitter * (3.0 if rng.random() < spikes else 1.0)
        steps.append((decodes, first, long_tokens, truth.predict(carried)))
        done = [sched.requests[r] for r, n in out.num_scheduled_tokens.items()
                if sched.requests[r].num_computed_tokens + n == sched.requests[r].num_tokens]
        sched.update(out, ModelRunnerOutput(req_ids=[r.request_id for r in done], sampled_token_ids=[[5]] * len(done),
                                            execute_s=seconds))
        sched.check_invariants()
    assert not sched.num_unfinished
    return cost, steps


@pytest.mark.parametrize("noise,spikes", [(0.05, 0.0), (0.3, 0.1)])  # quiet; contended: 10% of steps 3x
def test_fit_predicts_chunks_beside_decodes_within_25_percent(noise, spikes):
    truth = _Truth()
    cost, _ = _replay(truth, 150, noise, spikes)
    decodes = sum((StepFeatures.of_request(150, 1) for _ in range(16)), StepFeatures())
    for computed, chunk in [(0, 64), (0, 128), (0, 256), (1500, 128)]:
        f = decodes + StepFeatures.of_request(computed, chunk)
        assert cost.predict(f) == pytest.approx(truth.predict(f), rel=0.25), (computed, chunk, cost.describe())
    assert cost.predict(decodes) == pytest.approx(truth.predict(decodes), rel=0.25)


@pytest.mark.parametrize("slowdown,noise,spikes", [(1.0, 0.05, 0.0), (1.0, 0.3, 0.1), (3.0, 0.05, 0.0)])
def test_chunks_are_what_the_ground_truth_allows_and_prompts_keep_moving(slowdown, noise, spikes):
    """slowdown 3: a loaded machine, where 16 decodes alone (~170 ms) exceed the 150 ms target and the step
    may take twice the decodes' time."""
    truth = _Truth(slowdown)
    _, steps = _replay(truth, 150, noise, spikes)
    ratios, over = [], []
    for decodes, first, long_tokens, seconds in steps:
        if first is None or not decodes.num_seqs:
            continue
        chunk, computed, left = first
        limit = max(0.150, 2 * truth.predict(decodes))
        ideal = largest_chunk(truth, decodes, computed, min(left, 512), limit)
        if ideal >= 32 and chunk < left:  # not the prompt's last (short) chunk
            ratios.append(chunk / ideal)
        over.append(seconds / limit)
    assert len(ratios) > 10
    # NOTE: 0.75: the fit's error on a chunk step is within 25% (above); the chunk never falls to the
    # 16-token floor as it did when decode-only steps were charged to the token coefficient.
    assert 0.75 < np.median(ratios) < 1.25, np.round(ratios, 2)
    assert min(ratios) > 0.5, np.round(ratios, 2)
    assert np.percentile(over, 90) < 1.3, np.round(over, 2)  # about the fit's 25% (+ the 30% jitter)
    # progress: the long prompts' 4,000 tokens in about as many steps as the ideal chunks would take
    prompt_steps = sum(1 for _, first, _, _ in steps if first is not None)
    ideal_rate = np.median([largest_chunk(truth, d, f[1], 512, max(0.150, 2 * truth.predict(d)))
                            for d, f, _, _ in steps if f is not None and d.num_seqs])
    assert prompt_steps < 1.5 * 4000 / ideal_rate + 5, (prompt_steps, ideal_rate)


def _simulate(sched, truth: _Truth, arrivals: list[tuple[float, str, int, int]], seed: int = 0):
    """Runs the scheduler on simulated time (each step takes the ground truth's seconds, 5% noise measured);
    arrivals: (time, id, prompt tokens, max tokens). Returns the total seconds and id -> the times of the
    steps that gave it a token."""
    rng = np.random.default_rng(seed)
    pending, now, stamps = sorted(arrivals), 0.0, {a[1]: [] for a in arrivals}
    while pending or sched.num_unfinished:
        while pending and pending[0][0] <= now:
            _, rid, n, m = pending.pop(0)
            sched.add_request(make_request(rid, n, m))
        if not sched.num_unfinished:
            now = pending[0][0]
            continue
        out = sched.schedule()
        carried = sum((StepFeatures.of_request(sched.requests[r].num_computed_tokens, n)
                       for r, n in out.num_scheduled_tokens.items()), StepFeatures())
        seconds = truth.predict(carried)
        now += seconds
        done = [sched.requests[r] for r, n in out.num_scheduled_tokens.items()
                if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_prompt_tokens]
        for r in done:
            stamps[r.request_id].append(now)
        done = [r for r in done if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens]
        sched.update(out, ModelRunnerOutput(req_ids=[r.request_id for r in done], sampled_token_ids=[[5]] * len(done),
                                            execute_s=seconds * float(rng.lognormal(0.0, 0.05))))
    return now, stamps


def test_simulated_interference_meets_the_issue_target_without_starving_long_prompts():
    """bench itl's interference flow on simulated time: 16 short requests, two 2,000-token prompts at 2 s.
    With the ground truth above, 150 ms gives short ITL p99/p50 2.6x (fixed budget: 12x; before the fix
    3.5x) and the long prompts' TTFT 1.14x the fixed budget's."""
    arrivals = [(0.0, f"s{i}", 32, 256) for i in range(16)] + [(2.0, f"long{j}", 2000, 16) for j in range(2)]
    result = {}
    for target in (150, 0):
        _, stamps = _simulate(latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096), _Truth(), arrivals)
        itl = [b - a for rid, ts in stamps.items() if rid[0] == "s" for a, b in zip(ts, ts[1:])]
        ttft = np.median([stamps[f"long{j}"][0] - 2.0 for j in range(2)])
        result[target] = (np.percentile(itl, 99) / np.median(itl), ttft)
    assert result[0][0] > 6 and result[150][0] <= 3.0, result
    assert result[150][1] < 1.5 * result[0][1], result


def test_simulated_mixed_throughput_close_to_the_fixed_budget():
    """All of `mixed`-like traffic queued at once (the shapes of the built-in `mixed` workload's first
    rows): with the ground truth above 150 ms takes 1.07x the fixed budget's time (more, smaller steps while
    few requests decode; before the fix 1.0x, its inflated decode predictions letting the 2x-decode rule
    size chunks near the whole budget). A guard: the contended bench run before the fix measured 1.37x."""
    rng = np.random.default_rng(3)
    arrivals = [(0.0, f"m{i}", int(rng.integers(40, 510)), int(rng.integers(20, 250))) for i in range(48)]
    seconds = {target: _simulate(latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096, budget=512),
                                 _Truth(), arrivals)[0] for target in (150, 0)}
    assert seconds[150] < 1.10 * seconds[0], seconds
