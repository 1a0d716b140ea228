"""The model runner's input building alone: a real InputBatch and a SchedulerOutput -> StepInputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.core_types import CachedRequestData, SchedulerOutput
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.worker.step_inputs import (attention_rows, build_step_inputs, grammar_rows, logits_layout, step_order,
                                        token_positions)

BS = 4


def _batch(*reqs) -> InputBatch:
    """reqs: (req_id, prompt, outputs, computed, blocks)."""
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_blocks_per_req=8)
    for rid, prompt, outputs, computed, blocks in reqs:
        state = CachedRequestState(req_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(),
                                   eos_token_ids=(), generator=None, num_computed_tokens=computed)
        state.output_token_ids = list(outputs)
        batch.add(state, blocks)
    return batch


def _out(num_scheduled: dict[str, int], spec: dict[str, list[int]] | None = None, **kw) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
                           scheduled_spec_decode_tokens=spec or {}, **kw)


def _mixed():
    # "p" is added first, so batch rows differ from the step's order
    batch = _batch(("p", [60, 61, 62, 63, 64, 65], [], 0, [6, 7]),
                   ("d", [1, 2, 3, 4, 5], [90], 5, [2, 3]),
                   ("v", [11, 12, 13, 14], [91], 4, [4, 5]))
    return batch, _out({"d": 1, "v": 3, "p": 6}, {"v": [50, 51]})


def test_a_mixed_step_of_a_decode_a_verification_and_a_prefill():
    batch, out = _mixed()
    inputs = build_step_inputs(batch, out, BS, torch.device("cpu"))
    assert inputs.positions.tolist() == [5, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert inputs.input_ids.tolist() == [90, 91, 50, 51, 60, 61, 62, 63, 64, 65]
    assert inputs.attn.slot_mapping.tolist() == [13, 20, 21, 22, 24, 25, 26, 27, 28, 29]
    assert inputs.rows.tolist() == [1, 2, 0] and inputs.query_starts.tolist() == [0, 1, 4]
    # each scored draft position is a decode row of its own
    attn = inputs.attn
    assert attn.query_lens_cpu == [1, 1, 1, 1, 6] and attn.seq_lens_cpu == [6, 5, 6, 7, 6]
    assert attn.num_decodes == 4 and attn.query_start_loc.tolist() == [0, 1, 2, 3, 4, 10]
    assert attn.decode_groups.tolist() == [0, 1, 4]
    assert attn.block_table.tolist() == [[2, 3], [4, 5], [4, 5], [4, 5], [6, 7]]
    assert inputs.sample_req_ids == ["d", "v", "p"] and inputs.num_logits.tolist() == [1, 3, 1]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 9] and inputs.sample_rows.tolist() == [1, 2, 2, 2, 0]
    assert inputs.drafts == [[], [50, 51], []] and inputs.token_lora_ids.tolist() == [0] * 10
    assert inputs.grammar is None
    # the drafts sit after the request's tokens in the batch, uncounted
    assert batch.token_ids[2, :7].tolist() == [11, 12, 13, 14, 91, 50, 51] and batch.num_tokens[2] == 5


def test_a_prompt_chunk_short_of_the_end_does_not_sample():
    batch = _batch(("d", [1, 2, 3], [9], 3, [1]), ("p", list(range(20, 30)), [], 4, [2, 3, 4]))
    inputs = build_step_inputs(batch, _out({"d": 1, "p": 4}), BS, torch.device("cpu"))
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7] and inputs.attn.decode_groups is None
    assert inputs.sample_req_ids == ["d"] and inputs.logits_indices.tolist() == [0]
    assert inputs.attn.slot_mapping.tolist() == [7, 12, 13, 14, 15]


def test_the_scheduler_order_is_kept_and_checked():
    req_ids, q_lens, num_drafts = step_order(_out({"a": 1, "b": 3, "c": 5}, {"b": [1, 2]}))
    assert req_ids == ["a", "b", "c"] and q_lens.tolist() == [1, 3, 5] and num_drafts.tolist() == [0, 2, 0]
    with pytest.raises(AssertionError, match="decodes first"):
        step_order(_out({"prefill": 5, "decode": 1}))


def test_token_positions_attention_rows_and_logits_layout():
    req_idx, positions, cu = token_positions(np.array([7, 0]), np.array([3, 2]))
    assert req_idx.tolist() == [0, 0, 0, 1, 1] and positions.tolist() == [7, 8, 9, 0, 1] and cu.tolist() == [3, 5]
    rows = attention_rows(req_idx, positions, np.array([3, 2]), np.array([10, 2]), np.array([5, 6]),
                          np.array([2, 0]))
    assert rows.query_lens.tolist() == [1, 1, 1, 2] and rows.seq_lens.tolist() == [8, 9, 10, 2]
    assert rows.batch_rows.tolist() == [5, 5, 5, 6] and rows.req_idx.tolist() == [0, 0, 0, 1]
    sampling, num_logits, indices = logits_layout(cu, np.array([True, True]), np.array([2, 0]))
    assert sampling.tolist() == [0, 1] and num_logits.tolist() == [3, 1] and indices.tolist() == [0, 1, 2, 4]


def test_grammar_rows_lay_the_bitmask_out_as_the_logits_rows():
    bitmask = torch.tensor([[1], [2], [3]], dtype=torch.int32)  # "b": rows 0..2 (2 drafts)
    out = _out({"a": 1, "b": 3}, {"b": [4, 5]}, grammar_bitmask=bitmask, structured_output_request_ids={"b": 0})
    g = grammar_rows(out, ["a", "b"], np.array([1, 3]))
    assert g.row_idx == [1, 2, 3] and g.bitmask.tolist() == [[-1], [1], [2], [3]]
    assert grammar_rows(out, ["a"], np.array([1])) is None
