"""ModelRunner: SchedulerOutput -> one forward pass over the flattened batch -> sampled tokens.

It owns the tensors (weights, the KV pool) and never mutates scheduler state: it reads the scheduled
requests and returns a ModelRunnerOutput, which the scheduler applies in `update`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.metadata import SamplingMetadata, SamplingRow
from kvserve.sample.sampler import RowLogprobs, Sampler
from kvserve.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, RowLogprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Request id -> why sampling failed for that request alone (it gets no token)."""


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.vocab_size = cfg.vocab_size
        shape = backend.kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One allocation, viewed per layer (nano-vllm): no per-layer fragmentation.
        self.kv_pool = torch.zeros((cfg.num_hidden_layers, *shape), dtype=dtype, device=device)
        self.kv_caches = list(self.kv_pool.unbind(0))
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.scheduled:
            return ModelRunnerOutput()
        input_ids, positions, common, logits_indices = self._prepare_inputs(out)
        attn_meta = self.backend.build_metadata(common)
        hidden = self.model(input_ids, positions, self.kv_caches, attn_meta)  # [T, hidden]
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[logits_indices])          # [N, vocab]
        rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                            s.request.generator, s.request.eos_token_ids) for s in sampling]
        ids = [s.request.request_id for s in sampling]
        return sample_isolated(self.sampler, logits, rows, ids, self.vocab_size)

    def _prepare_inputs(self, out: SchedulerOutput):
        token_ids: list[int] = []
        starts, query_lens, seq_lens, tables = [], [], [], []
        logits_indices = []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            token_ids.extend(req.token_slice(start, start + s.num_tokens))
            starts.append(start)
            query_lens.append(s.num_tokens)
            seq_lens.append(start + s.num_tokens)
            tables.append(s.block_ids)
            if s.samples:
                logits_indices.append(len(token_ids) - 1)
        num_decodes = sum(1 for q in query_lens if q == 1)  # decodes come first (scheduler contract)
        max_blocks = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        req_idx = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)                # [T]
        positions = (torch.tensor(starts, dtype=torch.long)[req_idx]
                     + torch.arange(len(token_ids)) - query_start_loc[:-1][req_idx])             # [T]
        slot_mapping = (block_table[req_idx, positions // self.block_size] * self.block_size
                        + positions % self.block_size)                                          # [T]
        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(dev), seq_lens=torch.tensor(seq_lens, device=dev),
            block_table=block_table.to(dev), slot_mapping=slot_mapping.to(dev), num_decodes=num_decodes,
            num_decode_tokens=num_decodes, block_size=self.block_size, query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens)
        return (torch.tensor(token_ids, dtype=torch.long, device=dev), positions.to(dev), common,
                torch.tensor(logits_indices, dtype=torch.long, device=dev))


def sample_isolated(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str],
                    vocab_size: int) -> ModelRunnerOutput:
    """Sample the batch in one go; if that raises, sample each row alone so that the rows that raise
    fail alone (their request ids land in `errors`) and every other row still gets its token.

    NOTE: seeded generators are restored before the retry, so a seeded row's token is the same whether
    or not a batch mate failed."""
    states = {i: row.generator.get_state() for i, row in enumerate(rows) if row.generator is not None}
    try:
        result = sampler(logits, SamplingMetadata.build(rows, vocab_size, logits.device))
    except Exception:
        logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(rows))
    else:
        return ModelRunnerOutput(dict(zip(ids, result.sampled_token_ids)),
                                 {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None})
    out = ModelRunnerOutput()
    for i, (row, rid) in enumerate(zip(rows, ids)):
        if i in states:
            row.generator.set_state(states[i])
        try:
            one = sampler(logits[i:i + 1], SamplingMetadata.build([row], vocab_size, logits.device))
        except Exception as e:
            out.errors[rid] = f"sampling failed: {type(e).__name__}: {e}"
            continue
        out.sampled_token_ids[rid] = one.sampled_token_ids[0]
        if one.logprobs[0] is not None:
            out.logprobs[rid] = one.logprobs[0]
    return out
