"""InputBatch: the worker's persistent state of the requests it runs, as arrays updated in place.

A request's prompt, sampling parameters and blocks arrive once (NewRequestData); each later step only
changes counts, appends blocks and appends the token the worker itself sampled. Building a step's inputs
(token ids, positions, slot mapping, block tables, sampling tensors) is then array indexing, not a walk
over Python request objects.

Rows are dense: rows [0, num_reqs) hold requests; removing one moves the last row into its place.
A preempted request leaves the batch but its CachedRequestState (tokens, generator) stays with the runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.lora.request import LoRARequest
from kvserve.sample.metadata import DenseSamplingParams, GrammarBitmask, SamplingMetadata, SamplingRow
from kvserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Everything the worker knows of one unfinished request (kept across preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    """Owned by the request and advanced in place, so a seed gives the same tokens whatever the batch."""
    num_computed_tokens: int
    """NOTE: no block ids here: the batch's block table is their one copy (a resumed request brings a new
    table in the diff)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0
    """Speculative draft model: leading tokens whose K/V the draft has computed (0 after a preemption)."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with; None: the base model."""
    num_prompt_logprobs: int = 0
    """prompt_logprobs: leading prompt positions already turned into prompt logprobs (they describe prompt
    tokens 1 .. this); kept across preemption, so a recompute does not send them twice."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_logits_processing(self) -> bool:
        """Whether a logits processor (penalties, logit_bias, min_tokens) may touch this request's row."""
        p = self.sampling_params
        return p.has_penalties or bool(p.logit_bias) or len(self.output_token_ids) < p.min_tokens

    def sampling_row(self, drafts: list[int] | None = None) -> SamplingRow:
        """The row at the request's next position, or at a draft position: after the drafts before it."""
        outputs = self.output_token_ids + drafts if drafts else self.output_token_ids
        return SamplingRow(self.sampling_params, self.prompt_token_ids, outputs, self.generator,
                           self.eos_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}
        self.states: list[CachedRequestState] = []
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)             # [R, L]
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)                              # [R]
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)                     # [R]
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)  # [R, M]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)                              # [R]
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)                            # [R]
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)                                   # [R]
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)                                  # [R]
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)                                 # [R]
        self.lora_int_id = np.zeros(max_num_reqs, dtype=np.int64)                             # [R] 0: base

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ---- rows in and out ----------------------------------------------------------------------
    def add(self, state: CachedRequestState, block_ids: list[int]) -> int:
        """Give the request a row (its tokens, sampling values and its block table `block_ids` are copied in)."""
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch full ({self.max_num_reqs} rows)")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.index[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_blocks(row, block_ids)
        p = state.sampling_params
        self.temperature[row], self.top_k[row] = p.temperature, p.effective_top_k
        self.top_p[row], self.min_p[row] = p.top_p, p.min_p
        self.lora_int_id[row] = state.lora_request.lora_int_id if state.lora_request is not None else 0
        return row

    def remove(self, req_id: str) -> None:
        """Free the request's row; the last row moves into it."""
        row = self.index.pop(req_id)
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row], self.states[row] = moved, self.states[last]
            self.index[moved] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            b = self.num_blocks[last]
            self.block_table[row, :b] = self.block_table[last, :b]
            for array in (self.num_tokens, self.num_computed_tokens, self.num_blocks, self.temperature,
                          self.top_k, self.top_p, self.min_p, self.lora_int_id):
                array[row] = array[last]
        self.req_ids.pop()
        self.states.pop()

    # ---- in-place updates ---------------------------------------------------------------------
    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        self.states[row].output_token_ids.append(token_id)

    # ---- sampling -----------------------------------------------------------------------------
    def sampling_metadata(self, rows: np.ndarray, vocab_size: int, device: torch.device,
                          draft_prefixes: list[list[int]] | None = None,
                          grammar: GrammarBitmask | None = None) -> SamplingMetadata:
        """Sampling tensors for `rows` (logits row i belongs to batch row rows[i]; a request verifying drafts
        has one row per scored position, draft_prefixes[i] being the drafts before it): dense values by
        array indexing; per-row Python only when some row needs a logits processor."""
        states = [self.states[r] for r in rows]
        dense = DenseSamplingParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                                    [s.sampling_params.logprobs for s in states])
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        sparse = None
        if any(s.needs_logits_processing for s in states):
            sparse = [s.sampling_row(draft_prefixes[i] if draft_prefixes else None) for i, s in enumerate(states)]
        return SamplingMetadata.assemble(dense, generators, sparse, vocab_size, device, grammar)
