"""The step cost model (scheduler/step_cost.py): the online fit recovers a known cost, adapts when the
machine changes, never predicts that carrying more is faster; the chunk search hits the target."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.scheduler.step_cost import (MIN_PROMPT_CHUNK, LatencyBudget, LinearStepCost, OnlineStepCost,
                                         StepFeatures, largest_chunk)

_TRUE = LinearStepCost(base=0.004, per_token=0.001, per_seq=0.0005, per_context=2e-6, per_pair=1e-6)


def _random_steps(rng: np.random.Generator, n: int) -> list[StepFeatures]:
    """Steps like the engine's: some decodes (each with its context), sometimes a prompt chunk."""
    steps = []
    for _ in range(n):
        f = StepFeatures()
        for _ in range(int(rng.integers(0, 32))):
            f = f + StepFeatures.of_request(int(rng.integers(10, 1500)), 1)
        if f.num_seqs == 0 or rng.random() < 0.5:
            f = f + StepFeatures.of_request(int(rng.integers(0, 2000)), int(rng.integers(2, 512)))
        steps.append(f)
    return steps


def test_features_of_a_request():
    assert StepFeatures.of_request(100, 1) == StepFeatures(1, 1, 101, 101)
    assert StepFeatures.of_request(0, 8) == StepFeatures(8, 1, 8, 64)
    assert StepFeatures.of_request(5, 0) == StepFeatures()
    assert StepFeatures(1, 1, 2, 3) + StepFeatures(4, 5, 6, 7) == StepFeatures(5, 6, 8, 10)


def test_prior_is_sane_before_any_step():
    cost = OnlineStepCost()
    decode16 = sum((StepFeatures.of_request(300, 1) for _ in range(16)), StepFeatures())
    prompt512 = StepFeatures.of_request(0, 512)
    assert 0.01 < cost.predict(decode16) < 0.2
    assert 0.2 < cost.predict(prompt512) < 3.0
    assert cost.predict(prompt512) > 5 * cost.predict(decode16)


def test_fit_recovers_a_known_cost():
    rng = np.random.default_rng(0)
    cost = OnlineStepCost()
    for f in _random_steps(rng, 300):
        cost.observe(f, _TRUE.predict(f))
    for f in _random_steps(rng, 50):
        assert cost.predict(f) == pytest.approx(_TRUE.predict(f), rel=0.03)
    assert cost.num_observed == 300


def test_fit_tolerates_noise_and_follows_a_slower_machine():
    rng = np.random.default_rng(1)
    cost = OnlineStepCost()
    for f in _random_steps(rng, 300):
        cost.observe(f, _TRUE.predict(f) * (1 + 0.05 * rng.standard_normal()))
    held_out = _random_steps(rng, 50)
    err = [abs(cost.predict(f) / _TRUE.predict(f) - 1) for f in held_out]
    assert np.median(err) < 0.08
    for f in _random_steps(rng, 300):  # the machine is now twice as slow (another process took a core)
        cost.observe(f, 2 * _TRUE.predict(f))
    ratio = [cost.predict(f) / _TRUE.predict(f) for f in held_out]
    assert np.median(ratio) == pytest.approx(2.0, rel=0.05)


def test_coefficients_never_negative_and_bad_observations_ignored():
    cost = OnlineStepCost()
    for n in range(1, 100):  # time falls as tokens grow: a fit would say tokens are free or better
        cost.observe(StepFeatures.of_request(0, n), 0.5 - 0.004 * n)
    assert (cost.coefficients >= 0).all()
    before = cost.coefficients.copy()
    cost.observe(StepFeatures(), 1.0)                      # an empty step
    cost.observe(StepFeatures.of_request(0, 4), 0.0)       # no time measured
    cost.observe(StepFeatures.of_request(0, 4), float("nan"))
    assert (cost.coefficients == before).all()
    small, big = StepFeatures.of_request(100, 10), StepFeatures.of_request(100, 200)
    assert cost.predict(big) >= cost.predict(small)
    with pytest.raises(ValueError, match="decay"):
        OnlineStepCost(decay=0.0)
    with pytest.raises(ValueError, match="prior_strength"):
        OnlineStepCost(prior_strength=0.0)


def test_decode_only_steps_leave_a_prompt_chunk_near_the_prior():
    """Decode-only steps of a constant batch cannot tell the per-step, per-token and per-sequence costs
    apart (tokens == sequences == 16 every step): the fit must match them without charging a prompt token
    for what is really a per-step cost (which shrank chunks to the floor) or the reverse."""
    cost, prior = OnlineStepCost(), OnlineStepCost()
    rng = np.random.default_rng(2)
    for step in range(300):
        decodes = sum((StepFeatures.of_request(100 + step, 1) for _ in range(16)), StepFeatures())
        cost.observe(decodes, (0.045 + 2e-6 * decodes.num_context_tokens) * (1 + 0.1 * rng.standard_normal()))
    decodes = sum((StepFeatures.of_request(400, 1) for _ in range(16)), StepFeatures())
    assert cost.predict(decodes) == pytest.approx(0.045 + 2e-6 * decodes.num_context_tokens, rel=0.1)
    chunk = decodes + StepFeatures.of_request(0, 128)
    extra, prior_extra = (c.predict(chunk) - c.predict(decodes) for c in (cost, prior))
    assert 0.5 < extra / prior_extra < 2.0, cost.describe()


