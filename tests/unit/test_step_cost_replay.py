"""The online cost model and the latency budget on replayed `interference` traffic (16 short requests
decoding, then two 2,000-token prompts arrive), with step times drawn from a known ground truth shaped
like SmolLM2-135M on this 2-core CPU: the weights are read once a step, so the linears cost
max(32 ms, 0.85 ms a token) -- a 16-decode step ~57 ms, a 64-decode step ~93 ms, a 512-token prompt ~470 ms.
Checked: the fitted model predicts chunks beside the decodes within 25%, the chunks are what the ground
truth allows under the target (or under twice the decode step where that is longer), and the long prompts
keep moving. Then the default policy (--target-itl-ms auto) on simulated time against a fast machine, a 3x
slower one and an AVX2-like one: interference's tail, `mixed`'s TTFT and throughput, and TTFT at a
concurrency limit (vLLM's `bench serve`), each against the fixed budget and the former 150 ms default.
Deterministic (seeded noise), and no model: the scheduler is driven by hand."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvserve.scheduler.step_cost import OnlineStepCost, StepFeatures, largest_chunk
from kvserve.core_types import ModelRunnerOutput
from tests.helpers.scheduler import latency_scheduler, make_request


class _Truth:
    def __init__(self, slowdown: float = 1.0, attention: float = 1.0):
        """slowdown: a machine that many times slower; attention: its attention that much slower again (an AVX2
        machine's share of attention in a step is larger)."""
        self.slowdown, self.attention = slowdown, attention

    def predict(self, f: StepFeatures) -> float:
        linears = max(0.032, 0.00085 * f.num_tokens)
        return self.slowdown * (0.018 + linears + 0.0003 * f.num_seqs
                                + self.attention * (2e-7 * f.num_context_tokens + 3e-7 * f.num_pairs))


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


def _simulate(sched, truth: _Truth, arrivals: list[tuple[float, str, int, int]], seed: int = 0,
              refill: tuple[int, int, int] = (0, 0, 0)):
    """Runs the scheduler on simulated time (each step takes the ground truth's seconds, 5% noise measured);
    arrivals: (time, id, prompt tokens, max tokens); refill (total, prompt tokens, max tokens): a closed loop,
    a new request whenever one finishes until `total` were sent (vLLM's `bench serve` at a concurrency).
    time.monotonic is the simulated clock meanwhile (requests' arrival times, the auto policy's waits).
    Returns the total seconds and id -> (arrival time, the times of the steps that gave it a token)."""
    rng = np.random.default_rng(seed)
    pending, clock, stamps = sorted(arrivals), [0.0], {}
    real_monotonic, time.monotonic = time.monotonic, lambda: clock[0]
    try:
        while pending or sched.num_unfinished:
            while pending and pending[0][0] <= clock[0]:
                _, rid, n, m = pending.pop(0)
                sched.add_request(make_request(rid, n, m))
                stamps[rid] = (clock[0], [])
            if not sched.num_unfinished:
                clock[0] = pending[0][0]
                continue
            out = sched.schedule()
            carried = sum((StepFeatures.of_request(sched.requests[r].num_computed_tokens, n)
                           for r, n in out.num_scheduled_tokens.items()), StepFeatures())
            seconds = truth.predict(carried)
            clock[0] += seconds
            done = [sched.requests[r] for r, n in out.num_scheduled_tokens.items()
                    if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_prompt_tokens]
            for r in done:
                stamps[r.request_id][1].append(clock[0])
            done = [r for r in done if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens]
            sched.update(out, ModelRunnerOutput(req_ids=[r.request_id for r in done], sampled_token_ids=[[5]] * len(done),
                                                execute_s=seconds * float(rng.lognormal(0.0, 0.05))))
            sched.check_invariants()
            for r in done:
                sent = len(stamps) + len(pending)
                if r.request_id not in sched.requests and sent < refill[0]:
                    pending.append((clock[0], f"c{sent}", refill[1], refill[2]))
    finally:
        time.monotonic = real_monotonic
    assert not sched.num_unfinished and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    return clock[0], stamps


def test_simulated_interference_meets_the_issue_target_without_starving_long_prompts():
    """bench itl's interference flow on simulated time: 16 short requests, two 2,000-token prompts at 2 s.
    With the ground truth above, 150 ms gives short ITL p99/p50 2.6x (fixed budget: 12x; before the fix
    3.5x) and the long prompts' TTFT 1.14x the fixed budget's."""
    arrivals = [(0.0, f"s{i}", 32, 256) for i in range(16)] + [(2.0, f"long{j}", 2000, 16) for j in range(2)]
    result = {}
    for target in (150, 0):
        _, stamps = _simulate(latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096), _Truth(), arrivals)
        itl = [b - a for rid, (_, ts) in stamps.items() if rid[0] == "s" for a, b in zip(ts, ts[1:])]
        ttft = np.median([stamps[f"long{j}"][1][0] - 2.0 for j in range(2)])
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


