"""SchedulerStats: counters the engine reports (preemptions, prefix-cache hits, speculative acceptance)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
    """Prompt tokens a KV connector loaded at admission (past the local prefix-cache hit)."""
    num_kv_load_failures: int = 0
    """Requests whose connector load failed in a step (recomputed or failed, per kv_load_failure_policy)."""
    num_spec_drafts: int = 0
    """Speculative verifications (a request's drafts scored in one step)."""
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_per_pos: list[int] | None = None
    """Per draft position j (0-based): how many verifications accepted it."""

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """A request admitted for the first time: its prompt asked the prefix cache, num_hit_tokens hit."""
        self.num_prefix_query_tokens += num_prompt_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's drafts scored in one step: the first num_accepted of num_drafts were accepted."""
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        per_pos = self.num_spec_accepted_per_pos
        if per_pos is None or len(per_pos) < num_drafts:
            per_pos = self.num_spec_accepted_per_pos = (per_pos or []) + [0] * (num_drafts - len(per_pos or []))
        for pos in range(num_accepted):
            per_pos[pos] += 1
