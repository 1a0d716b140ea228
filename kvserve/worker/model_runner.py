"""ModelRunner: SchedulerOutput (a diff) -> the persistent input batch -> one forward pass -> sampled tokens.

It owns the tensors (the model, the KV pool) and the per-request state the worker keeps (tokens, seeded
generators, block tables: worker/input_batch.py). It never touches scheduler state: it returns a
ModelRunnerOutput, which the scheduler applies in `update`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from kvserve.kv_cache.layout import KVCacheSpec, slot_mapping
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.sampler import Sampler
from kvserve.scheduler.output import SchedulerOutput
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's flattened batch (decodes first)."""

    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    attn: CommonAttentionMetadata
    logits_indices: torch.Tensor     # [N] int64: rows of the hidden states that sample
    sample_rows: np.ndarray          # [N] batch rows of the sampling requests
    sample_req_ids: list[str]        # [N]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec, max_num_reqs: int,
                 max_model_len: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.spec = spec
        self.device = device
        self.vocab_size = model.config.vocab_size
        shape = backend.kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # One allocation, viewed per layer (nano-vllm): no per-layer fragmentation.
        self.kv_pool = torch.zeros((spec.num_layers, *shape), dtype=spec.dtype, device=device)
        self.kv_caches = list(self.kv_pool.unbind(0))
        max_blocks_per_req = -(-max_model_len // spec.block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks_per_req)
        self.requests: dict[str, CachedRequestState] = {}  # every unfinished request the worker has seen
        self.sampler = Sampler()
        self.forward_s = 0.0
        """Seconds spent in the model's forward pass and LM head so far (the rest of a step is overhead)."""

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(out)
        attn_meta = self.backend.build_metadata(inputs.attn)
        start = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn_meta)  # [T, hidden]
        if not inputs.sample_req_ids:
            self.forward_s += time.perf_counter() - start
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.logits_indices])                 # [N, vocab]
        self.forward_s += time.perf_counter() - start
        result = self.sample(logits, inputs)
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            row = self.batch.index[req_id]
            for token in tokens:
                self.batch.append_token(row, token)
        return result

    # ---- the diff -> the persistent batch -------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            if req_id in batch.index:
                batch.remove(req_id)
        for req_id in out.preempted_req_ids:  # NOTE: the state stays: its tokens and seeded generator resume
            if req_id in batch.index:
                batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
            state = CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_ids,
                                       generator, list(new.block_ids), new.num_computed_tokens)
            self.requests[new.req_id] = state
            batch.add(state)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_blocks, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                         cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = computed
            if resumed:
                state.block_ids = list(new_blocks)
                batch.add(state)
                continue
            state.block_ids.extend(new_blocks)
            row = batch.index[req_id]
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = computed

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        batch, bs = self.batch, self.spec.block_size
        req_ids = list(out.num_scheduled_tokens)
        q_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))   # [B]
        order = np.argsort(q_lens != 1, kind="stable")  # decodes first (the backends' contract)
        req_ids = [req_ids[i] for i in order]
        q_lens = q_lens[order]
        rows = np.fromiter((batch.index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))      # [B]
        computed = batch.num_computed_tokens[rows]                                                      # [B]
        cu = np.cumsum(q_lens)
        num_tokens = int(cu[-1])
        req_idx = np.repeat(np.arange(len(rows)), q_lens)                                               # [T]
        positions = computed[req_idx] + np.arange(num_tokens) - (cu - q_lens)[req_idx]                  # [T]
        token_rows = rows[req_idx]
        input_ids = batch.token_ids[token_rows, positions]                                             # [T]
        slots = slot_mapping(batch.block_table, token_rows, positions, bs)                             # [T]
        seq_lens = computed + q_lens                                                                    # [B]
        samples = seq_lens >= batch.num_tokens[rows]  # the step reaches the request's newest token
        max_blocks = int(-(-seq_lens.max() // bs))
        num_decodes = int(np.count_nonzero(q_lens == 1))
        dev = self.device
        attn = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu))).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev), num_decodes=num_decodes, num_decode_tokens=num_decodes,
            block_size=bs, query_lens_cpu=q_lens.tolist(), seq_lens_cpu=seq_lens.tolist())
        sampling = np.flatnonzero(samples)
        return StepInputs(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), attn,
                          torch.from_numpy(cu[sampling] - 1).to(dev), rows[sampling],
                          [req_ids[i] for i in sampling])

    # ---- sampling -------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """Sample the batch in one go; if that raises, sample each row alone so that the rows that raise
        fail alone (their request ids land in `errors`) and every other row still gets its token.

        NOTE: seeded generators are restored before the retry, so a seeded row's token is the same whether
        or not a batch mate failed."""
        rows, ids = inputs.sample_rows, inputs.sample_req_ids
        states = [self.batch.states[r] for r in rows]
        saved = {i: s.generator.get_state() for i, s in enumerate(states) if s.generator is not None}
        try:
            result = self.sampler(logits, self.batch.sampling_metadata(rows, self.vocab_size, logits.device))
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(rows))
        else:
            return _output(ids, result.sampled_token_ids, result.logprobs)
        out = ModelRunnerOutput()
        tokens, logprobs = [], []
        for i, (row, req_id) in enumerate(zip(rows, ids)):
            if i in saved:
                states[i].generator.set_state(saved[i])
            try:
                one = self.sampler(logits[i:i + 1], self.batch.sampling_metadata(rows[i:i + 1], self.vocab_size,
                                                                                 logits.device))
            except Exception as e:
                out.errors[req_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            out.req_ids.append(req_id)
            tokens.append(one.sampled_token_ids[0])
            logprobs.append(one.logprobs[0])
        sampled = _output(out.req_ids, tokens, logprobs)
        sampled.errors = out.errors
        return sampled


def _output(req_ids: list[str], tokens: list[int], logprobs: list) -> ModelRunnerOutput:
    wanted = any(lp is not None for lp in logprobs)
    return ModelRunnerOutput(list(req_ids), [[t] for t in tokens],
                             [None if lp is None else [lp] for lp in logprobs] if wanted else None)
