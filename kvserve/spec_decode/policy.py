"""Self-limiting draft length: choose each request's number of draft tokens for its next step, 0 included,
to maximise expected tokens per second of the whole step.

Model. With per-token acceptance a, k drafts yield E(k) = 1 + a + ... + a^k tokens (the first rejection
stops the run; the target's own sample is always kept), so the j-th draft token adds a^j. A step of n
tokens takes about T(n) = c0 + c1 n seconds (StepCostModel, fitted to the steps actually run). Adding a
draft token to a step of B sampling requests therefore pays when a^j / c1 exceeds the step's current
E/T; the increments a_i^j of all requests, sorted, are taken while E/T still grows (a prefix of them,
since each request's increments shrink with j).

Acceptance is per request (a few pseudo-trials of the engine-wide rate as its prior, older trials decayed
so a request whose text changes character is re-learnt). A request held at k = 0 is probed with one draft
every `probe_interval` of its steps, so a proposer that becomes right is noticed and let back in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _Acceptance:
    hits: float = 0.0
    trials: float = 0.0
    steps_without_draft: int = 0


class StepCostModel:
    """Exponentially weighted least squares of step seconds against the step's tokens: T = c0 + c1 n."""

    def __init__(self, decay: float = 0.98, prior_token_fraction: float = 0.02):
        self.decay = decay
        self.prior = prior_token_fraction  # c1 / c0 until the steps seen spread over enough sizes
        self.sw = self.sn = self.st = self.snn = self.snt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self.sw = d * self.sw + 1.0
        self.sn = d * self.sn + num_tokens
        self.st = d * self.st + seconds
        self.snn = d * self.snn + num_tokens * num_tokens
        self.snt = d * self.snt + num_tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) in seconds and seconds per token; (1, prior) before any step."""
        if self.sw == 0.0:
            return 1.0, self.prior
        mean_n, mean_t = self.sn / self.sw, self.st / self.sw
        var_n = self.snn / self.sw - mean_n * mean_n
        if var_n >= 1.0:
            c1 = (self.snt / self.sw - mean_n * mean_t) / var_n
            c1 = min(max(c1, 0.0), mean_t / max(mean_n, 1.0))
            c0 = max(mean_t - c1 * mean_n, 1e-6)
            # NOTE: a token is never free (proposing, sampling, bookkeeping); a fit of noisy steps near c1 = 0
            # would otherwise let drafts with almost no chance of acceptance through.
            return c0, max(c1, self.prior * c0)
        c0 = mean_t / (1.0 + self.prior * mean_n)
        return c0, self.prior * c0


class DraftLengthPolicy:
    def __init__(self, max_k: int, adaptive: bool = True, prior_trials: float = 4.0, decay: float = 0.9,
                 probe_interval: int = 8):
        self.max_k = max_k
        self.adaptive = adaptive
        self.prior_trials = prior_trials
        self.decay = decay
        self.probe_interval = probe_interval
        self.cost = StepCostModel()
        self._requests: dict[str, _Acceptance] = {}
        self._global = _Acceptance(hits=0.5, trials=1.0)  # engine-wide, decayed slowly

    # ---- what happened ------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.cost.observe(num_tokens, seconds)

    def observe_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified num_drafts drafts of the request; the first num_accepted were kept."""
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)  # positions actually tested
        acc = self._requests.setdefault(req_id, _Acceptance())
        acc.hits = acc.hits * self.decay + num_accepted
        acc.trials = acc.trials * self.decay + trials
        acc.steps_without_draft = 0
        g = self._global
        g.hits = g.hits * 0.99 + num_accepted
        g.trials = g.trials * 0.99 + trials

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def acceptance(self, req_id: str) -> float:
        acc = self._requests.get(req_id) or _Acceptance()
        prior = self._global.hits / max(self._global.trials, 1e-9)
        return (acc.hits + self.prior_trials * prior) / (acc.trials + self.prior_trials)

    # ---- the choice ---------------------------------------------------------------------------
    def choose(self, req_ids: list[str], caps: list[int], base_tokens: int) -> list[int]:
        """Draft length for each request (that samples in the coming step), each at most its cap (tokens it
        may still emit). base_tokens: the step's tokens without drafts."""
        caps = np.minimum(np.asarray(caps, dtype=np.int64), self.max_k)
        if not self.adaptive or len(req_ids) == 0:
            return caps.clip(min=0).tolist()
        alpha = np.array([min(self.acceptance(r), 0.999) for r in req_ids])          # [B]
        j = np.arange(1, self.max_k + 1)                                              # [K]
        gains = alpha[:, None] ** j[None, :]                                          # [B, K]
        gains[j[None, :] > caps[:, None]] = 0.0
        order = np.argsort(-gains, axis=None, kind="stable")
        sorted_gains = gains.ravel()[order]
        sorted_gains = sorted_gains[sorted_gains > 0]
        c0, c1 = self.cost.coefficients()
        m = np.arange(len(sorted_gains) + 1)                                          # tokens added
        tokens_out = len(req_ids) + np.concatenate(([0.0], np.cumsum(sorted_gains)))
        rate = tokens_out / (c0 + c1 * (base_tokens + m))
        take = int(np.argmax(rate))  # the first maximum: no draft token that does not pay
        ks = np.zeros(len(req_ids), dtype=np.int64)
        np.add.at(ks, order[:take] // self.max_k, 1)
        out = ks.tolist()
        for i, req_id in enumerate(req_ids):
            acc = self._requests.setdefault(req_id, _Acceptance())
            if out[i] == 0 and caps[i] > 0:
                acc.steps_without_draft += 1
                if acc.steps_without_draft >= self.probe_interval:
                    out[i] = 1  # a probe
                    acc.steps_without_draft = 0
        return out
