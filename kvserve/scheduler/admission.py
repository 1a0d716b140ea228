"""Admission gates: whether the request at the head of the queue may start now (LoRA slots, a sibling whose
prompt KV it will reuse), and which waiting requests sit out this step's admissions (grammars compiling)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.structured_output.manager import StructuredOutputManager


@dataclass
class AdmissionGates:
    max_loras: int | None = None
    """Most distinct LoRA adapters among running requests (so in any step); None: no limit (LoRA off: the
    front end admits no adapter requests then)."""
    wait_for: dict[str, Request] = field(default_factory=dict)
    """Request id -> sibling whose prompt KV it will reuse (it is not admitted before that prompt is computed)."""

    def lora_fits(self, req: Request, running_loras: set[int]) -> bool:
        """Whether admitting req keeps the running requests within max_loras distinct adapters. Every step
        schedules running requests only, so no step needs more adapters than the worker has slots."""
        if not req.lora_int_id or req.lora_int_id in running_loras:
            return True
        return self.max_loras is None or len(running_loras) < self.max_loras

    def sibling_ready(self, req: Request) -> bool:
        """Whether the sibling req waits for (if any) has computed its prompt or finished; once it has, req
        waits for nothing more."""
        sibling = self.wait_for.get(req.request_id)
        if sibling is None:
            return True
        if not sibling.is_finished and sibling.num_computed_tokens < sibling.num_prompt_tokens:
            return False
        del self.wait_for[req.request_id]
        return True

    def check_invariants(self, running: list[Request]) -> None:
        loras = running_loras(running)
        assert self.max_loras is None or len(loras) <= self.max_loras, (
            f"{len(loras)} adapters running, max_loras {self.max_loras}")

    def admits(self, req: Request, running_loras: set[int]) -> bool:
        """Both gates. NOTE: a request the gates hold waits at the head of the queue (FCFS), so it cannot
        starve."""
        return self.lora_fits(req, running_loras) and self.sibling_ready(req)


def running_loras(running: list[Request]) -> set[int]:
    return {r.lora_int_id for r in running} - {0}


def any_compiling(waiting: deque[Request]) -> bool:
    """Some waiting request waits for its grammar to compile."""
    return any(r.structured_output is not None and r.structured_output.matcher is None for r in waiting)


def hold_back_compiling(waiting: deque[Request],
                        structured: StructuredOutputManager | None) -> tuple[list[Request], list[Request]]:
    """Take the requests whose grammar is still compiling out of `waiting` (the caller puts them back at its
    front after this step's admissions, so that the requests behind them run meanwhile). Returns them, and the
    requests whose grammar failed to compile (left in `waiting`: the caller fails them)."""
    if structured is None or not any(r.structured_output is not None for r in waiting):
        return [], []
    held, failed = [], []
    for req in list(waiting):
        so = req.structured_output
        if so is None or structured.is_ready(so, req.eos_token_ids):
            if so is not None and so.error is not None:
                failed.append(req)
            continue
        waiting.remove(req)
        held.append(req)
    return held, failed


def allocate_for_admission(kv: KVCacheManager, req: Request, num_new: int, computed, nothing_runs: bool) -> bool:
    """Slots for an admitted request's first chunk after its prefix-cache hit `computed`. When nothing runs,
    pinned prefixes yield to it."""
    if kv.allocate_slots(req, num_new, computed):
        return True
    if not nothing_runs or not kv.pins.num_pinned:
        return False
    # NOTE: nothing runs, so nothing will free blocks: pins must yield or the queue would stall forever.
    kv.pins.release_oldest(kv.pins.num_pinned)
    return kv.allocate_slots(req, num_new, computed)
