"""Stop checks, the grammar's part of update and the per-request output alone."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.grammar import advance_grammar, attach_grammar, valid_drafts
from kvserve.scheduler.core_output import core_output
from kvserve.scheduler.stop import append_until_stop, stop_status

EOS = 2


def _req(max_tokens: int = 10, prompt: int = 4, **params) -> Request:
    return Request("r", list(range(10, 10 + prompt)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(EOS,), max_tokens=max_tokens)


def _append(req: Request, token: int, max_model_len: int = 100):
    req.append_output_token(token)
    return stop_status(req, token, max_model_len)


def test_eos_stop_tokens_min_tokens_and_lengths():
    assert _append(_req(), EOS) == RequestStatus.FINISHED_STOPPED
    assert _append(_req(ignore_eos=True), EOS) is None
    assert _append(_req(min_tokens=2), EOS) is None
    r = _req(stop_token_ids=[7])
    assert _append(r, 7) == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    r = _req(max_tokens=2)
    assert _append(r, 5) is None and _append(r, 5) == RequestStatus.FINISHED_LENGTH
    assert _append(_req(prompt=4), 5, max_model_len=5) == RequestStatus.FINISHED_LENGTH


def test_append_until_stop_keeps_the_stopping_token_and_drops_the_rest():
    r = _req()
    assert append_until_stop(r, [5, EOS, 6], 100) == ([5, EOS], RequestStatus.FINISHED_STOPPED)
    assert r.output_token_ids == [5, EOS]
    r = _req()
    assert append_until_stop(r, [5, 6], 100) == ([5, 6], None)
    assert append_until_stop(r, [], 100) == ([], None)


class _Grammar:
    def __init__(self, accepts: bool = True, terminated: bool = False, valid: int = 0):
        self.accepts, self.terminated, self.valid, self.added = accepts, terminated, valid, []

    def accept(self, so, tokens):
        return self.accepts

    def is_terminated(self, so):
        return self.terminated

    def valid_draft_prefix(self, so, drafts):
        return self.valid

    def add(self, so, eos_token_ids):
        self.added.append((so, eos_token_ids))
        return "compiling"


def test_advance_grammar():
    r = _req()
    assert advance_grammar(_Grammar(), r, [5], None) is None
    assert advance_grammar(_Grammar(terminated=True), r, [5], None) == RequestStatus.FINISHED_STOPPED
    assert advance_grammar(_Grammar(terminated=True), r, [5], RequestStatus.FINISHED_LENGTH) == \
        RequestStatus.FINISHED_LENGTH
    assert advance_grammar(_Grammar(accepts=False), r, [5], RequestStatus.FINISHED_STOPPED) == \
        RequestStatus.FINISHED_ERROR
    assert "does not fit the grammar" in r.error


def test_valid_drafts_and_attach_grammar():
    assert valid_drafts(_Grammar(valid=1), "so", [4, 5, 6]) == [4]
    assert valid_drafts(None, None, [4, 5]) == [4, 5]
    assert valid_drafts(_Grammar(), "so", None) == [] and valid_drafts(None, None, []) == []
    r, grammars = _req(), _Grammar()
    attach_grammar(grammars, r)
    assert r.structured_output is None and grammars.added == []
    r.sampling_params = SimpleNamespace(structured_outputs="schema")
    attach_grammar(grammars, r)
    assert r.structured_output == "compiling" and grammars.added == [("schema", (EOS,))]
    with pytest.raises(ValueError, match="no structured outputs"):
        attach_grammar(None, r)


def test_core_output_reports_the_request_state():
    r = _req()
    r.num_cached_tokens, r.stop_reason = 16, 7
    r.status = RequestStatus.FINISHED_STOPPED
    r.metrics.num_draft_tokens, r.metrics.num_accepted_tokens = 4, 3
    out = core_output(r, [7], None, now=12.5)
    assert (out.request_id, out.new_token_ids, out.timestamp, out.finish_reason, out.stop_reason) == \
        ("r", [7], 12.5, "stop", 7)
    assert (out.num_cached_tokens, out.num_draft_tokens, out.num_accepted_tokens) == (16, 4, 3)
    r.stop_reason = "a stop string"
    assert core_output(r, [], None, 0.0).stop_reason is None
