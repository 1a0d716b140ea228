"""Admission gates alone: LoRA slots, a sibling's wait, grammars still compiling or failed, pins yielding."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from kvserve.lora.request import LoRARequest
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.admission import (AdmissionGates, allocate_for_admission, any_compiling, hold_back_compiling,
                                         running_loras)


def _req(rid: str, lora: int = 0, prompt: int = 8) -> Request:
    lora_request = LoRARequest(f"a{lora}", lora, "/nowhere") if lora else None
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=4), max_tokens=4, lora_request=lora_request)


def test_lora_slots_admit_known_adapters_and_new_ones_while_slots_are_free():
    gates = AdmissionGates(max_loras=2)
    assert gates.lora_fits(_req("base"), {1, 2})
    assert gates.lora_fits(_req("known", lora=2), {1, 2})
    assert not gates.lora_fits(_req("third", lora=3), {1, 2})
    assert gates.lora_fits(_req("second", lora=3), {1})
    assert AdmissionGates(max_loras=None).lora_fits(_req("any", lora=9), {1, 2, 3})
    assert running_loras([_req("a", 1), _req("b"), _req("c", 1), _req("d", 4)]) == {1, 4}


def test_lora_invariant():
    AdmissionGates(max_loras=1).check_invariants([_req("a", 1), _req("b", 1), _req("c")])
    with pytest.raises(AssertionError, match="2 adapters running"):
        AdmissionGates(max_loras=1).check_invariants([_req("a", 1), _req("b", 2)])


def test_a_sibling_wait_lasts_until_its_prompt_is_computed_or_it_finishes():
    sibling, req = _req("s", prompt=8), _req("r")
    gates = AdmissionGates(wait_for={"r": sibling})
    assert not gates.sibling_ready(req) and not gates.admits(req, set())
    sibling.num_computed_tokens = 8
    assert gates.sibling_ready(req) and gates.wait_for == {}
    sibling.num_computed_tokens = 0
    assert gates.sibling_ready(req)  # the wait is over for good
    other = _req("o")
    gates.wait_for["o"] = sibling
    sibling.status = RequestStatus.FINISHED_ABORTED
    assert gates.admits(other, set())


def test_the_lora_gate_is_asked_before_the_sibling():
    sibling, req = _req("s"), _req("r", lora=3)
    sibling.num_computed_tokens = 8
    gates = AdmissionGates(max_loras=1, wait_for={"r": sibling})
    assert not gates.admits(req, {1})
    assert gates.wait_for == {"r": sibling}  # not consumed while the adapter has no slot


class _Grammars:
    def __init__(self, ready: set[str]):
        self.ready = ready

    def is_ready(self, so, eos_token_ids) -> bool:
        return so.name in self.ready


def _constrained(rid: str, error: str | None = None, compiled: bool = False) -> Request:
    r = _req(rid)
    r.structured_output = SimpleNamespace(name=rid, error=error, matcher=object() if compiled else None)
    return r


def test_compiling_grammars_sit_out_and_failed_ones_are_reported():
    plain, compiling, failed, ready = _req("p"), _constrained("c"), _constrained("f", "bad"), _constrained("r")
    waiting = deque([plain, compiling, failed, ready])
    assert any_compiling(waiting)
    held, bad = hold_back_compiling(waiting, _Grammars(ready={"f", "r"}))
    assert held == [compiling] and bad == [failed]
    assert list(waiting) == [plain, failed, ready]  # the caller fails "f"
    assert hold_back_compiling(deque([plain]), _Grammars(set())) == ([], [])
    assert hold_back_compiling(waiting, None) == ([], [])
    assert not any_compiling(deque([plain, _constrained("done", compiled=True)]))


class _KV:
    def __init__(self, free_after_release: bool, num_pinned: int):
        self.pins = SimpleNamespace(num_pinned=num_pinned, released=[])
        self.pins.release_oldest = lambda n: (self.pins.released.append(n), setattr(self.pins, "num_pinned", 0))
        self.free_after_release = free_after_release
        self.calls = 0

    def allocate_slots(self, req, num_new, computed):
        self.calls += 1
        return self.free_after_release and self.pins.num_pinned == 0


def test_pins_yield_only_when_nothing_runs():
    kv = _KV(free_after_release=True, num_pinned=3)
    assert not allocate_for_admission(kv, _req("a"), 8, [], nothing_runs=False)
    assert kv.pins.released == [] and kv.calls == 1
    assert allocate_for_admission(kv, _req("a"), 8, [], nothing_runs=True)
    assert kv.pins.released == [3] and kv.calls == 3
    kv = _KV(free_after_release=False, num_pinned=0)
    assert not allocate_for_admission(kv, _req("a"), 8, [], nothing_runs=True) and kv.calls == 1
