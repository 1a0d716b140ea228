"""One step's model inputs, built from the persistent input batch and the scheduler's diff: token ids,
positions, slot mapping, attention metadata and which hidden-state rows sample.

The batch order is the scheduler's (`SchedulerOutput.num_scheduled_tokens`: decodes first, the attention
backends' contract); it is not sorted again here. Everything is array indexing over InputBatch; the only
per-request Python is over requests verifying drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.kv_cache.layout import slot_mapping
from kvserve.sample.metadata import GrammarBitmask
from kvserve.core_types import SchedulerOutput
from kvserve.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """One step's flattened batch (decodes first)."""

    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64 (the RoPE table's rows: rope_positions)
    attn: CommonAttentionMetadata
    logits_indices: torch.Tensor     # [N] int64: rows of the hidden states that sample
    sample_rows: np.ndarray          # [N] batch row of each logits row
    sample_req_ids: list[str]        # [S] the sampling requests, in logits order
    num_logits: np.ndarray           # [S] logits rows per sampling request: 1 + its drafts
    drafts: list[list[int]]          # [S] the drafts each sampling request verifies (most have none)
    token_lora_ids: np.ndarray       # [T] each token's LoRA adapter id (0: the base model)
    rows: np.ndarray                 # [B] batch row of each request, in step order
    query_starts: np.ndarray         # [B] index in [T] of each request's first token
    grammar: GrammarBitmask | None = None
    """Structured outputs: allowed tokens per logits row of the constrained requests."""


@dataclass
class AttentionRows:
    """The attention batch: one row per request, except that each scored draft position of a request
    verifying drafts is a row of its own (a decode: query length 1, context up to itself)."""

    query_lens: np.ndarray   # [A]
    seq_lens: np.ndarray     # [A]
    batch_rows: np.ndarray   # [A] InputBatch row of each attention row
    req_idx: np.ndarray      # [A] step index of each attention row's request


def step_order(out: SchedulerOutput) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The step's requests in batch order, their query lengths [B] and draft counts [B]."""
    spec = out.scheduled_spec_decode_tokens
    req_ids = list(out.num_scheduled_tokens)
    q_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))     # [B]
    num_drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64,
                             count=len(req_ids)) if spec else np.zeros(len(req_ids), dtype=np.int64)  # [B]
    is_prefill = (q_lens != 1) & (num_drafts == 0)
    assert not (is_prefill[:-1] & ~is_prefill[1:]).any(), "the scheduler sends decodes first"
    return req_ids, q_lens, num_drafts


def write_drafts(batch: InputBatch, rows: np.ndarray, req_ids: list[str], num_drafts: np.ndarray,
                 spec: dict[str, list[int]]) -> None:
    """Drafts sit in the batch's token array after the request's tokens, uncounted by num_tokens."""
    for i in np.flatnonzero(num_drafts):
        n = batch.num_tokens[rows[i]]
        batch.token_ids[rows[i], n:n + num_drafts[i]] = spec[req_ids[i]]


