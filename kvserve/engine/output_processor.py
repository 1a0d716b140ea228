"""OutputProcessor: scheduler results -> RequestOutputs (text, logprobs, stop strings, n-sample groups).

Owns the text side of each request. Token-level stops (EOS, stop ids, length) were applied by the
scheduler; stop strings are found here, and the engine then finishes those requests in the scheduler.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sample.sampler import RowLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _SampleState:
    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass
class _GroupState:
    """One user request: its n samples (child Requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    arrival_time: float


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._groups: dict[str, _GroupState] = {}
        self._child_to_group: dict[str, tuple[str, int]] = {}

    def add_group(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        samples = []
        for i, child in enumerate(children):
            params = child.sampling_params
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params.stop_strings,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
            samples.append(_SampleState(i, child, detok, [] if params.logprobs is not None else None))
            self._child_to_group[child.request_id] = (request_id, i)
        self._groups[request_id] = _GroupState(request_id, prompt, children[0].prompt_token_ids, samples,
                                               children[0].timings.arrival)

    def process(self, advanced: list[Request], logprobs: dict[str, RowLogprobs], ended: list[Request],
                on_stop: Callable[[Request], None],
                on_error: Callable[[Request, str], None]) -> list[RequestOutput]:
        """Outputs for every group that changed this step. A child whose text reached a stop string is
        handed to `on_stop` (which finishes it in the scheduler) before its output is built; a child
        whose text handling raised is handed to `on_error` with the reason, and fails alone.
        `ended`: children finished outside the token flow (aborted, failed in sampling)."""
        touched: dict[str, _GroupState] = {}
        for req in advanced:
            group_id, idx = self._child_to_group[req.request_id]
            group = self._groups[group_id]
            try:
                self._add_token(group.samples[idx], req, logprobs.get(req.request_id), on_stop)
            except Exception as e:
                logger.exception("output processing failed for request %s", req.request_id)
                on_error(req, f"output processing failed: {type(e).__name__}: {e}")
            touched[group_id] = group
        for req in ended:
            if req.request_id in self._child_to_group:
                group_id, _ = self._child_to_group[req.request_id]
                touched[group_id] = self._groups[group_id]
        return [self._make_output(g) for g in touched.values()]

    def _add_token(self, state: _SampleState, req: Request, row_logprobs: RowLogprobs | None,
                   on_stop: Callable[[Request], None]) -> None:
        token = req.output_token_ids[-1]
        state.new_token_ids.append(token)
        if state.logprobs is not None and row_logprobs is not None:
            entry = self._logprob_entry(row_logprobs)
            state.logprobs.append(entry)
            state.cumulative_logprob += entry[token].logprob
        if state.detok is not None and state.detok.add_tokens([token], finished=req.is_finished):
            if not req.is_finished:
                on_stop(req)

    def _logprob_entry(self, row: RowLogprobs) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for tid, lp, rank in zip(row.token_ids, row.logprobs, row.ranks):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        return entry

    def _make_output(self, group: _GroupState) -> RequestOutput:
        outputs, new_ids, new_texts = [], [], []
        for s in group.samples:
            req = s.request
            finished = req.is_finished
            text = ""
            delta = ""
            if s.detok is not None:
                if finished and req.error is None:
                    try:
                        s.detok.add_tokens([], finished=True)
                    except Exception as e:  # the final flush of a finished request: fail it alone
                        logger.exception("output processing failed for request %s", req.request_id)
                        req.status, req.error = RequestStatus.FINISHED_ERROR, f"detokenization failed: {e}"
                text = s.detok.text
                delta = s.detok.take_delta(finished)
            stop_reason = req.stop_reason
            if s.detok is not None and s.detok.stop_reason is not None:
                stop_reason = s.detok.stop_reason
            outputs.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=req.status.finish_reason, stop_reason=stop_reason, error=req.error))
            new_ids.append(s.new_token_ids)
            new_texts.append(delta)
            s.new_token_ids = []
        finished = all(s.request.is_finished for s in group.samples)
        first = group.samples[0].request
        timings = [s.request.timings for s in group.samples]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=min((t.first_scheduled for t in timings if t.first_scheduled), default=None),
            first_token_time=min((t.first_token for t in timings if t.first_token), default=None),
            last_token_time=max((t.last_token for t in timings if t.last_token), default=None),
            finished_time=(max(t.finished or time.monotonic() for t in timings) if finished else None))
        out = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                            num_cached_tokens=first.num_cached_tokens, metrics=metrics,
                            new_token_ids=new_ids, new_texts=new_texts)
        if finished:
            for s in group.samples:
                del self._child_to_group[s.request.request_id]
            del self._groups[group.request_id]
        return out

    def group_children(self, request_id: str) -> list[Request]:
        group = self._groups.get(request_id)
        return [s.request for s in group.samples] if group else []
