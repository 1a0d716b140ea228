"""ModelRunner: SchedulerOutput (a diff) -> the persistent input batch -> one forward pass -> sampled tokens.

It owns the tensors (the model, the KV pool) and the per-request state the worker keeps (tokens, seeded
generators, block tables: worker/input_batch.py). It never touches scheduler state: it returns a
ModelRunnerOutput, which the scheduler applies in `update`.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from kvserve.sample.sampler import DEFAULT_LOGPROBS_MODE, Sampler
from kvserve.spec_decode.proposer import Proposer
from kvserve.worker.cuda_graph import CudaGraphRunner
from kvserve.worker.input_batch import CachedRequestState, InputBatch
from kvserve.worker.kv_connector import ConnectorStep, drop_samples
from kvserve.worker.kv_pool import KVPool
from kvserve.worker.lora_manager import LoRAManager
from kvserve.worker.sampling import sample_step
from kvserve.worker.step_inputs import StepInputs, build_step_inputs


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec, max_num_reqs: int,
                 max_model_len: int, device: torch.device, proposer: Proposer | None = None,
                 lora: LoRAManager | None = None, samples: bool = True, logprobs_mode: str = DEFAULT_LOGPROBS_MODE):
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
        self.sampler = Sampler(logprobs_mode)
        self.cuda_graphs: CudaGraphRunner | None = None
        """Decode-only steps by graph replay (CUDA, unless --enforce-eager): set by the worker after capture."""
        self.forward_s = 0.0
        """Seconds spent in the model's forward pass and LM head so far (the rest of a step is overhead)."""
        self.kv_connector: ConnectorStep | None = None
        """--kv-transfer-config: the worker-side KV connector's calls around each step, set by the worker."""

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_connector is None:
            return self._execute(out)
        result = self._execute(out)
        result.kv_connector_output = self.kv_connector.finish(out)
        return result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        step_start = time.perf_counter()
        self.update_states(out)
        kv_failed = set() if self.kv_connector is None else self.kv_connector.begin(out, self.batch)
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
        result = sample_step(self.sampler, self.batch, logits, inputs, self.vocab_size, self.device)
        result.prompt_logprobs = prompt_logprobs
        if kv_failed:
            drop_samples(result, kv_failed)
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
            state = CachedRequestState(req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                                       sampling_params=new.sampling_params, eos_token_ids=new.eos_token_ids,
                                       generator=generator, num_computed_tokens=new.num_computed_tokens,
                                       lora_request=new.lora_request)
            self.requests[new.req_id] = state
            batch.add(state, new.block_ids)
            if new.sampling_params.prompt_logprobs is not None and len(new.prompt_token_ids) > 1:
                self.prompt_logprob_req_ids.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_blocks, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                         cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = computed
            if resumed:
                state.num_draft_computed = 0  # new blocks: the draft's K/V went with the old ones
                batch.add(state, new_blocks)
                continue
            row = batch.index[req_id]
            kept = cached.num_kept_blocks.get(req_id)
            if kept is not None:  # rejected drafts gave blocks back
                batch.num_blocks[row] = kept
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = computed

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's model inputs (worker/step_inputs.py), after update_states applied the diff."""
        long_switch = getattr(getattr(self.model, "rope", None), "long_switch", None)  # longrope models only
        return build_step_inputs(self.batch, out, self.spec.block_size, self.device, long_switch)

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