def token_positions(computed: np.ndarray, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query token [T]: its request's step index and its position; and the cumulative query lengths [B]."""
    cu = np.cumsum(q_lens)
    num_tokens = int(cu[-1])
    req_idx = np.repeat(np.arange(len(q_lens)), q_lens)                                             # [T]
    positions = computed[req_idx] + np.arange(num_tokens) - (cu - q_lens)[req_idx]                  # [T]
    return req_idx, positions, cu


def rope_positions(batch: InputBatch, rows: np.ndarray, req_idx: np.ndarray, positions: np.ndarray,
                   long_switch: tuple[int, int] | None) -> np.ndarray:
    """The rows of the model's RoPE tables the tokens read: their positions, except under longrope
    (`long_switch` (M, offset): models/llama.py RotaryEmbedding), where the tokens of a request whose prompt
    is longer than M read the long-factor table, `offset` rows down."""
    if long_switch is None:
        return positions
    original, offset = long_switch
    long = np.fromiter((len(batch.states[r].prompt_token_ids) > original for r in rows), dtype=np.int64,
                       count=len(rows))                                                              # [B]
    return positions + offset * long[req_idx]


def attention_rows(req_idx: np.ndarray, positions: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                   rows: np.ndarray, num_drafts: np.ndarray) -> AttentionRows:
    """The attention batch of a step; verification runs through the decode kernel (see AttentionRows)."""
    if not num_drafts.any():
        return AttentionRows(q_lens, seq_lens, rows, np.arange(len(rows)))
    spec_tok = num_drafts[req_idx] > 0                                                              # [T]
    starts = np.flatnonzero(np.concatenate(([True], spec_tok[1:] | spec_tok[:-1]
                                            | (req_idx[1:] != req_idx[:-1]))))
    attn_req = req_idx[starts]                                                                      # [A]
    attn_q = np.diff(np.append(starts, len(req_idx)))                                               # [A]
    return AttentionRows(attn_q, positions[starts] + attn_q, rows[attn_req], attn_req)


def attention_metadata(batch: InputBatch, attn: AttentionRows, slots: np.ndarray, verifies: bool,
                       block_size: int, device: torch.device) -> CommonAttentionMetadata:
    """The backends' metadata for `attn`; `verifies`: some request verifies drafts (decode groups)."""
    attn_cu = np.cumsum(attn.query_lens)
    max_blocks = int(-(-attn.seq_lens.max() // block_size))
    num_decodes = int(np.count_nonzero(attn.query_lens == 1))
    groups = None
    if num_decodes and verifies:  # which decode rows are one request's consecutive tokens
        dec = attn.req_idx[:num_decodes]
        firsts = np.flatnonzero(np.concatenate(([True], dec[1:] != dec[:-1])))
        groups = torch.from_numpy(np.append(firsts, num_decodes)).to(device)
    table = np.ascontiguousarray(batch.block_table[attn.batch_rows, :max_blocks])
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(np.concatenate(([0], attn_cu))).to(device),
        seq_lens=torch.from_numpy(attn.seq_lens).to(device), block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        block_size=block_size, query_lens_cpu=attn.query_lens.tolist(), seq_lens_cpu=attn.seq_lens.tolist(),
        decode_groups=groups)


def logits_layout(cu: np.ndarray, samples: np.ndarray,
                  num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampling requests' step indices [S], their logits rows (1 + drafts) [S], and the hidden-state rows
    that sample [N]: each sampling request's last 1 + drafts query tokens."""
    sampling = np.flatnonzero(samples)                                                              # [S]
    num_logits = num_drafts[sampling] + 1                                                           # [S]
    ends = np.repeat(cu[sampling], num_logits)
    within = np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    logits_indices = ends - np.repeat(num_logits, num_logits) + within                              # [N]
    return sampling, num_logits, logits_indices


def grammar_rows(out: SchedulerOutput, sample_ids: list[str], num_logits: np.ndarray) -> GrammarBitmask | None:
    """The scheduler's bitmask rows (one per scored position of each constrained request) laid out as the
    logits rows: unconstrained rows allow everything and are left out of row_idx."""
    first = out.structured_output_request_ids
    starts = np.concatenate(([0], np.cumsum(num_logits)))
    dst, src = [], []
    for i, req_id in enumerate(sample_ids):
        row = first.get(req_id)
        if row is not None:
            n = int(num_logits[i])
            dst.extend(range(int(starts[i]), int(starts[i]) + n))
            src.extend(range(row, row + n))
    if not dst:
        return None
    bitmask = torch.full((int(starts[-1]), out.grammar_bitmask.shape[1]), -1, dtype=torch.int32)  # [N, W]
    bitmask[dst] = out.grammar_bitmask[src]
    return GrammarBitmask(bitmask, dst)


def build_step_inputs(batch: InputBatch, out: SchedulerOutput, block_size: int, device: torch.device,
                      long_switch: tuple[int, int] | None = None) -> StepInputs:
    """The model's inputs for the step `out` describes (its requests' rows are in `batch`); long_switch: the
    model's longrope switch (rope_positions)."""
    spec = out.scheduled_spec_decode_tokens
    req_ids, q_lens, num_drafts = step_order(out)
    rows = np.fromiter((batch.index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))          # [B]
    write_drafts(batch, rows, req_ids, num_drafts, spec)
    computed = batch.num_computed_tokens[rows]                                                      # [B]
    req_idx, positions, cu = token_positions(computed, q_lens)
    token_rows = rows[req_idx]                                                                      # [T]
    input_ids = batch.token_ids[token_rows, positions]                                             # [T]
    slots = slot_mapping(batch.block_table, token_rows, positions, block_size)                     # [T]
    seq_lens = computed + q_lens                                                                    # [B]
    samples = seq_lens >= batch.num_tokens[rows]  # the step reaches the request's newest token
    attn = attention_rows(req_idx, positions, q_lens, seq_lens, rows, num_drafts)
    meta = attention_metadata(batch, attn, slots, bool(num_drafts.any()), block_size, device)
    sampling, num_logits, logits_indices = logits_layout(cu, samples, num_drafts)
    sample_ids = [req_ids[i] for i in sampling]
    rope_rows = rope_positions(batch, rows, req_idx, positions, long_switch)               # [T]
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device), positions=torch.from_numpy(rope_rows).to(device),
        attn=meta, logits_indices=torch.from_numpy(logits_indices).to(device),
        sample_rows=np.repeat(rows[sampling], num_logits), sample_req_ids=sample_ids, num_logits=num_logits,
        drafts=[spec.get(r, []) for r in sample_ids] if spec else [[] for _ in sample_ids],
        token_lora_ids=batch.lora_int_id[token_rows], rows=rows, query_starts=cu - q_lens,
        grammar=grammar_rows(out, sample_ids, num_logits) if out.grammar_bitmask is not None else None)
