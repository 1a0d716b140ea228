"""EngineCore: the scheduler and the workers. Takes validated EngineCoreRequests, steps, returns per-step
deltas (EngineCoreOutput). It holds no tokenizer and produces no text: that is the front end's (Engine
in-process, AsyncEngine in the server process).

    step():  scheduler.schedule() -> executor.execute_model() -> scheduler.update()
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

from kvserve.config.engine import EngineConfig
from kvserve.core_types import EngineCoreOutput, EngineCoreRequest
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.events import KVEvent, KVEventRecorder
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.manager import KVCacheManager, PrefixExplanation
from kvserve.kv_cache.quant import dtype_name
from kvserve.kv_cache.reservation import reserve_blocks
from kvserve.kv_cache.window import window_blocks_bound
from kvserve.kv_transfer.base import KVConnectorRole
from kvserve.kv_transfer.factory import KVConnectorFactory, check_supported
from kvserve.model_loader.architectures import longrope_switch_length
from kvserve.request import Request, RequestStatus
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_cost import OnlineStepCost
from kvserve.spec_decode.policy import DraftLengthPolicy
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.worker.executor import make_executor

_TRANSFER_POLL_S = 0.005
"""How long an idle step waits while only KV transfers are in flight (they finish on their own threads)."""

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know about the core (validation, limits, reporting), read once."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_logprobs: int
    enable_prefix_caching: bool
    kv_cache_dtype: str = "float32"
    """What the KV cache stores: int8, fp8_e4m3, or the model's dtype (kv_cache/quant.py dtype_name)."""
    kv_cache_bytes: int = 0
    """The KV pool's size (on CUDA: what --gpu-memory-utilization left it, worker/memory_plan.py)."""
    max_blocks_per_request: int | None = None
    """Every layer windowed: the most blocks a request holds at once, however long (its first query's window and
    one step's tokens; kv_cache/window.py). None: a request holds a block for each of its tokens' blocks."""
    config_eos_token_id: int | list[int] | None = None
    """The model config's eos_token_id: the front end needs nothing else of the config (without LoRA), so it
    does not load one (transformers' config classes are a second of imports)."""
    startup_s: dict[str, float] = field(default_factory=dict)
    """Seconds the core's start-up spent, by phase (config, weights, kernels, kv cache, warm-up), for the server's
    start-up report (utils/startup_clock.py)."""


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        transfer = config.kv_transfer
        if transfer is not None and transfer.kv_connector:
            check_supported(config)
            KVConnectorFactory.check_config(config)  # a bad connector config fails before the model loads
        self.executor = make_executor(config)
        num_blocks = self.executor.determine_num_blocks()
        self.kv_spec: KVCacheSpec = self.executor.init_kv_cache(num_blocks)
        self.kv_connector = None
        """--kv-transfer-config: the scheduler-side KV connector (kv_transfer/); the worker holds its twin."""
        if transfer is not None and transfer.kv_connector:
            self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, self.kv_spec)
            self.kv_connector.set_xfer_handshake_metadata(self.executor.kv_connector_handshake_metadata())
        window = config.kv_release_window
        if window is not None:
            num_blocks -= 1  # the cache's last block is the manager's null block (released table entries)
        cache = config.cache
        events = config.kv_events
        self.kv_events = KVEventRecorder(cache.block_size) if events is not None and events.enabled else None
        """--kv-events-config: the pool's cache changes since the last drain (drain_kv_events)."""
        self.block_pool = BlockPool(num_blocks, events=self.kv_events)
        kv = KVCacheManager(self.block_pool, cache.block_size, cache.enable_prefix_caching,
                            max_pinned_blocks=int(num_blocks * cache.max_pinned_fraction), sliding_window=window,
                            reserve_blocks=reserve_blocks(cache, config.model.max_model_len, num_blocks))
        spec = config.speculative
        policy = DraftLengthPolicy(spec.num_speculative_tokens, spec.adaptive) if spec else None
        self.scheduler = Scheduler(config.scheduler, kv, policy,
                                   spec_lookahead=spec is not None and spec.method == "draft_model",
                                   max_loras=config.lora.max_loras if config.lora else None,
                                   structured=StructuredOutputManager(self._load_tokenizer, config.model.vocab_size),
                                   step_cost=OnlineStepCost(knee_rows=self.executor.step_cost_knee()),
                                   kv_connector=self.kv_connector)
        self._aborted: list[EngineCoreOutput] = []
        mc = config.model
        self._long_rope_prompt = longrope_switch_length(mc.hf_config, mc.max_model_len)
        """longrope models: prompts longer than this read the long-factor RoPE table (models/llama.py)."""
        self.info = EngineInfo(mc.served_name, mc.max_model_len, mc.vocab_size, config.scheduler.max_num_seqs,
                               num_blocks, cache.block_size, mc.max_logprobs, cache.enable_prefix_caching,
                               dtype_name(self.kv_spec.dtype), self.kv_spec.num_bytes,
                               window_blocks_bound(window, cache.block_size, config.scheduler.max_num_batched_tokens),
                               config_eos_token_id=getattr(mc.hf_config, "eos_token_id", None),
                               startup_s=self.executor.startup_phases())

    def shutdown(self) -> None:
        """Stop the workers (tensor parallelism: the follower processes); the core cannot step after."""
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _load_tokenizer(self):
        # NOTE: the core produces no text; xgrammar alone needs the vocabulary's strings, on its compile thread.
        from kvserve.model_loader.loader import load_tokenizer

        return load_tokenizer(self.config.model.source, self.config.load.load_format == "dummy")

    @staticmethod
    def freeze_gc() -> None:
        """For a process that keeps one engine for its lifetime (a server, a benchmark): what loading made
        (config and module objects) lives as long as the engine; frozen, the cyclic GC stops re-scanning it
        at every full collection, which otherwise shows up as pauses in the middle of decode steps (a
        py-spy profile of `mixed` had 1-3% of samples in gc_collect). Not done by the constructor: a process
        that builds many engines (tests) would never collect the old ones."""
        gc.collect()
        gc.freeze()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request the front end validated."""
        salt = req.cache_salt
        if self._long_rope_prompt is not None and len(req.prompt_token_ids) > self._long_rope_prompt and (
                salt is not None or self.config.cache.enable_prefix_caching):
            # its keys are rotated with the long RoPE factors: no prefix hit with a short prompt's blocks
            salt = f"{salt or ''}|longrope"
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                          req.max_tokens, cache_salt=salt, cache_pin=req.cache_pin,
                          lora_request=req.lora_request)
        request.metrics.arrival_time = req.arrival_time
        wait_for = self.scheduler.requests.get(req.wait_for) if req.wait_for else None
        self.scheduler.add_request(request, wait_for=wait_for)

    def abort_requests(self, request_ids) -> None:
        """Abort wherever they are; blocks are released now, and the next step reports them as "abort".
        Unknown or finished ids are ignored."""
        for request_id in request_ids:
            req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._aborted.append(self.scheduler.finished_output(req))

    def fail_request(self, request_id: str, error: str) -> EngineCoreOutput:
        """Finish a request with finish_reason "error" (e.g. it could not be added)."""
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, error)
        if req is None:
            return EngineCoreOutput(request_id=request_id, new_token_ids=[], new_logprobs=None, timestamp=0.0,
                                    finish_reason="error", error=error)
        return self.scheduler.finished_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted) or self.scheduler.has_held_blocks

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One iteration. A failure attributable to one request (its sampling) finishes that request with
        finish_reason "error" and the step goes on; anything else (the forward pass itself) raises: the
        engine's state is then no longer trusted."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.scheduler.has_compiling_requests:
            self.scheduler.structured.wait_for_compiles(timeout=0.05)  # rather than spin on an idle step
        elif sched_out.is_empty and self.scheduler.waits_for_kv_transfer:
            time.sleep(_TRANSFER_POLL_S)  # the transfers run on their own threads; an idle step only polls them
        runner_out = self.executor.execute_model(sched_out)
        outputs = self.scheduler.update(sched_out, runner_out)
        aborted, self._aborted = self._aborted, []
        return aborted + outputs

    def drain_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call (none unless --kv-events-config enables them)."""
        return self.kv_events.drain() if self.kv_events is not None else []

    # ---- read-only questions ------------------------------------------------------------------------
    def explain_prefix(self, token_ids: list[int], lora_int_id: int = 0) -> PrefixExplanation:
        return self.scheduler.kv.explain(token_ids, lora_int_id=lora_int_id)

    def prefix_cache_stats(self) -> dict:
        pool, stats, bs = self.block_pool, self.scheduler.stats, self.config.cache.block_size
        counts = pool.counts()
        return {"block_size": bs, "total_blocks": pool.num_blocks,
                "cached_blocks": pool.num_cached_blocks,
                "cached_tokens": pool.num_cached_blocks * bs,
                "evictable_blocks": counts["cached"], "pinned_blocks": self.scheduler.kv.pins.num_pinned,
                "max_pinned_blocks": self.scheduler.kv.pins.max_blocks,
                "query_tokens": stats.num_prefix_query_tokens, "hit_tokens": stats.num_prefix_hit_tokens,
                "hit_rate": stats.num_prefix_hit_tokens / max(1, stats.num_prefix_query_tokens),
                "evictions": pool.num_evictions}
