"""Prometheus metrics (prefix `kvserve:`) and the periodic stats log line, fed by the engine's StepReports.

Each server owns its CollectorRegistry (no process-wide default registry), so two servers in one
process, as in tests, never share counters. Latencies come from the engine's own timestamps
(RequestMetrics, time.monotonic), not from when the HTTP side happened to look.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from kvserve.engine.async_engine import EngineStats, StepReport
from kvserve.engine.data_parallel import sum_stats

logger = logging.getLogger("kvserve.server")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """The server's Prometheus metrics; `on_step` is an AsyncEngine listener.

    With several engines (--data-parallel-size) the unlabelled gauges are the live engines' sum, and the
    `kvserve:engine_*` gauges, labelled `engine`, are each engine's own; `engine_health` (the engine's
    health()) is read at every scrape, so a dead engine shows as `kvserve:engine_healthy 0`."""

    def __init__(self, model_name: str, kv_cache_dtype: str = "float32", kv_cache_bytes: int = 0,
                 engine_health: Callable[[], list[dict]] | None = None):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc. of the server process

        def hist(name, doc, buckets):
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of each request.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduling of each request.",
                               _REQUEST_BUCKETS)
        self.running = gauge("num_requests_running", "Sequences running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting in the engine's queue.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).")
        self.pinned_blocks = gauge("prefix_cache_pinned_blocks", "KV blocks pinned by prompt caching (cache_control).")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        gauge("kv_cache_memory_bytes", "Bytes of the KV pool (on CUDA: --gpu-memory-utilization x device memory "
              "minus weights, activation peak and other use).").set(kv_cache_bytes)
        self.request_blocks = gauge("kv_cache_request_blocks",
                                    "KV blocks held by requests (not pins); 0 whenever no request runs.")
        self.engine_memory = gauge("engine_resident_memory_bytes", "Resident memory of the engine's process.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions (a running sequence evicted for blocks).")
        # NOTE: both in tokens, as vLLM counts them: hit rate = hits / queries.
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.busy_seconds = counter("engine_busy_seconds", "Seconds the engine loop spent inside step().")
        self.steps = counter("engine_steps", "Engine steps run.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications (one request's drafts "
                                   "scored in one step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens scored by the target.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self._spec_per_pos = Counter("kvserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position in the draft (0 = first).",
                                     labels + ["position"], registry=r)
        self.spec_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length", "Tokens per verification so far: 1 + accepted / verifications "
            "(1 = speculation gained nothing).")
        self._finished = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._rejected = Counter("kvserve:request_rejected", "Requests refused before running, by reason.",
                                 labels + ["reason"], registry=r)
        # NOTE: vLLM's cache_config_info, reduced to the one label that changes what a block holds.
        Gauge("kvserve:cache_config_info", "KV-cache configuration (value 1): cache_dtype is what K/V are "
              "stored as (int8, fp8_e4m3, or the model's dtype).", labels + ["cache_dtype"],
              registry=r).labels(model_name, kv_cache_dtype).set(1)
        self._model_name = model_name
        self._last: dict[int, EngineStats] = {}
        """Each engine's latest stats (counters grow by the difference)."""
        self._engine_health = engine_health
        self._dead: set[int] = set()
        per_engine = labels + ["engine"]
        self._engine_gauges = {
            name: Gauge(f"kvserve:engine_{name}", doc, per_engine, registry=r) for name, doc in (
                ("healthy", "1 while the engine serves, 0 once it died (--data-parallel-size)."),
                ("num_requests_running", "Sequences running in this engine."),
                ("num_requests_waiting", "Sequences waiting in this engine's queue."),
                ("kv_cache_request_blocks", "KV blocks held by requests in this engine; 0 whenever none runs."),
                ("kv_cache_usage_perc", "Fraction of this engine's KV-cache blocks held by requests."))}
        for engine in engine_health() if engine_health is not None else ():
            for gauge in self._engine_gauges.values():
                gauge.labels(model_name, str(engine["engine"])).set(0)
        # Plain totals for the stats log line (reading them back from prometheus objects is clumsy).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def render(self) -> bytes:
        if self._engine_health is not None:
            for engine in self._engine_health():
                index, running = engine["engine"], engine["running"]
                self._engine_gauges["healthy"].labels(self._model_name, str(index)).set(1 if running else 0)
                if not running and index not in self._dead:
                    self._dead.add(index)  # its sequences and blocks went with it
                    self._set_gauges(index, EngineStats())
        return generate_latest(self.registry)

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def _set_gauges(self, index: int, stats: EngineStats) -> None:
        """Engine `index` now has `stats`: its own gauges, and the sums over live engines."""
        engine = str(index)
        for name, value in (("num_requests_running", stats.num_running), ("num_requests_waiting", stats.num_waiting),
                            ("kv_cache_request_blocks", stats.num_kv_request_blocks),
                            ("kv_cache_usage_perc", stats.kv_cache_usage)):
            self._engine_gauges[name].labels(self._model_name, engine).set(value)
        latest = {i: s for i, s in self._last.items() if i not in self._dead}
        if index not in self._dead:
            latest[index] = stats
        total = sum_stats(list(latest.values()))
        self.running.set(total.num_running)
        self.waiting.set(total.num_waiting)
        self.kv_usage.set(total.kv_cache_usage)
        self.pinned_blocks.set(total.num_pinned_blocks)
        self.total_blocks.set(total.num_kv_blocks_total)
        self.request_blocks.set(total.num_kv_request_blocks)
        self.engine_memory.set(total.resident_memory_bytes)

    def on_step(self, report: StepReport) -> None:
        stats, index = report.stats, report.engine_index
        last = self._last.get(index, EngineStats())
        self._set_gauges(index, stats)
        self.preemptions.inc(stats.num_preemptions_total - last.num_preemptions_total)
        self.prefix_queries.inc(stats.num_prefix_query_tokens_total - last.num_prefix_query_tokens_total)
        self.prefix_hits.inc(stats.num_prefix_hit_tokens_total - last.num_prefix_hit_tokens_total)
        self.busy_seconds.inc(max(0.0, stats.busy_s - last.busy_s))
        self.steps.inc(stats.num_steps_total - last.num_steps_total)
        self._on_spec(stats, last)
        self._last[index] = stats
        it = report.iteration
        self.num_generation_tokens += it.num_generation_tokens
        self.generation_tokens.inc(it.num_generation_tokens)
        self.num_prompt_tokens += it.num_prompt_tokens
        self.prompt_tokens.inc(it.num_prompt_tokens)
        for ttft in it.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        for out in report.outputs:
            if out.finished:
                self._on_finished(out)

    def _on_spec(self, stats: EngineStats, last: EngineStats) -> None:
        if stats.num_spec_drafts_total == last.num_spec_drafts_total:
            return
        self.spec_drafts.inc(stats.num_spec_drafts_total - last.num_spec_drafts_total)
        self.spec_draft_tokens.inc(stats.num_spec_draft_tokens_total - last.num_spec_draft_tokens_total)
        self.spec_accepted_tokens.inc(stats.num_spec_accepted_tokens_total - last.num_spec_accepted_tokens_total)
        before = last.num_spec_accepted_per_pos_total or (0,) * len(stats.num_spec_accepted_per_pos_total)
        for pos, (now, was) in enumerate(zip(stats.num_spec_accepted_per_pos_total, before)):
            if now > was:
                self._spec_per_pos.labels(self._model_name, str(pos)).inc(now - was)
        self.spec_mean_acceptance_length.set(1 + stats.num_spec_accepted_tokens_total / stats.num_spec_drafts_total)

    def _on_finished(self, out) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self._finished.labels(self._model_name, reason or "abort").inc()
        m = out.metrics
        if m is not None:
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)


async def log_stats_periodically(metrics: ServerMetrics, get_stats, interval: float) -> None:
    """Every `interval` seconds while requests are in flight (or tokens flowed), log one line:
    throughputs since the previous line, running and waiting sequences, KV usage, loop busy fraction."""
    last_time = time.monotonic()
    last_prompt, last_gen = metrics.num_prompt_tokens, metrics.num_generation_tokens
    last_busy = get_stats().busy_s
    while True:
        await asyncio.sleep(interval)
        now, stats = time.monotonic(), get_stats()
        prompt, gen = metrics.num_prompt_tokens - last_prompt, metrics.num_generation_tokens - last_gen
        elapsed = now - last_time
        if prompt or gen or stats.num_running or stats.num_waiting:
            logger.info("prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, "
                        "waiting: %d, KV cache usage: %.1f%%, engine busy: %.0f%%",
                        prompt / elapsed, gen / elapsed, stats.num_running, stats.num_waiting,
                        100 * stats.kv_cache_usage, 100 * (stats.busy_s - last_busy) / elapsed)
        last_time, last_prompt, last_gen = now, metrics.num_prompt_tokens, metrics.num_generation_tokens
        last_busy = stats.busy_s
