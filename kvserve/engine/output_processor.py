"""OutputProcessor: the front end's output side. Engine-core deltas (new token ids, logprobs, finishes)
-> RequestOutputs: text (incremental detokenization), stop strings, logprobs with decoded tokens, the n
samples of a request grouped, metrics. It runs where the client is (the server process, or `LLM`), off the
engine step.

A sample whose text reaches a stop string finishes here; `process` returns its id in `reqs_to_abort` so the
front end aborts it in the core (which reports it once more, as "abort": ignored). A sample whose text
handling raises fails alone, with finish_reason "error", and is aborted in the core too.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvserve.core_types import EngineCoreOutput
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from kvserve.sample.prompt_logprobs import PromptLogprobsChunk
from kvserve.sample.sampler import RowLogprobs
from kvserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _SampleState:
    index: int
    request_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    num_logprobs_sent: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class _GroupState:
    """One user request: its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_SampleState]
    arrival_time: float
    output_kind: RequestOutputKind
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    seen_first_token: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    """With params.prompt_logprobs: the entries so far (chunk by chunk, from the first sample's outputs)."""
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class IterationStats:
    """What one step did, from the core's timestamps (for metrics, whatever the requests' output kinds)."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that got their first token in this step."""
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Sample ids the front end finished (stop string, error) that the core still runs."""
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._groups: dict[str, _GroupState] = {}
        self._samples: dict[str, tuple[_GroupState, _SampleState]] = {}  # sample (core request) id ->

    def add_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], sample_ids: list[str],
                  params: SamplingParams, arrival_time: float) -> None:
        samples = []
        for i, sample_id in enumerate(sample_ids):
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
            samples.append(_SampleState(i, sample_id, params, detok,
                                        logprobs=[] if params.logprobs is not None else None,
                                        metrics=RequestMetrics(arrival_time)))
        group = _GroupState(request_id, prompt, list(prompt_token_ids), samples, arrival_time, params.output_kind,
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._groups[request_id] = group
        for s in samples:
            self._samples[s.request_id] = (group, s)

    def sample_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [s.request_id for s in group.samples] if group else []

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, _GroupState] = {}
        to_abort: list[str] = []
        stats = IterationStats()
        for out in outputs:
            entry = self._samples.get(out.request_id)
            if entry is None:  # finished here already (stop string): the core's "abort" echo
                continue
            group, sample = entry
            if sample.finish_reason is not None:
                continue
            if out.new_prompt_logprobs is not None and group.prompt_logprobs is not None:
                self._add_prompt_logprobs(group.prompt_logprobs, out.new_prompt_logprobs)
            if not out.new_token_ids and not out.finished:
                continue  # a prompt chunk's logprobs alone: they go out with the first token
            _count(stats, group, sample, out)
            try:
                stopped = self._apply(group, sample, out)
            except Exception as e:
                logger.exception("output processing failed for request %s", out.request_id)
                sample.finish_reason, sample.error = "error", f"output processing failed: {type(e).__name__}: {e}"
                sample.metrics.finished_time = time.monotonic()
                stopped = True
            if stopped and not out.finished:
                to_abort.append(out.request_id)
            touched[group.request_id] = group
        results = []
        for group in touched.values():
            output = self._make_output(group)
            if output is not None:
                results.append(output)
        return ProcessedOutputs(results, to_abort, stats)

    def _apply(self, group: _GroupState, sample: _SampleState, out: EngineCoreOutput) -> bool:
        """Fold one core output into its sample; True if the sample finished here (stop string)."""
        m = sample.metrics
        if out.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        if sample.index == 0:
            group.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                group.kv_transfer_params = out.kv_transfer_params
        if out.new_token_ids:
            m.first_token_time = m.first_token_time or out.timestamp
            m.last_token_time = out.timestamp
        m.num_draft_tokens, m.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        detok = sample.detok
        # NOTE: a step may bring several tokens (speculative decoding); with stop strings they are added one
        # at a time, so the tokens after the one that completes a stop string are dropped, as they would
        # never have been generated one step at a time.
        one_by_one = detok is not None and bool(detok.stop_strings) and len(out.new_token_ids) > 1
        stopped = False
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            sample.new_token_ids.append(token)
            if sample.logprobs is not None and out.new_logprobs is not None:
                entry = self._logprob_entry(out.new_logprobs[i])
                sample.logprobs.append(entry)
                sample.cumulative_logprob += entry[token].logprob
            if one_by_one:
                last = i == len(out.new_token_ids) - 1
                stopped = detok.add_tokens([token], finished=out.finished and last)
                if stopped:
                    break
        if detok is not None:
            if not one_by_one and (out.new_token_ids or out.finished):
                stopped = detok.add_tokens(out.new_token_ids, finished=out.finished)
            if stopped:
                sample.stop_reason = detok.stop_reason
        if stopped:
            sample.finish_reason = "stop"
        elif out.finished:
            sample.finish_reason, sample.error = out.finish_reason, out.error
            if out.stop_reason is not None:
                sample.stop_reason = out.stop_reason
        if sample.finish_reason is not None:
            m.finished_time = out.timestamp if out.finished and out.timestamp else time.monotonic()
        return stopped

    def _logprob_entry(self, row: RowLogprobs) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for tid, lp, rank in zip(row.token_ids, row.logprobs, row.ranks):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        return entry

    def _add_prompt_logprobs(self, entries: PromptLogprobs, chunk: PromptLogprobsChunk) -> None:
        assert chunk.start == len(entries), f"prompt logprobs chunk at {chunk.start}, expected {len(entries)}"
        rows, logprobs, ranks = chunk.token_ids.tolist(), chunk.logprobs.tolist(), chunk.ranks.tolist()
        unique = sorted({t for row in rows for t in row})
        # NOTE: one batched decode per chunk: a long prompt with top-k has thousands of entries.
        texts = dict(zip(unique, self.tokenizer.batch_decode([[t] for t in unique])))
        for row, lps, rank in zip(rows, logprobs, ranks):
            entry = {row[0]: Logprob(lps[0], rank, texts[row[0]])}
            for top_rank, (tid, lp) in enumerate(zip(row[1:], lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, top_rank, texts[tid]))
            entries.append(entry)

    @staticmethod
    def _take_prompt_logprobs(group: _GroupState, finished: bool) -> PromptLogprobs | None:
        """The prompt logprobs this output carries: all of them once the prompt is computed (partial only
        if the request ended before); DELTA outputs carry them once."""
        entries = group.prompt_logprobs
        if entries is None or (len(entries) < len(group.prompt_token_ids) and not finished):
            return None
        if group.output_kind == RequestOutputKind.DELTA:
            if group.prompt_logprobs_sent:
                return None
            group.prompt_logprobs_sent = True
        return list(entries)

    def _make_output(self, group: _GroupState) -> RequestOutput | None:
        finished = group.finished
        kind = group.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outputs, new_ids, new_texts = [], [], []
        for s in group.samples:
            done = s.finish_reason is not None
            text = s.detok.text if s.detok is not None else ""
            new_text = s.detok.take_delta(done) if s.detok is not None else ""
            logprobs = None
            if s.logprobs is not None:
                logprobs = s.logprobs[s.num_logprobs_sent:] if delta else list(s.logprobs)
                s.num_logprobs_sent = len(s.logprobs)
            outputs.append(CompletionOutput(
                index=s.index, text=new_text if delta else text,
                token_ids=list(s.new_token_ids) if delta else list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=s.error))
            new_ids.append(s.new_token_ids)
            new_texts.append(new_text)
            s.new_token_ids = []
        metrics = _group_metrics(group, finished)
        prompt_logprobs = self._take_prompt_logprobs(group, finished)
        if finished:
            for s in group.samples:
                del self._samples[s.request_id]
            del self._groups[group.request_id]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             num_cached_tokens=group.num_cached_tokens, metrics=metrics,
                             new_token_ids=new_ids, new_texts=new_texts, prompt_logprobs=prompt_logprobs,
                             kv_transfer_params=group.kv_transfer_params if finished else None)


def _count(stats: IterationStats, group: _GroupState, sample: _SampleState, out: EngineCoreOutput) -> None:
    if not out.new_token_ids:
        return
    stats.num_generation_tokens += len(out.new_token_ids)
    if not group.seen_first_token:
        group.seen_first_token = True
        stats.num_prompt_tokens += len(group.prompt_token_ids)
        stats.time_to_first_tokens.append(out.timestamp - group.arrival_time)
    elif sample.metrics.last_token_time is not None and out.timestamp > sample.metrics.last_token_time:
        stats.inter_token_latencies.append(out.timestamp - sample.metrics.last_token_time)


def _group_metrics(group: _GroupState, finished: bool) -> RequestMetrics:
    ms = [s.metrics for s in group.samples]

    def first(values):
        return min((v for v in values if v is not None), default=None)

    def last(values):
        return max((v for v in values if v is not None), default=None)

    return RequestMetrics(arrival_time=group.arrival_time,
                          first_scheduled_time=first(m.first_scheduled_time for m in ms),
                          first_token_time=first(m.first_token_time for m in ms),
                          last_token_time=last(m.last_token_time for m in ms),
                          finished_time=last(m.finished_time for m in ms) if finished else None,
                          num_draft_tokens=sum(m.num_draft_tokens for m in ms),
                          num_accepted_tokens=sum(m.num_accepted_tokens for m in ms))
