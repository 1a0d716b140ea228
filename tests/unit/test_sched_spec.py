"""Speculative decoding's scheduler parts alone: draft caps, trimming to the chunk, the drafts to propose,
rejected positions, verification stats."""
from __future__ import annotations

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import spec
from kvserve.scheduler.stats import SchedulerStats


def _req(rid: str = "r", prompt: int = 5, outputs: int = 0, max_tokens: int = 10, computed: int | None = None,
         drafts: list[int] | None = None) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    r.output_token_ids = list(range(100, 100 + outputs))
    r.num_computed_tokens = r.num_tokens - 1 if computed is None else computed
    r.spec_token_ids = list(drafts or [])
    return r


class _Policy:
    def __init__(self, ks: list[int]):
        self.ks, self.calls, self.verifications = ks, [], []

    def choose(self, req_ids, caps, base_tokens):
        self.calls.append((list(req_ids), list(caps), base_tokens))
        return self.ks[:len(req_ids)]

    def observe_verification(self, req_id, num_drafts, num_accepted):
        self.verifications.append((req_id, num_drafts, num_accepted))


class _Slots:
    def __init__(self, ok: set[str]):
        self.ok, self.asked = ok, []

    def allocate_slots(self, request, num_new_tokens):
        self.asked.append((request.request_id, num_new_tokens))
        return request.request_id in self.ok


def test_cap_drafts_by_max_tokens_and_max_model_len():
    r = _req(outputs=6, max_tokens=10, drafts=[1, 2, 3, 4, 5])
    spec.cap_drafts(r, max_model_len=100)
    assert r.spec_token_ids == [1, 2, 3]  # 4 tokens left: 3 drafts + the step's own sample
    r = _req(prompt=5, outputs=2, drafts=[1, 2, 3, 4])
    spec.cap_drafts(r, max_model_len=9)
    assert r.spec_token_ids == [1, 2]
    r = _req(outputs=9, max_tokens=10, drafts=[1])
    spec.cap_drafts(r, max_model_len=100)
    assert r.spec_token_ids == []


def test_trim_drafts_to_the_chunk_the_budget_allowed():
    r = _req(prompt=5, outputs=1, drafts=[7, 8, 9])  # 1 token to compute + 3 drafts
    spec.trim_drafts_to_chunk(r, 3)
    assert r.spec_token_ids == [7, 8]
    spec.trim_drafts_to_chunk(r, 1)
    assert r.spec_token_ids == []


def test_num_rejected():
    assert spec.num_rejected(3, 4) == 0   # all accepted, plus the bonus token
    assert spec.num_rejected(3, 1) == 3
    assert spec.num_rejected(3, 0) == 0   # sampling failed: nothing is known
    assert spec.num_rejected(0, 1) == 0


def test_drafts_to_propose_for_sampling_requests_only():
    decode = _req("d", prompt=4, outputs=2, max_tokens=10)
    verify = _req("v", prompt=4, outputs=3, max_tokens=10, drafts=[1, 2])
    chunk = _req("c", prompt=20, computed=0)
    policy = _Policy([2, 0])
    chosen = spec.drafts_to_propose([(decode, 1), (verify, 3), (chunk, 8)], policy, max_model_len=100)
    assert chosen == {"d": 2}  # the policy chose 0 for "v"; "c" does not sample this step
    ids, caps, base = policy.calls[0]
    assert ids == ["d", "v"] and caps == [10 - 2 - 2, 10 - 3 - 2] and base == 1 + 1 + 8
    assert spec.drafts_to_propose([(chunk, 8)], policy, max_model_len=100) == {}


def test_drafts_to_propose_with_lookahead_needs_slots():
    a, b = _req("a"), _req("b")
    slots = _Slots(ok={"b"})
    assert spec.drafts_to_propose([(a, 1), (b, 1)], _Policy([3, 2]), 100, lookahead=slots) == {"b": 2}
    assert slots.asked == [("a", 4), ("b", 3)]


def test_record_verification_counts_stats_metrics_and_policy():
    stats, policy, r = SchedulerStats(), _Policy([]), _req()
    spec.record_verification(r, 3, 2, stats, policy)
    spec.record_verification(r, 5, 1, stats, None)
    assert (stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens) == (2, 8, 3)
    assert stats.num_spec_accepted_per_pos == [2, 1, 0, 0, 0]
    assert (r.metrics.num_draft_tokens, r.metrics.num_accepted_tokens) == (8, 3)
    assert policy.verifications == [("r", 3, 2)]


def test_stats_record_admission():
    stats = SchedulerStats()
    stats.record_admission(10, 8)
    stats.record_admission(5, 0)
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (15, 8)
