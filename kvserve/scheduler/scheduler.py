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
from dataclasses import dataclass

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core_types import CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.scheduler.policy import WaitingOrder
from kvserve.scheduler.step_cost import LatencyBudget, OnlineStepCost, StepCost, StepFeatures
from kvserve.spec_decode.policy import DraftLengthPolicy
from kvserve.structured_output.manager import StructuredOutputManager


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_spec_drafts: int = 0
    """Speculative verifications (a request's drafts scored in one step)."""
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_per_pos: list[int] | None = None
    """Per draft position j (0-based): how many verifications accepted it."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 spec_policy: DraftLengthPolicy | None = None, spec_lookahead: bool = False,
                 max_loras: int | None = None, structured: StructuredOutputManager | None = None,
                 step_cost: StepCost | None = None):
        self.config = config
        self.step_cost = step_cost if step_cost is not None else OnlineStepCost()
        """Predicted step time (config.target_itl_ms sizes prompt chunks by it), fitted in update()."""
        self.structured = structured
        """Grammars of structured-output requests (compiles, matchers, bitmasks); None: none are served."""
        self.kv = kv_manager
        self.spec_policy = spec_policy
        """How many drafts each request should get next (speculative decoding); None: no speculation."""
        self.spec_lookahead = spec_lookahead
        """The proposer writes K/V at the drafts' positions (a draft model): allocate slots for them."""
        self.max_loras = max_loras
        """Most distinct LoRA adapters among running requests (so in any step); None: no limit (LoRA off:
        the front end admits no adapter requests then)."""
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in admission order
        self.stats = SchedulerStats()
        if spec_policy is not None:
            self.stats.num_spec_accepted_per_pos = [0] * spec_policy.max_k
        self._wait_for: dict[str, Request] = {}  # request id -> sibling whose prompt KV it will reuse
        self.order = WaitingOrder(config.policy, kv_manager)
        # What the worker knows, so that each SchedulerOutput sends only the diff.
        self._num_blocks_sent: dict[str, int] = {}  # running request -> leading table blocks sent
        self._finished_ids: set[str] = set()         # finished since the last schedule()
        self._shrunk: set[str] = set()               # tables that gave blocks back since the worker last heard
        self._failed: list[Request] = []             # failed before they ran (a grammar that did not compile)

    # ---- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request, wait_for: Request | None = None) -> None:
        """Queue a validated request. `wait_for`: a sibling whose prompt KV this one should reuse,
        so it is not admitted before that sibling's prompt is computed."""
        request.status = RequestStatus.WAITING
        so = request.sampling_params.structured_outputs
        if so is not None:
            if self.structured is None:
                raise ValueError("this engine serves no structured outputs")
            request.structured_output = self.structured.add(so, request.eos_token_ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if wait_for is not None:
            self._wait_for[request.request_id] = wait_for

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """Finish (or abort, or fail with `error`) a request wherever it is; its blocks are released now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.error = error
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
        self.kv.free(req, finished=True)
        self._wait_for.pop(request_id, None)
        self.order.forget(request_id)
        self._num_blocks_sent.pop(request_id, None)
        self._shrunk.discard(request_id)
        if self.spec_policy is not None:
            self.spec_policy.forget(request_id)
        if req.num_preemptions or req.metrics.first_scheduled_time is not None:
            self._finished_ids.add(request_id)  # the worker has seen it
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step: which requests compute how many tokens. Returns the diff for the worker;
        requests with one query token ("decodes") come first in `num_scheduled_tokens`."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        self.kv.pins.expire()
        chunk_cap = self._prefill_chunk_cap()
        latency = self._latency_budget()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_token_ids:
                self._cap_drafts(req)
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget, chunk_cap)
            if latency is not None and num_new > 1 and not req.spec_token_ids:
                num_new = latency.cap(req.num_computed_tokens, num_new)
                if num_new == 0:  # the step is full: this prompt's next chunk waits a step
                    i += 1
                    continue
            if not cfg.enable_chunked_prefill and req.num_tokens - req.num_computed_tokens > budget:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                if req.spec_token_ids:  # the budget may cut the drafts short: verify what fits
                    del req.spec_token_ids[max(0, num_new - (req.num_tokens - req.num_computed_tokens)):]
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing behind it is left

        # NOTE: no admissions in a step that preempted: the pool is short, and a new request would only
        # take the blocks the preempted one needs to come back.
        if not preempted:
            self.order.reorder(self.waiting)
        compiling = self._hold_back_compiling()
        admitted: list[Request] = []
        running_loras = {r.lora_int_id for r in self.running} - {0}
        while self.waiting and budget > 0 and not preempted and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if not self._lora_fits(req, running_loras):
                break  # NOTE: FCFS: it waits for a slot at the head of the queue, so it cannot starve
            sibling = self._wait_for.get(req.request_id)
            if sibling is not None:
                if not sibling.is_finished and sibling.num_computed_tokens < sibling.num_prompt_tokens:
                    break
                del self._wait_for[req.request_id]
            computed = self.kv.get_computed_blocks(req)
            num_hit = len(computed) * self.kv.block_size
            num_new = req.num_tokens - num_hit
            if cfg.enable_chunked_prefill:
                num_new = min(num_new, budget, chunk_cap)
                if latency is not None and num_new > 1:
                    num_new = latency.cap(num_hit, num_new)
                    if num_new == 0:
                        break  # the step is full; FCFS: it is admitted first next step
            elif num_new > budget:
                break
            req.num_computed_tokens = num_hit
            if not self._allocate_for_admission(req, num_new, computed):
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission, not a resumption
                req.num_cached_tokens = num_hit
                req.metrics.first_scheduled_time = time.monotonic()
                self.stats.num_prefix_query_tokens += req.num_prompt_tokens
                self.stats.num_prefix_hit_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_int_id:
                running_loras.add(req.lora_int_id)
            admitted.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        self.order.after_admission(self.waiting, admitted)
        self.waiting.extendleft(reversed(compiling))

        # stable: decodes first (a request verifying drafts is a run of decodes to the attention backends)
        scheduled.sort(key=lambda entry: entry[1] != 1 and not entry[0].spec_token_ids)
        to_propose = self._drafts_to_propose(scheduled) if self.spec_policy is not None else {}
        out = self._diff(scheduled, preempted)
        out.num_draft_tokens_to_propose = to_propose
        if self.structured is not None:
            self._add_grammar_bitmask(out, scheduled)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        return out

    def _hold_back_compiling(self) -> list[Request]:
        """Take the requests whose grammar is still compiling out of the queue for this step's admissions
        (they go back to its front after), so that the requests behind them run meanwhile; a request whose
        grammar failed to compile is failed."""
        if self.structured is None or not any(r.structured_output is not None for r in self.waiting):
            return []
        held = []
        for req in list(self.waiting):
            so = req.structured_output
            if so is None or self.structured.is_ready(so, req.eos_token_ids):
                if so is not None and so.error is not None:
                    self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, so.error)
                    self._failed.append(req)
                continue
            self.waiting.remove(req)
            held.append(req)
        return held

    def _add_grammar_bitmask(self, out: SchedulerOutput, scheduled: list[tuple[Request, int]]) -> None:
        """The allowed tokens of each constrained request that samples this step, at each position it scores."""
        entries = [(req.request_id, req.structured_output, req.spec_token_ids) for req, num_new in scheduled
                   if req.structured_output is not None and req.num_computed_tokens + num_new >= req.num_tokens]
        if entries:
            out.grammar_bitmask, out.structured_output_request_ids = self.structured.fill_bitmask(entries)

    @property
    def has_compiling_requests(self) -> bool:
        """Some waiting request waits for its grammar to compile."""
        return self.structured is not None and any(
            r.structured_output is not None and r.structured_output.matcher is None for r in self.waiting)

    def _lora_fits(self, req: Request, running_loras: set[int]) -> bool:
        """Whether admitting req keeps the running requests within max_loras distinct adapters. Every step
        schedules running requests only, so no step needs more adapters than the worker has slots."""
        if not req.lora_int_id or req.lora_int_id in running_loras:
            return True
        return self.max_loras is None or len(running_loras) < self.max_loras

    def _diff(self, scheduled: list[tuple[Request, int]], preempted: list[str]) -> SchedulerOutput:
        """What the worker needs to know about this step and does not know yet."""
        new, cached = [], CachedRequestData()
        for req, num_new in scheduled:
            block_ids = self.kv.block_ids(req.request_id)
            sent = self._num_blocks_sent.get(req.request_id)
            self._num_blocks_sent[req.request_id] = len(block_ids)
            if sent is not None:  # running since an earlier step: only the new blocks
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(False)
                cached.new_block_ids.append(block_ids[sent:])
                cached.num_computed_tokens.append(req.num_computed_tokens)
                if req.request_id in self._shrunk:
                    cached.num_kept_blocks[req.request_id] = sent
                    self._shrunk.discard(req.request_id)
            elif req.num_preemptions:  # back after a preemption: the worker kept its tokens, not its blocks
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(True)
                cached.new_block_ids.append(block_ids)
                cached.num_computed_tokens.append(req.num_computed_tokens)
            else:
                new.append(NewRequestData(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                          sampling_params=req.sampling_params, eos_token_ids=req.eos_token_ids,
                                          block_ids=block_ids, num_computed_tokens=req.num_computed_tokens,
                                          lora_request=req.lora_request))
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens={req.request_id: n for req, n in scheduled},
            total_num_scheduled_tokens=sum(n for _, n in scheduled),
            scheduled_spec_decode_tokens={req.request_id: list(req.spec_token_ids)
                                          for req, _ in scheduled if req.spec_token_ids},
            finished_req_ids=finished, preempted_req_ids=set(preempted))

    # ---- speculative decoding ----------------------------------------------------------------
    def _cap_drafts(self, req: Request) -> None:
        """Never verify drafts past max_tokens (the step's own sample is one more) or max_model_len."""
        limit = min(req.max_tokens - req.num_output_tokens - 1, self.config.max_model_len - req.num_tokens)
        del req.spec_token_ids[max(0, limit):]

    def _drafts_to_propose(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """The policy's draft length for the next step of each request that samples in this one (with a
        draft model, only where the pool has slots for the drafts' K/V)."""
        ids, caps, new = [], [], {}
        for req, num_new in scheduled:
            if req.num_computed_tokens + num_new < req.num_tokens:
                continue  # a prompt chunk short of the end: it does not sample this step
            # After this step the request holds at least one more token, and its next step samples one more.
            ids.append(req.request_id)
            caps.append(min(req.max_tokens - req.num_output_tokens - 2,
                            self.config.max_model_len - req.num_tokens - 1))
            new[req.request_id] = (req, num_new)
        if not ids:
            return {}
        base = sum(n - len(r.spec_token_ids) for r, n in scheduled)
        ks = self.spec_policy.choose(ids, caps, base)
        chosen = {}
        for req_id, k in zip(ids, ks):
            if k <= 0:
                continue
            req, num_new = new[req_id]
            if self.spec_lookahead and not self.kv.allocate_slots(req, num_new + k):
                continue  # the pool is short: no drafts rather than a preemption
            chosen[req_id] = k
        return chosen

    def _prefill_chunk_cap(self) -> int:
        """Most prompt tokens one request may compute this step.

        NOTE: a step takes as long as all of its tokens, so a 512-token chunk beside 16 decodes makes each of
        those 16 wait ~8 decode steps for its next token. Capping each prefill's chunk while anyone decodes
        bounds that stall (the `interference` workload); with nobody decoding the cap would only slow the
        prompt down, so it does not apply. Several prefills may still share one step's budget."""
        cap = self.config.long_prefill_token_threshold
        if cap <= 0 or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return cap if decoding else self.config.max_num_batched_tokens

    def _latency_budget(self) -> LatencyBudget | None:
        """The budget that sizes this step's prompt chunks by predicted time (config.target_itl_ms), when the
        step carries decodes; None (the token budget alone) otherwise, or when the target is 0."""
        cfg = self.config
        if cfg.target_itl_ms <= 0 or not cfg.enable_chunked_prefill:
            return None
        decodes = StepFeatures()
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                decodes = decodes + StepFeatures.of_request(r.num_computed_tokens,
                                                            r.num_tokens_with_spec - r.num_computed_tokens)
        return LatencyBudget(self.step_cost, cfg.target_itl_ms / 1000, decodes) if decodes.num_seqs else None

    def _allocate_for_admission(self, req: Request, num_new: int, computed) -> bool:
        if self.kv.allocate_slots(req, num_new, computed):
            return True
        if self.running or not self.kv.pins.num_pinned:
            return False
        # NOTE: nothing runs, so nothing will free blocks: pins must yield or the queue would stall forever.
        self.kv.pins.release_oldest(self.kv.pins.num_pinned)
        return self.kv.allocate_slots(req, num_new, computed)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, finished=False)
        self._num_blocks_sent.pop(req.request_id, None)
        self._shrunk.discard(req.request_id)
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
        if self.config.target_itl_ms > 0 and not out.is_empty:
            carried = sum((StepFeatures.of_request(self.requests[r].num_computed_tokens, n)  # not yet advanced
                           for r, n in out.num_scheduled_tokens.items() if r in self.requests), StepFeatures())
            self.step_cost.observe(carried, runner_out.execute_s)
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs)) if runner_out.logprobs else {}
        prompt_logprobs = runner_out.prompt_logprobs
        outputs = []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:  # aborted between schedule and update
                continue
            error = runner_out.errors.get(req_id)
            if error is not None:
                self.finish_request(req_id, RequestStatus.FINISHED_ERROR, error)
                outputs.append(self._output(req, [], None, now))
                continue
            new_ids = sampled.get(req_id, [])
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            # NOTE: drafts the target rejected were computed but are not tokens of the request.
            num_rejected = num_drafts + 1 - len(new_ids) if new_ids and num_drafts else 0
            req.spec_token_ids = []
            appended = []
            status = None
            for token in new_ids:
                req.append_output_token(token)
                appended.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    break
            so = req.structured_output
            if so is not None and appended:
                status = self._advance_grammar(req, appended, status)
            # A stop inside the accepted drafts leaves computed KV past the request's last token.
            req.num_computed_tokens = min(req.num_computed_tokens + num_scheduled - num_rejected, req.num_tokens)
            # Every computed token is now final (prompt, or output the sampler accepted): safe to share.
            self.kv.cache_full_blocks(req)
            if req.cache_pin and req.num_pinned_tokens is None and req.num_computed_tokens >= req.cache_pin[0]:
                req.num_pinned_tokens = self.kv.pin_prefix(req, *req.cache_pin)
            if num_drafts and new_ids:
                self._record_verification(req, num_drafts, len(new_ids) - 1)
            prompt_chunk = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not new_ids:
                if prompt_chunk is not None:  # a prompt chunk short of the end: its prompt logprobs go now
                    outputs.append(self._output(req, [], None, now, prompt_chunk))
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if status is not None:
                self.finish_request(req_id, status, req.error if status == RequestStatus.FINISHED_ERROR else None)
            else:
                if num_rejected and self.kv.free_tail(req):
                    sent = self._num_blocks_sent.get(req_id)
                    if sent is not None:
                        self._num_blocks_sent[req_id] = min(sent, self.kv.num_blocks_held(req_id))
                        self._shrunk.add(req_id)
                drafts = runner_out.spec_token_ids.get(req_id)
                if drafts and so is not None:
                    drafts = drafts[:self.structured.valid_draft_prefix(so, drafts)]
                if drafts:
                    req.spec_token_ids = list(drafts)
            row_logprobs = logprobs.get(req_id)
            outputs.append(self._output(req, appended, row_logprobs[:len(appended)] if row_logprobs else None,
                                        now, prompt_chunk))
        if self._failed:
            outputs += [self._output(req, [], None, now) for req in self._failed]
            self._failed = []
        return outputs

    def _advance_grammar(self, req: Request, tokens: list[int], status: RequestStatus | None) -> RequestStatus | None:
        """Advance the request's matcher over its new tokens; a complete grammar stops the request."""
        if not self.structured.accept(req.structured_output, tokens):
            req.error = "structured output: a sampled token does not fit the grammar"
            return RequestStatus.FINISHED_ERROR
        if status is None and self.structured.is_terminated(req.structured_output):
            return RequestStatus.FINISHED_STOPPED
        return status

    def _record_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_spec_drafts += 1
        stats.num_spec_draft_tokens += num_drafts
        stats.num_spec_accepted_tokens += num_accepted
        per_pos = stats.num_spec_accepted_per_pos
        if per_pos is None or len(per_pos) < num_drafts:
            per_pos = stats.num_spec_accepted_per_pos = (per_pos or []) + [0] * (num_drafts - len(per_pos or []))
        for pos in range(num_accepted):
            per_pos[pos] += 1
        req.metrics.num_draft_tokens += num_drafts
        req.metrics.num_accepted_tokens += num_accepted
        if self.spec_policy is not None:
            self.spec_policy.observe_verification(req.request_id, num_drafts, num_accepted)

    @staticmethod
    def _output(req: Request, new_ids: list[int], new_logprobs, now: float,
                new_prompt_logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=req.request_id, new_token_ids=new_ids, new_logprobs=new_logprobs,
                                timestamp=now, first_scheduled_time=req.metrics.first_scheduled_time,
                                num_cached_tokens=req.num_cached_tokens, finish_reason=req.status.finish_reason,
                                stop_reason=req.stop_reason if isinstance(req.stop_reason, int) else None,
                                error=req.error, num_draft_tokens=req.metrics.num_draft_tokens,
                                num_accepted_tokens=req.metrics.num_accepted_tokens,
                                new_prompt_logprobs=new_prompt_logprobs)

    def finished_output(self, req: Request) -> EngineCoreOutput:
        """The output announcing a request finished outside update() (aborted)."""
        return self._output(req, [], None, time.monotonic())

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block accounting (see KVCacheManager.check_invariants) plus queue membership."""
        self.kv.check_invariants(self.requests)
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)) == len(self.requests), "a request is queued twice or lost"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
        loras = {r.lora_int_id for r in self.running} - {0}
        assert self.max_loras is None or len(loras) <= self.max_loras, (
            f"{len(loras)} adapters running, max_loras {self.max_loras}")
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert self.kv.num_blocks_held(r.request_id) == 0, f"waiting {r.request_id} holds blocks"