# A fast machine, one 3x slower, and one 2x slower whose attention is 3x slower again (AVX2-like).
_MACHINES = {"fast": _Truth(), "slow": _Truth(3.0), "avx2": _Truth(2.0, attention=3.0)}


def _interference(target, truth: _Truth) -> tuple[float, float, float]:
    """Short requests' ITL p50 and p99, the long prompts' TTFT p50 (s) on bench itl's interference flow."""
    arrivals = [(0.0, f"s{i}", 32, 256) for i in range(16)] + [(2.0, f"long{j}", 2000, 16) for j in range(2)]
    _, stamps = _simulate(latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096), truth, arrivals)
    itl = [b - a for rid, (_, ts) in stamps.items() if rid[0] == "s" for a, b in zip(ts, ts[1:])]
    ttft = np.median([ts[0] - at for rid, (at, ts) in stamps.items() if rid[0] == "l"])
    return float(np.median(itl)), float(np.percentile(itl, 99)), float(ttft)


@pytest.mark.parametrize("machine", list(_MACHINES))
def test_auto_keeps_interference_tail_within_3x_a_decode_step_on_every_machine(machine):
    """The issue's target: short ITL p99 <= 3x p50, and p50 the decode step (no flat tail of slow steps).
    The long prompts' TTFT stays within 1.3x the fixed budget's. (Measured: p99/p50 2.3-2.6x.)"""
    auto, fixed = _interference("auto", _MACHINES[machine]), _interference(0, _MACHINES[machine])
    assert auto[1] <= 3.0 * auto[0], (auto, fixed)
    assert auto[0] <= 1.05 * fixed[0], (auto, fixed)
    assert fixed[1] > 6 * fixed[0]
    assert auto[2] <= 1.3 * fixed[2], (auto, fixed)


def _mixed_arrivals() -> list[tuple[float, str, int, int]]:
    """`mixed`'s shapes (64 requests, prompts 32-512 tokens, all at once), seeded."""
    rng = np.random.default_rng(3)
    return [(0.0, f"m{i}", int(rng.integers(32, 513)), int(rng.integers(16, 257))) for i in range(64)]


def _ttft_p50(stamps) -> float:
    return float(np.median([ts[0] - at for at, ts in stamps.values()]))


def test_auto_gives_mixed_the_fixed_budgets_ttft_and_throughput():
    """The issue: `mixed` TTFT p50 49.9 s against the best peer's 19.5 on an AVX2 machine, the 150-ms budget
    admitting few prompt tokens per step. On the slow machine, auto: TTFT p50 and total time within 3% of
    the fixed budget's (measured: equal); 150 ms: TTFT p50 ~1.5x."""
    runs = {t: _simulate(latency_scheduler(t, cost=OnlineStepCost(), num_blocks=4096), _MACHINES["slow"],
                         _mixed_arrivals()) for t in ("auto", 0, 150)}
    (auto_s, auto), (fixed_s, fixed), (_, old) = runs["auto"], runs[0], runs[150]
    assert _ttft_p50(auto) <= 1.03 * _ttft_p50(fixed), (_ttft_p50(auto), _ttft_p50(fixed), _ttft_p50(old))
    assert auto_s <= 1.03 * fixed_s
    assert _ttft_p50(old) > 1.3 * _ttft_p50(fixed)


def test_auto_keeps_ttft_low_at_a_concurrency_limit():
    """vLLM's `bench serve` shape (96 prompts of 384 tokens, 128 out, concurrency 32) on the slow machine: in a closed loop, prompts held back wait in the queue and the
    rest stream fast (the issue: TTFT 13x vLLM's, TPOT 6x faster). auto: TTFT p50 within 1.2x the fixed
    budget's; 150 ms: over 3x."""
    ttft = {}
    for target in ("auto", 0, 150):
        sched = latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096)
        first = [(0.0, f"c{i}", 384, 128) for i in range(32)]
        ttft[target] = _ttft_p50(_simulate(sched, _MACHINES["slow"], first, refill=(96, 384, 128))[1])
    assert ttft["auto"] <= 1.2 * ttft[0], ttft
    assert ttft[150] > 3 * ttft[0], ttft


def test_auto_lifts_the_guard_for_a_steady_stream_of_long_prompts():
    """Long prompts (1,500 tokens, 64 out) at concurrency 16 on the fast machine: one is almost always waiting,
    so chunking them only trades TTFT for ITL (in a closed loop TTFT + 64 ITL is fixed by the throughput).
    auto's duty rule lifts the guard: TTFT p50 within 1.2x the fixed budget's (150 ms: ~9x)."""
    ttft = {}
    for target in ("auto", 0):
        sched = latency_scheduler(target, cost=OnlineStepCost(), num_blocks=4096)
        first = [(0.0, f"c{i}", 1500, 64) for i in range(16)]
        ttft[target] = _ttft_p50(_simulate(sched, _MACHINES["fast"], first, refill=(48, 1500, 64))[1])
    assert ttft["auto"] <= 1.2 * ttft[0], ttft