def test_largest_chunk_is_the_largest_that_fits():
    cost = LinearStepCost(base=0.01, per_token=0.001, per_pair=1e-6)
    decodes = StepFeatures(16, 16, 16 * 300, 16 * 300)
    for computed, target in [(0, 0.05), (1000, 0.08), (0, 10.0), (0, 0.0)]:
        n = largest_chunk(cost, decodes, computed, 512, target)
        fits = cost.predict(decodes + StepFeatures.of_request(computed, n)) <= target
        assert (n == 0 and not fits or fits) and 0 <= n <= 512
        if n < 512:
            assert cost.predict(decodes + StepFeatures.of_request(computed, n + 1)) > target


def test_latency_budget_counts_earlier_chunks_floor_and_relative_target():
    cost = LinearStepCost(base=0.01, per_token=0.001)
    decodes = StepFeatures(10, 10, 1000, 1000)   # predicted 20 ms
    budget = LatencyBudget(cost, 0.050, decodes)
    assert budget.cap(0, 500) == 30               # 20 + 30 = 50 ms
    assert budget.cap(0, 500) == 0                # nothing left: this prompt waits a step
    assert budget.cap(0, 3) == 0
    assert budget.carried == decodes + StepFeatures.of_request(0, 30)
    full = LatencyBudget(cost, 0.020, decodes)    # decodes alone fill the target (and 2x rule: 40 ms)
    assert full.cap(0, 500) == 20
    floor = LatencyBudget(LinearStepCost(base=0.01, per_token=0.01), 0.001, StepFeatures(1, 1, 10, 10))
    assert floor.cap(0, 500) == MIN_PROMPT_CHUNK  # nothing fits: the step's first prompt still moves
    assert floor.cap(0, 500) == 0                 # only the first: one prompt moving is progress
    many = StepFeatures(30, 30, 3000, 3000)
    slow = LatencyBudget(LinearStepCost(per_token=0.002), 0.050, many)  # decodes alone 60 ms > target
    assert slow.target_s == pytest.approx(0.12)
    assert slow.cap(0, 500) == 30


class _KneeCost:
    """A quantized model's step: a token costs per_token + below_knee up to `knee` step tokens (the register
    kernel), per_token beyond (the panels), plus attention's per-pair cost."""

    def __init__(self, knee: int = 24):
        self.knee = knee

    def predict(self, f: StepFeatures) -> float:
        return 0.006 + 0.8e-3 * f.num_tokens + 0.5e-3 * min(f.num_tokens, self.knee) + 0.5e-6 * f.num_pairs


def test_a_knee_in_the_step_time_is_fitted_not_charged_to_long_chunks():
    """Decodes of 1-64 sequences and chunks beside them, on a step cost that bends at 24 tokens: with the knee
    feature the fit predicts a long chunk within 5%; one line through both bends over-predicts it, which shrank
    the chunks the latency budget grants (the reason for the feature)."""
    truth, rng = _KneeCost(), np.random.default_rng(3)
    fits = {knee: OnlineStepCost(knee_rows=knee) for knee in (0, 24)}
    for _ in range(400):
        f = sum((StepFeatures.of_request(int(rng.integers(50, 800)), 1) for _ in range(int(rng.integers(1, 65)))),
                StepFeatures())
        if rng.random() < 0.3:
            f = f + StepFeatures.of_request(int(rng.integers(0, 1500)), int(rng.integers(16, 400)))
        for cost in fits.values():
            cost.observe(f, truth.predict(f))
    chunk = StepFeatures.of_request(0, 512)
    with_knee, without = (fits[k].predict(chunk) / truth.predict(chunk) for k in (24, 0))
    assert with_knee == pytest.approx(1.0, abs=0.05), fits[24].describe()
    assert abs(without - 1.0) > 2 * abs(with_knee - 1.0), fits[0].describe()
    for n in (1, 8, 24, 32, 64):
        decodes = sum((StepFeatures.of_request(300, 1) for _ in range(n)), StepFeatures())
        assert fits[24].predict(decodes) == pytest.approx(truth.predict(decodes), rel=0.05)
    assert "up to 24" in fits[24].describe() and (fits[24].coefficients >= 0).all()
    with pytest.raises(ValueError, match="knee_rows"):
        OnlineStepCost(knee_rows=-1)
