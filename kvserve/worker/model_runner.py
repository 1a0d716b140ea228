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
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec, slot_mapping
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.metadata import GrammarBitmask
from kvserve.sample.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from kvserve.sample.rejection_sampler import accept_prefix, rewind_generator
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.proposer import Proposer
from kvserve.worker.cuda_graph import CudaGraphRunner
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.worker.kv_pool import KVPool
from kvserve.worker.lora_manager import LoRAManager

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's flattened batch (decodes first)."""

    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
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


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec, max_num_reqs: int,
                 max_model_len: int, device: torch.device, proposer: Proposer | None = None,
                 lora: LoRAManager | None = None, samples: bool = True):
        self.model = model
        self.samples = samples
        """False on a tensor-parallel follower rank: it runs the forward pass and the LM head (their
        collectives need every rank) but the driver samples; the driver's tokens reach it through
        append_sampled before the next step."""
        self.proposer = proposer
        self.lora = lora
        """Adapter slots (enable_lora): set before each forward pass with the step's token -> adapter map."""
        self.backend = backend
        self.spec = spec
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.kv_pool = KVPool.allocate(spec, backend, device)
        self.kv_caches = self.kv_pool.layers
        max_blocks_per_req = -(-max_model_len // spec.block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks_per_req)
        self.requests: dict[str, CachedRequestState] = {}  # every unfinished request the worker has seen
        self.prompt_logprob_req_ids: set[str] = set()
        """Requests that asked for prompt logprobs and still have prompt positions to describe: the only
        ones a step looks at for them (a batch without any pays nothing)."""
        self.sampler = Sampler()
        self.cuda_graphs: CudaGraphRunner | None = None
        """Decode-only steps by graph replay (CUDA, unless --enforce-eager): set by the worker after capture."""
        self.forward_s = 0.0
        """Seconds spent in the model's forward pass and LM head so far (the rest of a step is overhead)."""

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        step_start = time.perf_counter()
        self.update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(out)
        if self.lora is not None:
            self.lora.set_step(inputs.token_lora_ids, self._step_adapters(out))
        start = time.perf_counter()
        hidden = None if self.cuda_graphs is None else self.cuda_graphs.run(inputs.input_ids, inputs.positions,
                                                                             inputs.attn)
        if hidden is None:
            attn_meta = self.backend.build_metadata(inputs.attn)
            start = time.perf_counter()
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn_meta)  # [T, hidden]
        prompt_logprobs = self.prompt_logprobs(out, inputs, hidden) if self.prompt_logprob_req_ids else {}
        if not inputs.sample_req_ids:
            self.forward_s += time.perf_counter() - start
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, execute_s=time.perf_counter() - step_start)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])                 # [N, vocab]
        self.forward_s += time.perf_counter() - start
        if not self.samples:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        result = self.sample(logits, inputs)
        result.prompt_logprobs = prompt_logprobs
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            row = self.batch.index[req_id]
            for token in tokens:
                self.batch.append_token(row, token)
        if out.num_draft_tokens_to_propose and self.proposer is not None:
            result.spec_token_ids = self.propose(out.num_draft_tokens_to_propose, result.req_ids)
        result.execute_s = time.perf_counter() - step_start
        return result

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """A follower rank: the tokens the driver's previous step gave each request (what `execute`
        appends on the driver itself), applied before this step's diff."""
        batch = self.batch
        for req_id, tokens in sampled.items():
            row = batch.index[req_id]  # NOTE: it sampled in the previous step, so it is in the batch
            for token in tokens:
                batch.append_token(row, token)

    def _step_adapters(self, out: SchedulerOutput) -> dict:
        """Adapter id -> LoRARequest of the requests in this step (at most max_loras: the scheduler's rule)."""
        adapters = {}
        for req_id in out.num_scheduled_tokens:
            lora = self.requests[req_id].lora_request
            if lora is not None:
                adapters[lora.lora_int_id] = lora
        return adapters

    def propose(self, wanted: dict[str, int], sampled_req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for the next step of the requests that sampled now and that the scheduler asked for."""
        req_ids = [r for r in sampled_req_ids if wanted.get(r)]
        if not req_ids:
            return {}
        batch = self.batch
        rows = np.fromiter((batch.index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        ks = np.fromiter((wanted[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        drafts = self.proposer.propose(batch, rows, ks)
        return {r: d for r, d in zip(req_ids, drafts) if d}

    # ---- the diff -> the persistent batch -------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprob_req_ids.discard(req_id)
            if req_id in batch.index:
                batch.remove(req_id)
        for req_id in out.preempted_req_ids:  # NOTE: the state stays: its tokens and seeded generator resume
            if req_id in batch.index:
                batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
            state = CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_ids,
                                       generator, list(new.block_ids), new.num_computed_tokens,
                                       lora_request=new.lora_request)
            self.requests[new.req_id] = state
            batch.add(state)
            if new.sampling_params.prompt_logprobs is not None and len(new.prompt_token_ids) > 1:
                self.prompt_logprob_req_ids.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_blocks, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                         cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = computed
            if resumed:
                state.block_ids = list(new_blocks)
                state.num_draft_computed = 0  # new blocks: the draft's K/V went with the old ones
                batch.add(state)
                continue
            row = batch.index[req_id]
            kept = cached.num_kept_blocks.get(req_id)
            if kept is not None:  # rejected drafts gave blocks back
                del state.block_ids[kept:]
                batch.num_blocks[row] = kept
            state.block_ids.extend(new_blocks)
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = computed

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        batch, bs = self.batch, self.spec.block_size
        spec = out.scheduled_spec_decode_tokens
        req_ids = list(out.num_scheduled_tokens)
        q_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))   # [B]
        num_drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64,
                                 count=len(req_ids)) if spec else np.zeros(len(req_ids), dtype=np.int64)
        # decodes first (the backends' contract); a request verifying drafts is a run of decodes
        order = np.argsort((q_lens != 1) & (num_drafts == 0), kind="stable")
        req_ids = [req_ids[i] for i in order]
        q_lens, num_drafts = q_lens[order], num_drafts[order]
        rows = np.fromiter((batch.index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))      # [B]
        for i in np.flatnonzero(num_drafts):  # drafts sit after the request's tokens, uncounted
            n = batch.num_tokens[rows[i]]
            batch.token_ids[rows[i], n:n + num_drafts[i]] = spec[req_ids[i]]
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
        if num_drafts.any():
            # Each scored draft position is a decode of its own (query length 1, context up to itself), so
            # verification runs through the decode kernel: the attention batch has one row per such token.
            spec_tok = num_drafts[req_idx] > 0                                                          # [T]
            starts = np.flatnonzero(np.concatenate(([True], spec_tok[1:] | spec_tok[:-1]
                                                    | (req_idx[1:] != req_idx[:-1]))))
            attn_req = req_idx[starts]                                                                  # [A]
            attn_q = np.diff(np.append(starts, num_tokens))                                            # [A]
            attn_seq = positions[starts] + attn_q                                                       # [A]
            attn_rows = rows[attn_req]
        else:
            attn_q, attn_seq, attn_rows = q_lens, seq_lens, rows
        attn_cu = np.cumsum(attn_q)
        max_blocks = int(-(-attn_seq.max() // bs))
        num_decodes = int(np.count_nonzero(attn_q == 1))
        dev = self.device
        groups = None
        if num_decodes and num_drafts.any():  # which decode rows are one request's consecutive tokens
            dec = attn_req[:num_decodes]
            firsts = np.flatnonzero(np.concatenate(([True], dec[1:] != dec[:-1])))
            groups = torch.from_numpy(np.append(firsts, num_decodes)).to(dev)
        attn = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], attn_cu))).to(dev),
            seq_lens=torch.from_numpy(attn_seq).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(batch.block_table[attn_rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev), num_decodes=num_decodes, num_decode_tokens=num_decodes,
            block_size=bs, query_lens_cpu=attn_q.tolist(), seq_lens_cpu=attn_seq.tolist(), decode_groups=groups)
        sampling = np.flatnonzero(samples)                                                              # [S]
        num_logits = num_drafts[sampling] + 1                                                           # [S]
        ends = np.repeat(cu[sampling], num_logits)
        within = np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        logits_indices = ends - np.repeat(num_logits, num_logits) + within                              # [N]
        sample_ids = [req_ids[i] for i in sampling]
        return StepInputs(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), attn,
                          torch.from_numpy(logits_indices).to(dev), np.repeat(rows[sampling], num_logits),
                          sample_ids, num_logits, [spec.get(r, []) for r in sample_ids] if spec else
                          [[] for _ in sample_ids], batch.lora_int_id[token_rows], rows, cu - q_lens,
                          _grammar_rows(out, sample_ids, num_logits) if out.grammar_bitmask is not None else None)

    # ---- prompt logprobs ------------------------------------------------------------------------
    def prompt_logprobs(self, out: SchedulerOutput, inputs: StepInputs,
                        hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        """What this step's prompt chunks say about their prompt tokens (sample/prompt_logprobs.py), for the
        requests that asked; one LM-head pass over their rows of `hidden` [T, hidden_size]. A position
        described before a preemption is not described again when the recompute reaches it."""
        batch = self.batch
        plan = []  # (req_id, state, first position, end position, its row in hidden)
        starts = None
        for req_id in self.prompt_logprob_req_ids:
            num_new = out.num_scheduled_tokens.get(req_id)
            if num_new is None:
                continue
            if starts is None:
                starts = np.empty(batch.num_reqs, dtype=np.int64)                              # [R]
                starts[inputs.rows] = inputs.query_starts
            row = batch.index[req_id]
            state = batch.states[row]
            computed = int(batch.num_computed_tokens[row])
            # NOTE: such a request never reads the prefix cache (Request.skip_reading_prefix_cache), so every
            # position it has not described yet is computed in some step.
            assert computed <= state.num_prompt_logprobs, f"{req_id}: prompt positions would be skipped"
            first = state.num_prompt_logprobs
            end = min(computed + num_new, len(state.prompt_token_ids) - 1)
            if end > first:
                plan.append((req_id, state, first, end, int(starts[row]) + first - computed))
        if not plan:
            return {}
        dev = hidden.device
        hidden_rows = np.concatenate([np.arange(h, h + end - first) for _, _, first, end, h in plan])     # [M]
        targets = np.concatenate([batch.token_ids[batch.index[r], first + 1:end + 1]
                                  for r, _, first, end, _ in plan])                                    # [M]
        num_top = max(state.sampling_params.prompt_logprobs for _, state, *_ in plan)
        ids, logprobs, ranks = compute_prompt_logprobs(
            self.model.compute_logits, hidden[torch.from_numpy(hidden_rows).to(dev)],
            torch.from_numpy(targets).to(dev), num_top)
        chunks, lo = {}, 0
        for req_id, state, first, end, _ in plan:
            hi, k = lo + end - first, 1 + state.sampling_params.prompt_logprobs
            chunks[req_id] = PromptLogprobsChunk(first + 1, np.ascontiguousarray(ids[lo:hi, :k]),
                                                 np.ascontiguousarray(logprobs[lo:hi, :k]), ranks[lo:hi].copy())
            state.num_prompt_logprobs = end
            if end == len(state.prompt_token_ids) - 1:
                self.prompt_logprob_req_ids.discard(req_id)
            lo = hi
        return chunks

    # ---- sampling -------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """Sample every logits row in one go, then keep each request's accepted drafts (see
        sample/rejection_sampler.py). If the batch raises, each request is sampled alone so that the requests
        that raise fail alone (their ids land in `errors`) and every other request still gets its tokens.

        NOTE: seeded generators are restored before the retry, so a seeded request's tokens are the same
        whether or not a batch mate failed."""
        rows, ids, counts = inputs.sample_rows, inputs.sample_req_ids, inputs.num_logits
        offsets = np.concatenate(([0], np.cumsum(counts)))
        prefixes = _draft_prefixes(inputs.drafts)
        states = [self.batch.states[self.batch.index[r]] for r in ids]
        saved = {i: s.generator.get_state() for i, s in enumerate(states) if s.generator is not None}
        try:
            meta = self.batch.sampling_metadata(rows, self.vocab_size, logits.device, prefixes, inputs.grammar)
            result = self.sampler(logits, meta)
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its requests one by one", len(ids))
        else:
            drew = {i for i in saved if int(offsets[i]) in meta.generators}
            return self._accept(ids, inputs.drafts, offsets, result.sampled_token_ids, result.logprobs, states,
                                saved, drew)
        out, logprobs = ModelRunnerOutput(), []
        for i, req_id in enumerate(ids):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            if i in saved:
                states[i].generator.set_state(saved[i])
            try:
                meta = self.batch.sampling_metadata(rows[lo:hi], self.vocab_size, logits.device,
                                                    prefixes[lo:hi] if prefixes else None,
                                                    inputs.grammar.select(lo, hi) if inputs.grammar else None)
                one = self.sampler(logits[lo:hi], meta)
            except Exception as e:
                out.errors[req_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            part = self._accept([req_id], [inputs.drafts[i]], np.array([0, hi - lo]), one.sampled_token_ids,
                                one.logprobs, [states[i]], {0: saved[i]} if i in saved else {},
                                {0} if i in saved and 0 in meta.generators else set())
            out.req_ids += part.req_ids
            out.sampled_token_ids += part.sampled_token_ids
            logprobs.append(part.logprobs[0] if part.logprobs else None)
        if any(lp is not None for lp in logprobs):
            out.logprobs = logprobs
        return out

    def _accept(self, ids: list[str], drafts: list[list[int]], offsets: np.ndarray, tokens: list[int],
                logprobs: list, states: list[CachedRequestState], saved: dict[int, torch.Tensor],
                drew: set[int]) -> ModelRunnerOutput:
        """Per request: its samples at the scored positions -> the tokens it gets."""
        out_tokens, out_logprobs = [], []
        for i, draft in enumerate(drafts):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            n = accept_prefix(tokens[lo:hi], draft) + 1 if draft else 1
            out_tokens.append(tokens[lo:lo + n])
            out_logprobs.append(None if logprobs[lo] is None else logprobs[lo:lo + n])
            if i in drew and lo + n < hi:  # positions after the first rejection give their draws back
                rewind_generator(states[i].generator, saved[i], n, self.vocab_size, self.device)
        wanted = any(lp is not None for lp in out_logprobs)
        return ModelRunnerOutput(req_ids=list(ids), sampled_token_ids=out_tokens,
                                 logprobs=out_logprobs if wanted else None)


def _grammar_rows(out: SchedulerOutput, sample_ids: list[str], num_logits: np.ndarray) -> GrammarBitmask | None:
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


def _draft_prefixes(drafts: list[list[int]]) -> list[list[int]] | None:
    """Per logits row: the drafts before its position (what the target conditions on there)."""
    if not any(drafts):
        return None
    return [d[:j] for d in drafts for j in range(len(d) + 1)]
