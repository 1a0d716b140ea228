"""How long a step will take: a linear cost model over what the step carries, fitted online to measured steps.

A step's time is about c0 + c1 tokens + c2 sequences + c3 context + c4 pairs (seconds), where `context` is
the K/V positions attention reads (each scheduled request's computed tokens plus its new ones: what decode
attention streams) and `pairs` the query-key pairs it scores (a prompt chunk of n tokens after c cached
ones scores n (c + n) of them; attention FLOPs grow with it). The linears' cost is in `tokens`, per-request
bookkeeping and sampling in `sequences`.

The fit is exponentially weighted least squares of relative error with a ridge pull towards a prior (a rough figure for a
small model on a 2-core CPU), held at a fixed strength rather than decayed: directions the recent steps do
not excite (say, no prompt chunk for a while) stay at the prior or at what was last learnt, instead of
drifting as recursive least squares with forgetting does (covariance wind-up). Five features: one 5x5
solve per step, a few microseconds.
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


# Units the coefficients are fitted in, so that each is O(1) and one ridge strength suits all of them.
_SCALE = np.array([1.0, 256.0, 16.0, 16384.0, 262144.0])
# Prior in seconds per unit above: SmolLM2-135M fp32 on 2 cores (`kvserve bench steps`): ~5 ms a step,
# ~1.2 ms a token through the linears, ~0.3 ms a sequence, ~3 us a context token (46 KB of K/V at
# ~17 GB/s), ~1.5 us a query-key pair (69 kFLOP). A larger model or a faster machine corrects it within a few steps.
_PRIOR = np.array([0.005, 0.30, 0.005, 0.05, 0.4])


def _vector(f: StepFeatures) -> np.ndarray:
    return np.array([1.0, f.num_tokens, f.num_seqs, f.num_context_tokens, f.num_pairs]) / _SCALE


class OnlineStepCost:
    """StepCost fitted to the steps the engine runs (see the module docstring)."""

    def __init__(self, decay: float = 0.98, prior_strength: float = 0.05, prior: np.ndarray | None = None):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.prior = np.array(_PRIOR if prior is None else prior, dtype=np.float64)
        self._ridge = prior_strength * np.eye(len(self.prior))
        self._xx = np.zeros((len(self.prior), len(self.prior)))
        self._xy = np.zeros(len(self.prior))
        self._coef = self.prior.copy()
        self.num_observed = 0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if features.num_tokens <= 0 or not seconds > 0.0:
            return
        x = _vector(features)
        # NOTE: weighted by 1 / seconds^2, i.e. a fit of relative error: step-time noise is proportional to the
        # step (a 1 s prompt step jitters by more than a whole 30 ms decode step takes), and plain least squares
        # would spend the fit on the big steps, leaving decode steps -- the ones the latency target is
        # about -- off by a large fraction.
        w = 1.0 / (seconds * seconds)
        self._xx = self.decay * self._xx + w * np.outer(x, x)
        self._xy = self.decay * self._xy + w * x * seconds
        coef = np.linalg.solve(self._xx + self._ridge, self._xy + self._ridge @ self.prior)
        # NOTE: nothing a step carries makes it faster; a negative coefficient (noise, collinear features such
        # as tokens == sequences in decode-only steps) would let a prediction fall as a chunk grows.
        self._coef = np.maximum(coef, 0.0)
        self.num_observed += 1

    @property
    def coefficients(self) -> np.ndarray:
        """Seconds per unit of (step, token, sequence, context token, pair), in natural units."""
        return self._coef / _SCALE

    def predict(self, features: StepFeatures) -> float:
        return float(_vector(features) @ self._coef)


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
    and the chunks before it."""

    def __init__(self, cost: StepCost, target_s: float, decodes: StepFeatures):
        self.cost = cost
        self.target_s = max(target_s, 2.0 * cost.predict(decodes))
        self.carried = decodes

    def cap(self, num_computed: int, num_new: int) -> int:
        """The chunk a prompt num_computed tokens in gets this step (at most num_new), now counted in."""
        n = max(largest_chunk(self.cost, self.carried, num_computed, num_new, self.target_s),
                min(num_new, MIN_PROMPT_CHUNK))
        self.carried = self.carried + StepFeatures.of_request(num_computed, n)
        return n


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
