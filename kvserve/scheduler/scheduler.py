"""Iteration-level scheduler: which requests run this step, with how many tokens each.

There are no prefill and decode phases (vLLM v1's rule): each running request gets
`num_tokens - num_computed_tokens` tokens, clipped to what is left of the token budget, so chunked
prefill, decode and recompute after preemption are one code path. Running requests go first, then
waiting ones in FCFS order. When blocks run out, the most recently admitted running request is
preempted: its blocks are released and it returns to the front of the queue, to be recomputed.
"""
from __future__ import annotations

import time
from collections import deque

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core_types import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.scheduler import spec
from kvserve.scheduler.admission import (AdmissionGates, allocate_for_admission, any_compiling, hold_back_compiling,
                                         running_loras)
from kvserve.scheduler.chunking import ChunkSizer, observe_step_cost
from kvserve.scheduler.core_output import core_output
from kvserve.scheduler.diff import WorkerView, decodes_first
from kvserve.scheduler.grammar import add_grammar_bitmask, advance_grammar, attach_grammar, valid_drafts
from kvserve.scheduler.kv_connector import RemoteLoads, external_hit, first_invalid_block, load_error_message
from kvserve.scheduler.policy import WaitingOrder
from kvserve.scheduler.static_batch import StaticBatch
from kvserve.scheduler.stats import SchedulerStats
from kvserve.scheduler.step_cost import OnlineStepCost, StepCost
from kvserve.scheduler.step_target import GuardDuty
from kvserve.scheduler.stop import append_until_stop
from kvserve.spec_decode.policy import DraftLengthPolicy
from kvserve.structured_output.manager import StructuredOutputManager

