"""DataParallelEngine: N engine cores behind one API server (`kvserve serve --data-parallel-size N`).

    handlers --add--> DataParallelEngine --DPBalancer picks--> AsyncEngine i --> engine process i
    handlers <--RequestStream-- AsyncEngine i (the stream is the engine's own: abort / timeout go straight there)
    listeners <--StepReport(engine_index=i)-- every engine

Each engine is an AsyncEngine with its own process (engine/engine_loop.py), KV cache and a whole copy of the
weights, and --num-threads / N threads; with tensor parallelism each runs its own tp ranks (dp x tp processes).
The front ends share the first engine's tokenizer. This object offers what the server uses of an AsyncEngine,
so the server does not know how many engines there are except in /health and /metrics.

An engine that dies: its requests end with an EngineDeadError naming it, the balancer drops its load and
prefix hints, the others go on serving; only when the last one dies are the dead listeners told (the server
then exits, for a supervisor to restart it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable

from kvserve.config import EngineArgs
from kvserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream,
                                         StepReport)
from kvserve.engine.core import EngineInfo
from kvserve.engine.dp_balancer import BalanceWindow, DPBalancer
from kvserve.engine.engine_loop import EngineStats
from kvserve.engine.engine_process import EngineProcess
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def create_async_engine(args: EngineArgs, *, max_queue_len: int = 256, use_process: bool = False,
                        engine_process: EngineProcess | None = None) -> "AsyncEngine | DataParallelEngine":
    """One AsyncEngine, or N behind a DataParallelEngine when args.data_parallel_size > 1."""
    if args.data_parallel_size == 1:
        return AsyncEngine(args, max_queue_len=max_queue_len, use_process=use_process, engine_process=engine_process)
    return DataParallelEngine(args, max_queue_len=max_queue_len, use_process=use_process,
                              engine_process=engine_process)


def engine_args_per_rank(args: EngineArgs, total_threads: int | None = None) -> EngineArgs:
    """One engine's arguments: data_parallel_size 1, and its share of the threads (at least 1)."""
    n = args.data_parallel_size
    total = args.num_threads or total_threads or os.cpu_count() or 1
    return dataclasses.replace(args, data_parallel_size=1, num_threads=max(1, total // n))


class DataParallelEngine:
    """The AsyncEngine surface over N AsyncEngines; `engines[i]` is data-parallel rank i."""

    def __init__(self, args: EngineArgs, *, max_queue_len: int = 256, use_process: bool = False,
                 engine_process: EngineProcess | None = None):
        n = args.data_parallel_size
        if n < 2:
            raise ValueError(f"DataParallelEngine needs data_parallel_size >= 2, got {n}")
        self.args = args
        self.max_queue_len = max_queue_len
        self.use_process = use_process
        rank_args = engine_args_per_rank(args)
        self.on_ray = args.distributed_executor_backend == "ray"
        """Each engine in a Ray actor (engine/ray_engine.py), on any node of the cluster; else local processes."""
        transport = None
        if self.on_ray:
            from kvserve.engine.ray_engine import RayTransport, import_ray

            import_ray()  # not installed: the error now
            transport = RayTransport
        self.engines = [AsyncEngine(rank_args, max_queue_len=max_queue_len, use_process=use_process,
                                    engine_process=engine_process if i == 0 else None,
                                    label=f"data-parallel engine {i} of {n}", transport=transport) for i in range(n)]
        self._started_ray = False
        self.window = BalanceWindow(args.data_parallel_balance_abs_threshold, args.data_parallel_balance_rel_threshold)
        self.balancer: DPBalancer | None = None  # start(): it needs the block size
        self._listeners: list[Callable[[StepReport], None]] = []
        self._on_dead: list[Callable[[str], None]] = []
        self._dead: set[int] = set()
        for i, engine in enumerate(self.engines):
            engine.add_listener(lambda report, i=i: self._on_step(i, report))
            engine.add_dead_listener(lambda reason, i=i: self._on_engine_dead(i, reason))

    # ---- life cycle ---------------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Every engine's process starts at once; the first loads the tokenizer, the rest share it."""
        first, rest = self.engines[0], self.engines[1:]
        if self.on_ray:
            from kvserve.engine.ray_engine import connect_ray

            slots = len(self.engines) * (1 + self.args.tensor_parallel_size)
            self._started_ray = connect_ray(slots)  # NOTE: on the event loop's thread, as its shutdown
        for engine in rest:
            engine.launch()
        try:
            info = await first.start()
            await asyncio.gather(*(e.start(front_end=first) for e in rest))
        except BaseException:
            await self.shutdown()
            raise
        self.balancer = DPBalancer(len(self.engines), info.block_size, window=self.window,
                                   step_tokens=self.args.max_num_batched_tokens)
        logger.info("data parallel: %d engines of %d threads each (%s), %d KV blocks each", len(self.engines),
                    first.args.num_threads, "Ray actors" if self.on_ray else "processes" if self.use_process else "threads",
                    info.num_kv_blocks)
        return info

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(e.shutdown(timeout) for e in self.engines), return_exceptions=True)
        if self._started_ray:
            import ray

            self._started_ray = False
            ray.shutdown()

    @property
    def info(self) -> EngineInfo | None:
        return self.engines[0].info

    @property
    def tokenizer(self):
        return self.engines[0].tokenizer

    @property
    def processor(self):
        return self.engines[0].processor

    @property
    def default_sampling(self) -> dict:
        return self.engines[0].default_sampling

    @property
    def startup(self):
        return self.engines[0].startup

    @property
    def stats(self) -> EngineStats:
        """Every live engine's stats summed (kv_cache_usage: the pools' combined usage)."""
        return sum_stats([e.stats for i, e in enumerate(self.engines) if i not in self._dead])

    @property
    def is_running(self) -> bool:
        """At least one engine serves."""
        return any(e.is_running for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        if self.is_running:
            return None
        return "; ".join(e.dead_reason or "not running" for e in self.engines)

    @property
    def capacity(self) -> int:
        return sum(e.capacity for e in self.engines if e.is_running) or self.engines[0].capacity

    @property
    def num_inflight_seqs(self) -> int:
        return sum(e.num_inflight_seqs for e in self.engines)

    @property
    def num_bytes_received(self) -> int:
        return sum(e.num_bytes_received for e in self.engines)

    def health(self) -> list[dict]:
        loads = self.balancer.loads() if self.balancer else [0.0] * len(self.engines)
        dispatched = self.balancer.num_dispatched if self.balancer else [0] * len(self.engines)
        return [{"engine": i, "running": e.is_running, "error": None if e.is_running else e.dead_reason,
                 "pid": e.pid, "load": round(loads[i], 3), "num_requests_dispatched": dispatched[i],
                 "num_requests_in_flight": e.num_inflight_seqs} for i, e in enumerate(self.engines)]

    def add_listener(self, listener: Callable[[StepReport], None]) -> None:
        self._listeners.append(listener)

    def add_dead_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once, when the last engine has died."""
        self._on_dead.append(listener)

    # ---- requests -----------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          prompt_text: str | None = None, cache_pin: tuple[int, float] | None = None,
                          deadline: float | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """AsyncEngine.add_request on the engine the balancer picks among those alive with room."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "no engine is running")
        if any(e.has_request(request_id) for e in self.engines):
            raise ValueError(f"request id {request_id!r} is already in use")
        room = [e.is_running and e.num_inflight_seqs + params.n <= e.capacity for e in self.engines]
        if not any(room):
            raise EngineOverloadedError(
                f"every engine is at capacity ({self.num_inflight_seqs} sequences in flight over "
                f"{len(self.engines)} engines of {self.args.max_num_seqs} running + {self.max_queue_len} waiting "
                "each); retry later")
        extra = lora_request.lora_int_id if lora_request is not None else None
        hashes = self.balancer.prompt_hashes(list(prompt_token_ids), extra)
        choice = self.balancer.choose(hashes, room)
        stream = await self.engines[choice.engine].add_request(request_id, prompt_token_ids, params, prompt_text,
                                                               cache_pin, deadline, lora_request)
        self.balancer.dispatched(request_id, choice.engine, hashes, len(prompt_token_ids))
        return stream

    def check_lora(self, lora_request: LoRARequest) -> None:
        self.engines[0].check_lora(lora_request)

    async def explain_prefix(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> dict:
        """The explanation of the engine a request with this prompt would go to (if its loads allowed)."""
        extra = lora_request.lora_int_id if lora_request is not None else None
        engine, _ = self.balancer.affinity(self.balancer.prompt_hashes(list(token_ids), extra))
        if engine is None or not self.engines[engine].is_running:
            engine = next(i for i, e in enumerate(self.engines) if e.is_running)
        result = await self.engines[engine].explain_prefix(token_ids, lora_request)
        return {**result, "data_parallel_rank": engine}

    async def prefix_cache_stats(self) -> dict:
        """Every live engine's stats summed, and each engine's own under "engines"."""
        live = [(i, e) for i, e in enumerate(self.engines) if e.is_running]
        per_engine = await asyncio.gather(*(e.prefix_cache_stats() for _, e in live))
        total = {k: sum(s[k] for s in per_engine) for k, v in per_engine[0].items()
                 if isinstance(v, (int, float)) and k not in ("block_size", "hit_rate")}
        total["block_size"] = per_engine[0]["block_size"]
        total["hit_rate"] = total["hit_tokens"] / max(1, total["query_tokens"])
        return {**total, "engines": [{"engine": i, **s} for (i, _), s in zip(live, per_engine)]}

    def abort(self, request_id: str) -> None:
        for engine in self.engines:
            if engine.has_request(request_id):
                engine.abort(request_id)

    def abort_all(self, reason: str) -> int:
        num = sum(e.abort_all(reason) for e in self.engines)
        if self.balancer is not None:
            self.balancer.forget_all()
        return num

    # ---- from the engines (on the event loop) -------------------------------------------------------
    def _on_step(self, index: int, report: StepReport) -> None:
        if self.balancer is not None:
            for out in report.outputs:
                if out.finished:
                    self.balancer.finished(out.request_id)
                else:
                    self.balancer.started(out.request_id)
        report = dataclasses.replace(report, engine_index=index)
        for listener in self._listeners:
            listener(report)

    def _on_engine_dead(self, index: int, reason: str) -> None:
        self._dead.add(index)
        if self.balancer is not None:
            self.balancer.engine_died(index)
        alive = len(self.engines) - len(self._dead)
        logger.error("%s; %d of %d engines still serve", reason, alive, len(self.engines))
        if alive == 0:
            for listener in self._on_dead:
                listener(self.dead_reason or reason)


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Engines' stats as one: counts and seconds summed, the KV usage of the pools together."""
    if not stats:
        return EngineStats()
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], tuple):
            width = max(len(v) for v in values)
            total[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            total[f.name] = sum(values)
    blocks = total["num_kv_blocks_total"]
    total["kv_cache_usage"] = (sum(s.kv_cache_usage * s.num_kv_blocks_total for s in stats) / blocks if blocks
                               else 0.0)
    return EngineStats(**total)
