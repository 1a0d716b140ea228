"""A step's sampling in the worker: every logits row in one go, then each request's accepted drafts (see
sample/rejection_sampler.py). If the batch raises, each request is sampled alone, so that the requests that
raise fail alone (their ids land in `errors`) and every other request still gets its tokens.

NOTE: seeded generators are restored before the retry, so a seeded request's tokens are the same whether or
not a batch mate failed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sample.rejection_sampler import accept_prefix, rewind_generator
from kvserve.sample.sampler import Sampler
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.core_types import ModelRunnerOutput
from kvserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


@dataclass
class SamplingPlan:
    """The sampling requests of a step, in logits order; request i owns logits rows [offsets[i], offsets[i+1])."""

    req_ids: list[str]                      # [S]
    drafts: list[list[int]]                 # [S] the drafts each verifies (most have none)
    offsets: np.ndarray                     # [S + 1]
    states: list[CachedRequestState]        # [S]
    saved: dict[int, torch.Tensor]          # request index -> its generator's state before sampling (seeded)
    prefixes: list[list[int]] | None        # [N] per logits row: the drafts before its position

    @classmethod
    def of(cls, batch: InputBatch, inputs: StepInputs) -> SamplingPlan:
        states = [batch.states[batch.index[r]] for r in inputs.sample_req_ids]
        return cls(inputs.sample_req_ids, inputs.drafts, np.concatenate(([0], np.cumsum(inputs.num_logits))),
                   states, {i: s.generator.get_state() for i, s in enumerate(states) if s.generator is not None},
                   draft_prefixes(inputs.drafts))

    def rows(self, i: int) -> tuple[int, int]:
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def only(self, i: int) -> SamplingPlan:
        """Request i alone (its rows re-indexed from 0)."""
        lo, hi = self.rows(i)
        return SamplingPlan([self.req_ids[i]], [self.drafts[i]], np.array([0, hi - lo]), [self.states[i]],
                            {0: self.saved[i]} if i in self.saved else {},
                            self.prefixes[lo:hi] if self.prefixes else None)


def draft_prefixes(drafts: list[list[int]]) -> list[list[int]] | None:
    """Per logits row: the drafts before its position (what the target conditions on there)."""
    if not any(drafts):
        return None
    return [d[:j] for d in drafts for j in range(len(d) + 1)]


def sample_step(sampler: Sampler, batch: InputBatch, logits: torch.Tensor, inputs: StepInputs, vocab_size: int,
                device: torch.device) -> ModelRunnerOutput:
    """Sample `logits` [N, vocab] (the rows of `inputs`); the batch, or each request alone if it raises."""
    plan = SamplingPlan.of(batch, inputs)
    try:
        meta = batch.sampling_metadata(inputs.sample_rows, vocab_size, logits.device, plan.prefixes, inputs.grammar)
        result = sampler(logits, meta)
    except Exception:
        logger.exception("sampling a batch of %d failed; sampling its requests one by one", len(plan.req_ids))
        return sample_one_by_one(sampler, batch, logits, inputs, plan, vocab_size, device)
    drew = {i for i in plan.saved if int(plan.offsets[i]) in meta.generators}
    return accept_drafts(plan, result.sampled_token_ids, result.logprobs, drew, vocab_size, device)


def sample_one_by_one(sampler: Sampler, batch: InputBatch, logits: torch.Tensor, inputs: StepInputs,
                      plan: SamplingPlan, vocab_size: int, device: torch.device) -> ModelRunnerOutput:
    """The fallback: each request sampled alone, its generator restored first; a request that raises fails."""
    out, logprobs = ModelRunnerOutput(), []
    for i, req_id in enumerate(plan.req_ids):
        lo, hi = plan.rows(i)
        if i in plan.saved:
            plan.states[i].generator.set_state(plan.saved[i])
        one_plan = plan.only(i)
        try:
            meta = batch.sampling_metadata(inputs.sample_rows[lo:hi], vocab_size, logits.device, one_plan.prefixes,
                                           inputs.grammar.select(lo, hi) if inputs.grammar else None)
            one = sampler(logits[lo:hi], meta)
        except Exception as e:
            out.errors[req_id] = f"sampling failed: {type(e).__name__}: {e}"
            continue
        part = accept_drafts(one_plan, one.sampled_token_ids, one.logprobs,
                             {0} if i in plan.saved and 0 in meta.generators else set(), vocab_size, device)
        out.req_ids += part.req_ids
        out.sampled_token_ids += part.sampled_token_ids
        logprobs.append(part.logprobs[0] if part.logprobs else None)
    if any(lp is not None for lp in logprobs):
        out.logprobs = logprobs
    return out


def accept_drafts(plan: SamplingPlan, tokens: list[int], logprobs: list, drew: set[int], vocab_size: int,
                  device: torch.device) -> ModelRunnerOutput:
    """Per request: its samples at the scored positions -> the tokens it gets. `drew`: the seeded requests whose
    generators drew; those that rejected a draft give back the draws of the positions after it."""
    out_tokens, out_logprobs = [], []
    for i, draft in enumerate(plan.drafts):
        lo, hi = plan.rows(i)
        n = accept_prefix(tokens[lo:hi], draft) + 1 if draft else 1
        out_tokens.append(tokens[lo:lo + n])
        out_logprobs.append(None if logprobs[lo] is None else logprobs[lo:lo + n])
        if i in drew and lo + n < hi:
            rewind_generator(plan.states[i].generator, plan.saved[i], n, vocab_size, device)
    wanted = any(lp is not None for lp in out_logprobs)
    return ModelRunnerOutput(req_ids=list(plan.req_ids), sampled_token_ids=out_tokens,
                             logprobs=out_logprobs if wanted else None)
