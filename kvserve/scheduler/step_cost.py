"""How long a step will take: a linear cost model over what the step carries, fitted online to measured steps.

A step's time is about c0 + c1 tokens + c2 sequences + c3 context + c4 pairs (seconds), where `context` is
the K/V positions attention reads (each scheduled request's computed tokens plus its new ones: what decode
attention streams) and `pairs` the query-key pairs it scores (a prompt chunk of n tokens after c cached
ones scores n (c + n) of them; attention FLOPs grow with it). The linears' cost is in `tokens`, per-request
bookkeeping and sampling in `sequences`.

The fit is exponentially weighted least squares of relative error with a pull towards a prior (a rough
figure for a small model on a 2-core CPU), held at a fixed strength rather than decayed: directions
the recent steps do not excite (say, no prompt chunk for a while) stay at the prior or at what was last
learnt, instead of drifting as recursive least squares with forgetting does (covariance wind-up).

Two things keep it sane on real traffic, where most steps are decode-only and so tokens == sequences and
the number of sequences barely changes (the intercept, tokens and sequences are then one direction):
- The prior is a few pseudo-steps of typical shapes (decodes of 1, 16, 64 sequences, a 512-token prompt, a
  chunk beside decodes, a chunk after a long context) timed by the prior, `prior_strength` steps' worth,
  in the same relative error as the data: it holds the directions decode-only traffic leaves unexcited.
  The former absolute ridge weighed ~1e-4 of one step, so those directions were left to noise.
- The coefficients are a non-negative least squares solution (an active set: solve, pin the negative ones
  at 0, solve again), not a clamp of the free solution: clamping one coefficient of a collinear pair
  without refitting the others over-predicted decode steps 3.6x in a replay (tests/unit/test_step_cost_replay.py),
  which the 2x-decode rule then turned into 400 ms steps.
A model whose linears switch kernels at some step size gets a sixth feature, min(tokens, knee_rows): the
quantized kernels (layers/quant/kernels.py) read the weight once per 8 rows up to kernels.small_rows() and
run L2-sized panels or tiles beyond, so a row costs ~1.3 ms up to 24 and ~0.8 ms after (SmolLM2 int8 decode steps,
scripts/decode_step_times.py). One line through both bends towards the per-pair coefficient instead, which
then over-predicted long prompt chunks (int8's fit: 1.0 us/pair against fp32's 0.58), shrinking them.
Five or six features: a few small solves per step, some microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step (or one request's part of it) carries."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_context_tokens: int = 0
    """K/V positions attention reads, summed over the step's requests."""
    num_pairs: int = 0
    """Query-key pairs attention scores, summed over the step's requests."""

    @staticmethod
    def of_request(num_computed: int, num_new: int) -> "StepFeatures":
        """One request computing num_new tokens after num_computed ones already in the cache."""
        if num_new <= 0:
            return StepFeatures()
        context = num_computed + num_new
        return StepFeatures(num_new, 1, context, num_new * context)

    def __add__(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs,
                            self.num_context_tokens + other.num_context_tokens, self.num_pairs + other.num_pairs)


class StepCost(Protocol):
    """The scheduler's view of step time: predict before scheduling, observe after running."""

    def predict(self, features: StepFeatures) -> float:
        """Seconds a step carrying `features` should take."""
        ...

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """A step carrying `features` took `seconds` (the worker's measured step time)."""
        ...


# Units the coefficients are fitted in, so that each is O(1) and the solves are well conditioned.
_SCALE = np.array([1.0, 256.0, 16.0, 16384.0, 262144.0, 16.0])
# Prior in seconds per unit above: SmolLM2-135M fp32 on 2 cores (docs/features/latency-budget.md: a 16-decode step ~55 ms, a
# 32-64-decode step of `mixed` ~165 ms, a 512-token prompt step ~450 ms): ~35 ms a step (the weights are
# read once a step), ~0.6 ms a token through the linears, ~0.1 ms a sequence, ~2.5 us a context token
# (46 KB of K/V at ~17 GB/s), ~0.4 us a query-key pair. A larger model or a faster machine corrects it
# within a few steps.
# The knee's prior (the sixth: per row below the knee) is small: a model without one fits it away.
_PRIOR = np.array([0.035, 0.6e-3, 0.1e-3, 2.5e-6, 0.4e-6, 0.05e-3]) * _SCALE


