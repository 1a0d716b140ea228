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
from test_scheduler_latency import _request, _scheduler

from kvserve.scheduler.step_cost import OnlineStepCost, StepFeatures, largest_chunk
from kvserve.worker.runner_output import ModelRunnerOutput


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
    sched = _scheduler(target_ms, cost=cost, budget=512, num_blocks=4096)
    rng = np.random.default_rng(seed)
    for i in range(16):
        sched.add_request(_request(f"s{i}", 32, 256))
    steps = []
    for k in range(400):
        if k == 30:  # interference: the long prompts arrive while the short ones decode
            for j in range(2):
                sched.add_request(_request(f"long{j}", 2000, 16))
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
        seconds = truth.predict(carried) * float(rng.lognormal(0.0, noise)) * (3.0 if rng.random() < spikes else 1.0)
        steps.append((decodes, first, long_tokens, truth.predict(carried)))
        done = [sched.requests[r] for r, n in out.num_scheduled_tokens.items()
                if sched.requests[r].num_computed_tokens + n == sched.requests[r].num_tokens]
        sched.update(out, ModelRunnerOutput([r.request_id for r in done], [[5]] * len(done), execute_s=seconds))
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
    assert np.percentile(over, 90) < 1.25, np.round(over, 2)  # within the fit's 25%
    # progress: the long prompts' 4,000 tokens in about as many steps as the ideal chunks would take
    prompt_steps = sum(1 for _, first, _, _ in steps if first is not None)
    ideal_rate = np.median([largest_chunk(truth, d, f[1], 512, max(0.150, 2 * truth.predict(d)))
                            for d, f, _, _ in steps if f is not None and d.num_seqs])
    assert prompt_steps < 1.5 * 4000 / ideal_rate + 5, (prompt_steps, ideal_rate)