class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 spec_policy: DraftLengthPolicy | None = None, spec_lookahead: bool = False,
                 max_loras: int | None = None, structured: StructuredOutputManager | None = None,
                 step_cost: StepCost | None = None, *, kv_connector=None):
        self.config = config
        self.connector = kv_connector
        """--kv-transfer-config: the scheduler-side KV connector (kv_transfer/base.py); None: none."""
        self.step_cost = step_cost if step_cost is not None else OnlineStepCost()
        """Predicted step time (config.target_itl_ms sizes prompt chunks by it), fitted in update()."""
        self.guard_duty = GuardDuty()
        """--target-itl-ms auto: how often long prompts waited beside decodes lately (scheduler/step_target.py)."""
        self.structured = structured
        """Grammars of structured-output requests (compiles, matchers, bitmasks); None: none are served."""
        self.kv = kv_manager
        self.spec_policy = spec_policy
        """How many drafts each request should get next (speculative decoding); None: no speculation."""
        self.spec_lookahead = spec_lookahead
        """The proposer writes K/V at the drafts' positions (a draft model): allocate slots for them."""
        self.gates = AdmissionGates(max_loras)
        """Admission gates: LoRA slots (max_loras) and siblings' waits."""
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in admission order
        self.stats = SchedulerStats()
        if spec_policy is not None:
            self.stats.num_spec_accepted_per_pos = [0] * spec_policy.max_k
        self.order = WaitingOrder(config.policy, kv_manager)
        self.batch = StaticBatch(config.static_batching, config.max_num_seqs)
        """Static batching's gate (off by default: admission every step)."""
        self.worker_view = WorkerView()
        self._failed: list[Request] = []  # failed before they ran (a grammar that did not compile)
        self.kv_held: dict[str, Request] = {}
        """Finished requests whose blocks the KV connector still reads (request_finished's delay_free): freed when
        the worker reports them in finished_sending."""
        self.remote = RemoteLoads()
        """Requests whose KV the connector loads asynchronously (WAITING_FOR_REMOTE_KVS)."""

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request, wait_for: Request | None = None) -> None:
        """Queue a validated request. `wait_for`: a sibling whose prompt KV this one should reuse,
        so it is not admitted before that sibling's prompt is computed."""
        request.status = RequestStatus.WAITING
        attach_grammar(self.structured, request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if wait_for is not None:
            self.gates.wait_for[request.request_id] = wait_for

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """Finish (or abort, or fail with `error`) a request wherever it is; its blocks are released now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.error = error
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.remote.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
        delay_free = False
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(req, self.kv.block_ids(request_id))
            req.finished_kv_transfer_params = params
        if delay_free:
            self.kv_held[request_id] = req
        else:
            self.kv.free(req, finished=True)
        self.gates.wait_for.pop(request_id, None)
        self.order.forget(request_id)
        if self.spec_policy is not None:
            self.spec_policy.forget(request_id)
        self.worker_view.finish(request_id, seen_by_worker=bool(
            req.num_preemptions or req.metrics.first_scheduled_time is not None))
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_held_blocks(self) -> bool:
        """Finished requests' blocks wait for the KV connector (the engine keeps stepping until it reports)."""
        return bool(self.kv_held)

    @property
    def waits_for_kv_transfer(self) -> bool:
        """Some blocks wait for the KV connector's background transfers (sends or loads)."""
        return bool(self.kv_held) or bool(self.remote.loading)

    @property
    def has_compiling_requests(self) -> bool:
        """Some waiting request waits for its grammar to compile."""
        return self.structured is not None and any_compiling(self.waiting)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step: which requests compute how many tokens. Returns the diff for the worker;
        requests with one query token ("decodes") come first in `num_scheduled_tokens`."""
        cfg = self.config
        self.kv.pins.expire()
        self.batch.begin_step(self.running, self.waiting)
        sizer = ChunkSizer.for_step(cfg, self.step_cost, self.batch.active(self.running), self.waiting,
                                    self.guard_duty)
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        budget = self._schedule_running(sizer, cfg.max_num_batched_tokens, scheduled, preempted)
        # NOTE: no admissions in a step that preempted: the pool is short, and a new request would only
        # take the blocks the preempted one needs to come back.
        admitting = not preempted and self.batch.admission_open()
        if admitting:
            self.order.reorder(self.waiting)
        held = self._hold_back_compiling()
        admitted = self._admit(sizer, budget, scheduled) if admitting else []
        admitted_tokens = sum(n for _, n in scheduled[len(scheduled) - len(admitted):])
        self.batch.after_admission(len(admitted), budget - admitted_tokens)
        self.order.after_admission(self.waiting, admitted)
        self.waiting.extendleft(reversed(held))
        decodes_first(scheduled)
        # NOTE: before the diff: a draft model's lookahead slots are blocks the worker must hear of now.
        to_propose = {} if self.spec_policy is None else spec.drafts_to_propose(
            scheduled, self.spec_policy, cfg.max_model_len, self.kv if self.spec_lookahead else None)
        out = self.worker_view.build(scheduled, preempted, self.kv)
        out.num_draft_tokens_to_propose = to_propose
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.structured is not None:
            add_grammar_bitmask(out, scheduled, self.structured)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        return out

    def _schedule_running(self, sizer: ChunkSizer, budget: int, scheduled: list[tuple[Request, int]],
                          preempted: list[str]) -> int:
        """Running requests first, in admission order; preempts from the back when blocks run out. Returns
        the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self.batch.holds(req):
                i += 1
                continue
            if req.spec_token_ids:
                spec.cap_drafts(req, self.config.max_model_len)
            num_new = sizer.size(req.num_computed_tokens, req.num_tokens_with_spec - req.num_computed_tokens,
                                 budget, verifying=bool(req.spec_token_ids))
            if num_new == 0 or (not self.config.enable_chunked_prefill
                                and req.num_tokens - req.num_computed_tokens > budget):
                i += 1  # the step is full for it: its next chunk waits a step
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget  # req itself was preempted: nothing behind it is left
            if req.spec_token_ids:
                spec.trim_drafts_to_chunk(req, num_new)
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _admit(self, sizer: ChunkSizer, budget: int, scheduled: list[tuple[Request, int]]) -> list[Request]:
        """Admit waiting requests from the head of the queue while the gates, the budget and the pool allow."""
        cfg, admitted = self.config, []
        loras = running_loras(self.running)
        budget = self._resume_loaded(sizer, budget, scheduled, admitted, loras)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if not self.gates.admits(req, loras):
                break
            computed = self.kv.get_computed_blocks(req)
            num_hit = len(computed) * self.kv.block_size
            num_external, load_async = (0, False) if self.connector is None else external_hit(self.connector, req,
                                                                                              num_hit)
            if num_external is None:
                break  # the connector does not know yet; FCFS: it stays at the head
            if load_async:
                if not self._park(req, computed, num_hit, num_external):
                    break
                continue
            num_new = req.num_tokens - num_hit - num_external
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = sizer.size(num_hit + num_external, num_new, budget)
            if num_new == 0:
                break  # the step is full; FCFS: it is admitted first next step
            req.num_computed_tokens = num_hit + num_external  # the external tokens get fresh blocks, loaded
            if not allocate_for_admission(self.kv, req, num_new, computed, nothing_runs=not self.running):
                req.num_computed_tokens = 0
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_external)
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission, not a resumption
                self._record_admission(req, num_hit, num_external)
            self._start_running(req, num_new, scheduled, admitted, loras)
            budget -= num_new
        return admitted

    def _start_running(self, req: Request, num_new: int, scheduled: list[tuple[Request, int]],
                       admitted: list[Request], loras: set[int]) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.lora_int_id:
            loras.add(req.lora_int_id)
        admitted.append(req)
        scheduled.append((req, num_new))

    def _record_admission(self, req: Request, num_hit: int, num_external: int) -> None:
        req.num_cached_tokens = num_hit + num_external
        self.stats.num_external_hit_tokens += num_external
        req.metrics.first_scheduled_time = time.monotonic()
        self.stats.record_admission(req.num_prompt_tokens, num_hit)

    def _park(self, req: Request, computed, num_hit: int, num_external: int) -> bool:
        """Admit the head of the queue with blocks for its whole prompt while the connector loads its
        `num_external` tokens in the background (WAITING_FOR_REMOTE_KVS); False: the pool is short."""
        req.num_computed_tokens = num_hit
        if not allocate_for_admission(self.kv, req, req.num_tokens - num_hit, computed, nothing_runs=not self.running):
            req.num_computed_tokens = 0
            return False
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_external)
        self.waiting.popleft()
        if req.status == RequestStatus.WAITING:
            self._record_admission(req, num_hit, num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.remote.loading[req.request_id] = (req, num_external)
        return True

    def _resume_loaded(self, sizer: ChunkSizer, budget: int, scheduled: list[tuple[Request, int]],
                       admitted: list[Request], loras: set[int]) -> int:
        """Requests whose remote KV arrived run first (a prefix hit): they hold their prompt's blocks already.
        Returns the budget left."""
        cfg = self.config
        while self.remote.ready and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.remote.ready[0]
            num_left = req.num_tokens - req.num_computed_tokens
            if not self.gates.lora_fits(req, loras) or (not cfg.enable_chunked_prefill and num_left > budget):
                break
            num_new = sizer.size(req.num_computed_tokens, num_left, budget)
            if num_new == 0 or not self.kv.allocate_slots(req, num_new):
                break
            self.remote.ready.popleft()
            self._start_running(req, num_new, scheduled, admitted, loras)
            budget -= num_new
        return budget

    def _kv_transfers_done(self, kv_out, outputs: list[EngineCoreOutput], now: float) -> None:
        """Free what finished sends (and stopped loads of finished requests) held; resume loaded requests."""
        self.connector.update_connector_output(kv_out)
        for req_id in kv_out.finished_sending | kv_out.finished_recving:
            held = self.kv_held.pop(req_id, None)
            if held is not None:
                self.kv.free(held, finished=True)
        for req_id in kv_out.finished_recving:
            entry = self.remote.loading.pop(req_id, None)
            if entry is None:
                continue
            req, num_loaded = entry
            req.num_computed_tokens += num_loaded
            if not self._failed_load(req, kv_out.invalid_block_ids, outputs, now) or not req.is_finished:
                self.remote.ready.append(req)

    def _hold_back_compiling(self) -> list[Request]:
        """Requests whose grammar still compiles sit out this step's admissions; failed grammars fail theirs."""
        held, failed = hold_back_compiling(self.waiting, self.structured)
        for req in failed:
            self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, req.structured_output.error)
            self._failed.append(req)
        return held

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, finished=False)
        self.worker_view.forget_table(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    # ---- after the forward pass ---------------------------------------------------------------
    def update(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append the sampled tokens, apply token-level stop rules.

        Returns one EngineCoreOutput per request that got tokens or finished this step (finished ones
        have their blocks released), or that computed prompt positions whose prompt logprobs it asked for.
        A request whose sampling failed finishes with finish_reason "error". Stop strings are the front
        end's; it aborts those requests.
        """
        now = time.monotonic()
        if self.spec_policy is not None:
            self.spec_policy.observe_step(out.total_num_scheduled_tokens, runner_out.execute_s)
        if self.config.target_itl_ms:
            observe_step_cost(self.step_cost, self.requests, out, runner_out.execute_s)
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs)) if runner_out.logprobs else {}
        outputs = []
        kv_out = runner_out.kv_connector_output
        invalid = kv_out.invalid_block_ids if kv_out is not None else set()
        if kv_out is not None:
            self._kv_transfers_done(kv_out, outputs, now)
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:  # aborted between schedule and update
                continue
            if invalid and self._failed_load(req, invalid, outputs, now):
                continue
            error = runner_out.errors.get(req_id)
            if error is not None:
                self.finish_request(req_id, RequestStatus.FINISHED_ERROR, error)
                outputs.append(core_output(req, [], None, now))
                continue
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            prompt_chunk = runner_out.prompt_logprobs.get(req_id) if runner_out.prompt_logprobs else None
            output = self._update_request(req, num_scheduled, num_drafts, sampled.get(req_id, []),
                                          logprobs.get(req_id), runner_out.spec_token_ids.get(req_id), now,
                                          prompt_chunk)
            if output is not None:
                outputs.append(output)
        outputs += [core_output(req, [], None, now) for req in self._failed]
        self._failed = []
        return outputs

    def _update_request(self, req: Request, num_scheduled: int, num_drafts: int, new_ids: list[int],
                        row_logprobs, next_drafts: list[int] | None, now: float,
                        prompt_chunk) -> EngineCoreOutput | None:
        """Apply one request's step: its sampled tokens, stop checks, computed tokens, cache and drafts."""
        rejected = spec.num_rejected(num_drafts, len(new_ids))
        req.spec_token_ids = []
        appended, status = append_until_stop(req, new_ids, self.config.max_model_len)
        so = req.structured_output
        if so is not None and appended:
            status = advance_grammar(self.structured, req, appended, status)
        # A stop inside the accepted drafts leaves computed KV past the request's last token.
        req.num_computed_tokens = min(req.num_computed_tokens + num_scheduled - rejected, req.num_tokens)
        self._cache_computed(req)
        if num_drafts and new_ids:
            spec.record_verification(req, num_drafts, len(new_ids) - 1, self.stats, self.spec_policy)
        if not new_ids:  # a prompt chunk short of the end: its prompt logprobs go now
            return core_output(req, [], None, now, prompt_chunk) if prompt_chunk is not None else None
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if status is not None:
            self.finish_request(req.request_id, status,
                                req.error if status == RequestStatus.FINISHED_ERROR else None)
        else:
            if rejected and self.kv.free_tail(req):
                self.worker_view.shrink(req.request_id, self.kv.num_blocks_held(req.request_id))
            req.spec_token_ids = valid_drafts(self.structured, so, next_drafts)
        return core_output(req, appended, row_logprobs[:len(appended)] if row_logprobs else None, now,
                            prompt_chunk)

    def _failed_load(self, req: Request, invalid: set[int], outputs: list[EngineCoreOutput], now: float) -> bool:
        """Whether a block of req failed to load this step (the worker then gave it no token). Policy recompute:
        its computed tokens fall back to the first bad block (the blocks stay; the next steps rewrite them);
        fail: it finishes with an error."""
        first = first_invalid_block(self.kv, req, invalid)
        if first is None:
            return False
        policy = self.connector.transfer.kv_load_failure_policy
        self.stats.num_kv_load_failures += 1
        if policy == "fail":
            bad = sum(1 for b in self.kv.block_ids(req.request_id) if b in invalid)
            self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, load_error_message(req, bad))
            outputs.append(core_output(req, [], None, now))
        else:
            req.num_computed_tokens = min(req.num_computed_tokens, first * self.kv.block_size)
            req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
        return True

    def _cache_computed(self, req: Request) -> None:
        """Every computed token is now final (prompt, or accepted output): share it; pin a pinned prefix."""
        self.kv.cache_full_blocks(req)
        if req.cache_pin and req.num_pinned_tokens is None and req.num_computed_tokens >= req.cache_pin[0]:
            req.num_pinned_tokens = self.kv.pin_prefix(req, *req.cache_pin)

    def finished_output(self, req: Request) -> EngineCoreOutput:
        """The output announcing a request finished outside update() (aborted)."""
        return core_output(req, [], None, time.monotonic())

    # ---- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block accounting (see KVCacheManager.check_invariants) plus queue membership."""
        self.kv.check_invariants(self.requests, held=self.kv_held)
        parked = self.remote.requests()
        ids = [r.request_id for r in self.running + list(self.waiting) + parked]
        assert len(ids) == len(set(ids)) == len(self.requests), "a request is queued twice or lost"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        for r in parked:
            assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, f"parked {r.request_id} is {r.status}"
        self.gates.check_invariants(self.running)
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert self.kv.num_blocks_held(r.request_id) == 0, f"waiting {r.request_id} holds blocks"
