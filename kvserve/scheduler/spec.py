"""Speculative decoding in the scheduler: how many drafts a request may verify and propose, and what a
verification leaves behind (rejected drafts, acceptance counts). The draft-length choice itself is the
policy's (spec_decode/policy.py)."""
from __future__ import annotations

from typing import Protocol

from kvserve.request import Request
from kvserve.scheduler.stats import SchedulerStats
from kvserve.spec_decode.policy import DraftLengthPolicy


class SlotAllocator(Protocol):
    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool: ...


def cap_drafts(req: Request, max_model_len: int) -> None:
    """Never verify drafts past max_tokens (the step's own sample is one more) or max_model_len."""
    limit = min(req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens)
    del req.spec_token_ids[max(0, limit):]


def trim_drafts_to_chunk(req: Request, num_new: int) -> None:
    """The token budget may cut a verifying request's chunk short: keep the drafts that fit in num_new."""
    del req.spec_token_ids[max(0, num_new - (req.num_tokens - req.num_computed_tokens)):]


def drafts_to_propose(scheduled: list[tuple[Request, int]], policy: DraftLengthPolicy, max_model_len: int,
                      lookahead: SlotAllocator | None = None) -> dict[str, int]:
    """The policy's draft length for the next step of each request that samples in this one. `lookahead`: the
    proposer writes the drafts' K/V (a draft model), so drafts only where it has slots for them."""
    ids, caps, sampling = [], [], {}
    for req, num_new in scheduled:
        if req.num_computed_tokens + num_new < req.num_tokens:
            continue  # a prompt chunk short of the end: it does not sample this step
        # After this step the request holds at least one more token, and its next step samples one more.
        ids.append(req.request_id)
        caps.append(min(req.max_tokens - req.num_output_tokens - 2, max_model_len - req.num_tokens - 1))
        sampling[req.request_id] = (req, num_new)
    if not ids:
        return {}
    base = sum(n - len(r.spec_token_ids) for r, n in scheduled)
    chosen = {}
    for req_id, k in zip(ids, policy.choose(ids, caps, base)):
        if k <= 0:
            continue
        req, num_new = sampling[req_id]
        if lookahead is not None and not lookahead.allocate_slots(req, num_new + k):
            continue  # the pool is short: no drafts rather than a preemption
        chosen[req_id] = k
    return chosen


def num_rejected(num_drafts: int, num_sampled: int) -> int:
    """Positions computed this step that hold drafts the target rejected (not tokens of the request)."""
    return num_drafts + 1 - num_sampled if num_sampled and num_drafts else 0


def record_verification(req: Request, num_drafts: int, num_accepted: int, stats: SchedulerStats,
                        policy: DraftLengthPolicy | None) -> None:
    """Count one verification in the scheduler's stats, the request's metrics and the draft policy."""
    stats.record_verification(num_drafts, num_accepted)
    req.metrics.num_draft_tokens += num_drafts
    req.metrics.num_accepted_tokens += num_accepted
    if policy is not None:
        policy.observe_verification(req.request_id, num_drafts, num_accepted)
