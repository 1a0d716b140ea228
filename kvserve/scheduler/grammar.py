"""Structured outputs in the scheduler: the allowed-token bitmask a step sends, and the matcher advanced over
sampled tokens. (Holding back requests whose grammar compiles is an admission gate: admission.py.)"""
from __future__ import annotations

from kvserve.request import Request, RequestStatus
from kvserve.core_types import SchedulerOutput
from kvserve.structured_output.manager import StructuredOutputManager


def attach_grammar(structured: StructuredOutputManager | None, req: Request) -> None:
    """Start compiling the grammar of a request that asks for structured outputs."""
    so = req.sampling_params.structured_outputs
    if so is not None:
        if structured is None:
            raise ValueError("this engine serves no structured outputs")
        req.structured_output = structured.add(so, req.eos_token_ids)


def add_grammar_bitmask(out: SchedulerOutput, scheduled: list[tuple[Request, int]],
                        structured: StructuredOutputManager) -> None:
    """The allowed tokens of each constrained request that samples this step, at each position it scores."""
    entries = [(req.request_id, req.structured_output, req.spec_token_ids) for req, num_new in scheduled
               if req.structured_output is not None and req.num_computed_tokens + num_new >= req.num_tokens]
    if entries:
        out.grammar_bitmask, out.structured_output_request_ids = structured.fill_bitmask(entries)


def advance_grammar(structured: StructuredOutputManager, req: Request, tokens: list[int],
                    status: RequestStatus | None) -> RequestStatus | None:
    """Advance the request's matcher over its new tokens; a token outside the grammar fails the request, a
    complete grammar stops it."""
    if not structured.accept(req.structured_output, tokens):
        req.error = "structured output: a sampled token does not fit the grammar"
        return RequestStatus.FINISHED_ERROR
    if status is None and structured.is_terminated(req.structured_output):
        return RequestStatus.FINISHED_STOPPED
    return status


def valid_drafts(structured: StructuredOutputManager | None, so, drafts: list[int] | None) -> list[int]:
    """The proposer's drafts for a request's next step, cut where a constrained request's grammar rejects one."""
    if drafts and so is not None:
        drafts = drafts[:structured.valid_draft_prefix(so, drafts)]
    return list(drafts) if drafts else []
