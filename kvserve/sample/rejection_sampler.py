"""Verifying draft tokens so that the output distribution is exactly the target's (Leviathan et al. 2023,
Chen et al. 2023).

The standard rule, for a draft token d drawn from the proposer's distribution q, given the target's p (both
already processed exactly as the sampler would: logit bias, min_tokens, penalties, temperature, top-k/p,
min-p): accept d with probability min(1, p(d) / q(d)); on rejection emit a sample of
normalize(max(p - q, 0)) and stop; if every draft is accepted, emit a sample of the next position's p
(the bonus token). `rejection_sample` implements it for any q.

Our proposers are deterministic (n-gram lookup, greedy drafts), so q is one-hot at d. Then the rule
accepts with probability p(d), and on rejection samples p with d removed, renormalised. Drawing x ~ p and
accepting iff x == d does exactly that: P(accept) = p(d), and given x != d, x ~ p(. | x != d). So the
engine verifies one-hot drafts by sampling every scored position with the ordinary sampler and keeping
the run of positions where the sample equals the draft, plus the first sample that does not
(`accept_prefix`). Two consequences: greedy requests accept exactly when the draft is the argmax, and a
seeded request draws the same noise per output token with or without speculation (the draws of positions
after the first rejection are rewound, `rewind_generator`), so its output does not depend on speculation.
"""
from __future__ import annotations

import torch


def accept_prefix(sampled: list[int], drafts: list[int]) -> int:
    """How many drafts are accepted, given the target's samples at the len(drafts) + 1 scored positions
    (position j conditioned on the drafts before it). The request then gets sampled[:accepted + 1]."""
    accepted = 0
    for token, draft in zip(sampled, drafts):
        if token != draft:
            break
        accepted += 1
    return accepted


def rewind_generator(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab_size: int,
                     device: torch.device) -> None:
    """Put a seeded request's generator where num_draws sampler draws (one [vocab] exponential each) from
    `state` would leave it: the positions scored after the first rejection give their draws back."""
    generator.set_state(state)
    for _ in range(num_draws):
        torch.empty(vocab_size, device=device).exponential_(generator=generator)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """The standard rule for one request and any proposal distribution.

    target_probs [K + 1, V]: the target's processed distribution at each scored position; draft_probs
    [K, V]: the proposer's (one-hot rows for a deterministic proposer); draft_ids [K]. Returns the emitted
    tokens: the accepted drafts, then either the resampled token at the first rejection or the bonus token.
    """
    k = draft_ids.shape[0]
    uniform = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    rows = torch.arange(k, device=target_probs.device)
    p_draft = target_probs[rows, draft_ids]                                  # [K]
    q_draft = draft_probs[rows, draft_ids]                                   # [K]
    accept = uniform * q_draft <= p_draft                                    # u <= p/q without dividing by 0
    out: list[int] = []
    for j in range(k):
        if not bool(accept[j]):
            residual = (target_probs[j] - draft_probs[j]).clamp_min_(0.0)     # [V]
            total = residual.sum()
            # NOTE: p == q leaves no residual, but then rejection had probability 0; fall back to p.
            dist = residual / total if total > 0 else target_probs[j]
            out.append(int(torch.multinomial(dist, 1, generator=generator)))
            return out
        out.append(int(draft_ids[j]))
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
