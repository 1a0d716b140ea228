"""Static batching (`--static-batching`): the scheduling engines used before iteration-level scheduling (Orca).

A batch forms while nothing of it decodes: when no request runs, admission opens; requests are admitted as the
token budget allows, and those whose prompt is computed wait (no decode step) until the batch closes. It closes
when the queue is empty, max_num_seqs run, or a step could admit nobody though it had budget left (the pool is
full, or a gate holds the head). From then on nothing is admitted until the batch's last request ends.

The outputs are the same as with continuous batching (only the steps' composition changes); the cost is the
idle slots of short requests waiting for the batch's longest one, which `kvserve bench playbook` measures.
"""
from __future__ import annotations

from collections import deque

from kvserve.request import Request


class StaticBatch:
    def __init__(self, enabled: bool, max_num_seqs: int):
        self.enabled = enabled
        self.max_num_seqs = max_num_seqs
        self.forming = False
        """A batch is being admitted: admission is open and prompt-complete requests wait for the others."""
        self._stalled = False  # the last step's admission stopped short of its budget with nobody admitted

    def begin_step(self, running: list[Request], waiting: deque[Request]) -> None:
        """Open a batch when nothing runs; close the forming one when nothing more can join it."""
        if not self.enabled:
            return
        if not running:
            self.forming = True
        elif self.forming and (not waiting or len(running) >= self.max_num_seqs or self._stalled):
            self.forming = False
        self._stalled = False

    def admission_open(self) -> bool:
        return not self.enabled or self.forming

    def holds(self, req: Request) -> bool:
        """Whether a running request sits this step out: its prompt is computed and its batch still forms."""
        return self.enabled and self.forming and req.num_computed_tokens >= req.num_prompt_tokens

    def active(self, running: list[Request]) -> list[Request]:
        """The running requests that compute this step (before admissions)."""
        return running if not self.forming else [r for r in running if not self.holds(r)]

    def after_admission(self, num_admitted: int, budget_left: int) -> None:
        if self.forming and num_admitted == 0 and budget_left > 0:
            self._stalled = True