def _vector(f: StepFeatures, knee_rows: int) -> np.ndarray:
    x = [1.0, f.num_tokens, f.num_seqs, f.num_context_tokens, f.num_pairs]
    if knee_rows:
        x.append(min(f.num_tokens, knee_rows))
    return np.array(x) / _SCALE[: len(x)]


def _decodes(n: int, context: int) -> StepFeatures:
    return StepFeatures(n, n, n * context, n * context)


# Shapes the prior is anchored at (they span all five directions: decode-only steps alone do not).
_PSEUDO_STEPS = (_decodes(1, 100), _decodes(16, 300), _decodes(64, 500), StepFeatures.of_request(0, 512),
                 _decodes(16, 300) + StepFeatures.of_request(1500, 128), StepFeatures.of_request(1900, 64))


class OnlineStepCost:
    """StepCost fitted to the steps the engine runs (see the module docstring)."""

    def __init__(self, decay: float = 0.98, prior_strength: float = 0.5, prior: np.ndarray | None = None,
                 knee_rows: int = 0):
        """knee_rows: step tokens up to which a token costs more (the module docstring); 0: no knee."""
        if knee_rows < 0:
            raise ValueError(f"knee_rows must be >= 0, got {knee_rows}")
        self.knee_rows = knee_rows
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        n = 6 if knee_rows else 5
        self.prior = np.array(_PRIOR[:n] if prior is None else prior, dtype=np.float64)
        if self.prior.shape != (n,):
            raise ValueError(f"prior must have {n} coefficients, got {self.prior.shape}")
        if (self.prior <= 0).any():
            raise ValueError(f"prior coefficients must be > 0, got {self.prior}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        # NOTE: the prior enters as a few pseudo-steps of typical shapes timed by the prior, prior_strength
        # steps' worth in all (never decayed): a pull measured in the same relative error as the data, and
        # spread over directions the way real steps weigh them, so a coefficient that matters little to
        # any step (per sequence) is not held at its prior any harder than one that matters a lot.
        pseudo = np.array([_vector(f, knee_rows) for f in _PSEUDO_STEPS])
        w = prior_strength / len(pseudo) / (pseudo @ self.prior) ** 2
        self._ridge = (pseudo * w[:, None]).T @ pseudo
        self._xx = np.zeros((len(self.prior), len(self.prior)))
        self._xy = np.zeros(len(self.prior))
        self._coef = self.prior.copy()
        self.num_observed = 0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if features.num_tokens <= 0 or not seconds > 0.0:
            return
        x = _vector(features, self.knee_rows)
        # NOTE: weighted by 1 / (step time)^2, i.e. a fit of relative error: step-time noise is proportional to the
        # step (a 1 s prompt step jitters by more than a whole 30 ms decode step takes), and plain least squares
        # would spend the fit on the big steps, leaving decode steps -- the ones the latency target is
        # about -- off by a large fraction. The scale is the larger of the predicted and the measured time:
        # the measurement alone favours the steps that happened to run fast, biasing every prediction low
        # (~13% with 30% jitter, as on a contended machine: steps beside decodes then overshot the target);
        # the prediction alone gives a step that another process stalled 3x its full weight (chunks then
        # came out ~0.6x what the machine allows in the replay).
        scale = max(float(x @ self._coef), seconds)
        w = 1.0 / (scale * scale)
        self._xx = self.decay * self._xx + w * np.outer(x, x)
        self._xy = self.decay * self._xy + w * x * seconds
        self._coef = _nonnegative_solve(self._xx + self._ridge, self._xy + self._ridge @ self.prior)
        self.num_observed += 1

    @property
    def coefficients(self) -> np.ndarray:
        """Seconds per unit of (step, token, sequence, context token, pair[, token below the knee]), in natural
        units."""
        return self._coef / _SCALE[: len(self._coef)]

    def predict(self, features: StepFeatures) -> float:
        return float(_vector(features, self.knee_rows) @ self._coef)

    def describe(self) -> str:
        """The fitted coefficients in readable units (bench itl prints them)."""
        c = self.coefficients
        knee = f" + {c[5] * 1e3:.3f} ms/token up to {self.knee_rows}" if self.knee_rows else ""
        return (f"{c[0] * 1e3:.1f} ms/step + {c[1] * 1e3:.3f} ms/token + {c[2] * 1e3:.3f} ms/seq + "
                f"{c[3] * 1e6:.2f} us/context token + {c[4] * 1e6:.3f} us/pair{knee} ({self.num_observed} steps)")


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin over c >= 0 of c'Ac - 2b'c (A positive definite): solve, pin the negative coefficients at 0 and
    solve for the rest, until none is negative (pins only grow: not exact NNLS, enough for 5 features with a
    prior). Nothing a step carries makes it faster, and a prediction must not fall as a chunk grows
    (largest_chunk's binary search relies on it)."""
    free = np.ones(len(b), dtype=bool)
    coef = np.zeros(len(b))
    for _ in range(len(b)):
        coef[:] = 0.0
        coef[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (coef >= 0).all():
            break
        free &= coef > 0
        if not free.any():
            coef[:] = 0.0
            break
    return np.maximum(coef, 0.0)


@dataclass(frozen=True, slots=True)
class LinearStepCost:
    """A fixed cost model (tests, experiments): seconds = base + per_token n + per_seq s + per_context c
    + per_pair p. It learns nothing."""

    base: float = 0.0
    per_token: float = 0.0
    per_seq: float = 0.0
    per_context: float = 0.0
    per_pair: float = 0.0

    def predict(self, f: StepFeatures) -> float:
        return (self.base + self.per_token * f.num_tokens + self.per_seq * f.num_seqs
                + self.per_context * f.num_context_tokens + self.per_pair * f.num_pairs)

    def observe(self, features: StepFeatures, seconds: float) -> None:
        pass


# NOTE: a prompt chunk beside decodes never shrinks below this: with decodes alone over the target, prompts
# must still move (a 16-token chunk costs a 135M model ~20 ms on 2 cores).
MIN_PROMPT_CHUNK = 16


class LatencyBudget:
    """One step's latency budget: sizes the prompt chunks of a step that carries decodes.

    The step may take target_s, or twice what its decodes alone are predicted to take where that is longer
    (a model whose decode step alone exceeds the target would otherwise see its prompts crawl at
    MIN_PROMPT_CHUNK tokens a step). Chunks are taken in scheduling order, each predicted beside the decodes
    and the chunks before it. Only the step's first prompt chunk is granted the MIN_PROMPT_CHUNK floor: one
    prompt moving is enough to guarantee progress, and a floor for every waiting prompt pushed a replayed
    step with 4 of them 30% over the target; a later prompt that does not fit gets 0 (it waits)."""

    def __init__(self, cost: StepCost, target_s: float, decodes: StepFeatures):
        self.cost = cost
        self.target_s = max(target_s, 2.0 * cost.predict(decodes))
        self.carried = decodes
        self._floor_used = False

    def cap(self, num_computed: int, num_new: int) -> int:
        """The chunk a prompt num_computed tokens in gets this step (at most num_new; 0: none this step), now
        counted in."""
        n = largest_chunk(self.cost, self.carried, num_computed, num_new, self.target_s)
        if not self._floor_used:
            n = max(n, min(num_new, MIN_PROMPT_CHUNK))
            self._floor_used = True
        self.count(num_computed, n)
        return n

    def count(self, num_computed: int, n: int) -> None:
        """A chunk of n tokens granted outside the budget (it still weighs on the chunks sized after it)."""
        if n:
            self.carried = self.carried + StepFeatures.of_request(num_computed, n)
            self._floor_used = True


def largest_chunk(cost: StepCost, base: StepFeatures, num_computed: int, limit: int, target_s: float) -> int:
    """Most prompt tokens (at most `limit`) one request, num_computed tokens in, may add to a step already
    carrying `base` with the step predicted to stay within target_s; 0 if not even one fits. Predictions
    grow with the chunk (coefficients >= 0), so a binary search finds it in ~log2(limit) predictions."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost.predict(base + StepFeatures.of_request(num_computed, mid)) <= target_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
