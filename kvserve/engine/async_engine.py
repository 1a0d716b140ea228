"""AsyncEngine: an EngineCore stepping continuously in the background, driven from asyncio.

    handlers --add / abort--> Processor --> inbox --> EngineLoop (owns the EngineCore)
                                                         | _CoreStep (per-step deltas, stats)
    per-request streams <-- OutputProcessor (text, stop strings) <--+
    handlers --query--> inbox --> EngineLoop --_QueryResult--> the awaiting handler (debug endpoints)

The front end (this object: tokenizer, validation, detokenization, stop strings) lives on the event loop;
the core (scheduler + worker) in the EngineLoop, which makes every core call: the core is not thread-safe.
The loop blocks on its inbox while idle (no spinning) and, while busy, applies whatever arrived between
two steps, so an abort frees its KV blocks before the next step runs. What crosses from the loop is only
each step's deltas (new token ids and logprobs), so the bytes per step do not grow with output length.

The loop (engine/engine_loop.py) runs on a thread of this process or, with `use_process=True` (what
`kvserve serve` does by default), in a spawned child process; both run the same EngineLoop on the same
messages, only the transport differs. docs/SERVER.md records the measurement behind the server's choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import EngineArgs
from kvserve.engine.core import EngineInfo
from kvserve.engine.engine_process import EngineProcess
from kvserve.engine.engine_loop import (
    SHUTDOWN,
    Abort,
    Add,
    CoreStep,
    EngineStats,
    ProcessTransport,
    Query,
    QueryResult,
    Ready,
    Stopped,
    ThreadTransport,
)
from kvserve.engine.lora_checker import AdapterChecker
from kvserve.engine.output_processor import IterationStats, OutputProcessor
from kvserve.engine.processor import Processor, eos_token_ids
from kvserve.kv_cache.events import KVEvent
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.utils.startup_clock import PhaseTimes

logger = logging.getLogger(__name__)


class EngineOverloadedError(Exception):
    """Admitting the request would exceed max_num_seqs running + max_queue_len waiting sequences."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash, or shutdown); no request can run any more."""


class RequestAbortedError(RuntimeError):
    """The server ended this request before it finished (e.g. shutting down past its timeout)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (--request-timeout); it was aborted."""


class EngineInternalError(RuntimeError):
    """The engine failed on this request alone (not the client's fault); the engine runs on."""


@dataclass
class StepReport:
    """Everything one step produced: the changed requests' outputs, what the step did (its tokens and
    latencies, whatever the outputs' kinds) and the engine's stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats
    iteration: IterationStats
    kv_events: list[KVEvent] = field(default_factory=list)
    """What entered and left the prefix cache (--kv-events-config; else empty)."""
    engine_index: int = 0
    """Which engine stepped (--data-parallel-size: engine/data_parallel.py); stats are that engine's own."""


# ---- the asyncio side ---------------------------------------------------------------------------
class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Outputs that queued up while the consumer was busy are merged into one (their `new_token_ids` and
    `new_texts` concatenated; cumulative fields from the newest), so a slow client costs one chunk per
    wake-up, not one per step. `close()` aborts the request if it has not finished. Past `deadline`
    (event-loop time) the request is aborted and the iterator raises RequestTimeoutError.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, num_seqs: int, deadline: float | None = None,
                 delta: bool = False):
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.finished = False
        self.deadline = deadline
        self.delta = delta
        self.num_output_tokens = [0] * num_seqs
        """Tokens generated so far per sample (whatever the output kind carries)."""
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # NOTE: one timer per request, not an asyncio.timeout scope around each wait: outputs come once per
        # engine step, and a scope per output was ~7% of the API process's CPU per streamed token (py-spy)
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire) if deadline is not None else None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            newer = self._queue.get_nowait()
            item = newer if isinstance(newer, BaseException) else _merge(item, newer, self.delta)
        if isinstance(item, BaseException):
            self._finish()
            raise item
        for i, ids in enumerate(item.new_token_ids):
            self.num_output_tokens[i] += len(ids)
        if item.finished:
            self._finish()
        return item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self._finish()
            self._engine.abort(self.request_id)

    def _finish(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        """The deadline passed: abort the request; the iterator raises after what is already queued."""
        if not self.finished:
            self._queue.put_nowait(RequestTimeoutError("the request ran past the server's deadline "
                                                       "(--request-timeout) and was aborted"))
            self._engine.abort(self.request_id)


def _merge(older: RequestOutput, newer: RequestOutput, delta: bool) -> RequestOutput:
    """Two queued outputs of one request as one. Cumulative outputs keep the newer's content; delta outputs
    concatenate their content. Either way new_token_ids / new_texts concatenate."""
    outputs = newer.outputs
    if delta:
        outputs = [dataclasses.replace(
            b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
            logprobs=None if b.logprobs is None else (a.logprobs or []) + b.logprobs)
            for a, b in zip(older.outputs, newer.outputs)]
    return dataclasses.replace(
        newer, outputs=outputs,
        new_token_ids=[a + b for a, b in zip(older.new_token_ids, newer.new_token_ids)],
        new_texts=[a + b for a, b in zip(older.new_texts, newer.new_texts)],
        prompt_logprobs=older.prompt_logprobs if newer.prompt_logprobs is None else newer.prompt_logprobs)


class AsyncEngine:
    """The front end of an EngineCore stepping in the background, with admission control, for asyncio.

    Use from one event loop: `await start()`, then `stream = await add_request(...)` (raises ValueError
    for a request the engine cannot run, EngineOverloadedError past capacity) and `async for out in
    stream`. At most max_num_seqs + max_queue_len sequences (a request with n samples counts n) are in
    flight. Listeners get every StepReport on the event loop (metrics). `explain_prefix` and
    `prefix_cache_stats` ask the core itself (it may live in another process), between two steps.
    """

    def __init__(self, args: EngineArgs, *, max_queue_len: int = 256, use_process: bool = False,
                 engine_process: EngineProcess | None = None, label: str | None = None,
                 transport: Callable[[EngineArgs, Callable[[object], None]], object] | None = None):
        """engine_process: with use_process, the engine process started ahead (engine/engine_process.py).
        transport: makes the loop's transport instead (engine/ray_engine.py's RayTransport: a Ray actor).
        label: names this engine in the error its requests get if it dies (e.g. "data-parallel engine 1 of 2")."""
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.args = args
        self.max_queue_len = max_queue_len
        self.use_process = use_process
        self._engine_process = engine_process
        self.info: EngineInfo | None = None
        self.tokenizer = None  # set by start(); the front end's own (the core needs none)
        self.processor: Processor | None = None
        self.default_sampling: dict = {}
        """--generation-config defaults (set by start())."""
        self.output_processor: OutputProcessor | None = None
        self.stats = EngineStats()
        self.startup = PhaseTimes()
        """The front end's own start-up seconds (tokenizer, config), beside the core's in `info.startup_s`."""
        self.dead_reason: str | None = None
        self.label = label
        self._make_transport = transport
        self._front_end = None  # (tokenizer, hf_config), kept for engines that share this one's (start())
        self._transport = None  # ThreadTransport | ProcessTransport | RayTransport
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending_queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._num_inflight_seqs = 0
        self._listeners: list[Callable[[StepReport], None]] = []
        self._on_dead: list[Callable[[str], None]] = []

    # ---- life cycle -----------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the engine process now (its weights load while start() is not yet awaited); start() does
        this itself. With the engine on a thread, nothing starts before start()."""
        if self._ready is not None:
            return
        self._ready = asyncio.get_running_loop().create_future()
        if self._make_transport is not None:
            if self._engine_process is not None:
                self._engine_process.close()
            self._transport = self._make_transport(self.args, self._on_message)
        elif self.use_process:  # the child loads the weights while this process loads the tokenizer
            self._transport = ProcessTransport(self.args, self._on_message, self._engine_process)
        elif self._engine_process is not None:  # started in case: the engine runs on a thread after all
            self._engine_process.close()
        self._engine_process = None

    async def start(self, front_end: "AsyncEngine | None" = None) -> EngineInfo:
        """Start the loop and wait until the core is built; the tokenizer loads here meanwhile. Raises
        RuntimeError if the engine cannot start.

        front_end: a started engine of the same model whose tokenizer (and config) this one shares."""
        self.launch()
        try:
            if front_end is not None:
                tokenizer, hf_config = front_end._front_end
            else:
                # NOTE: on a thread, not beside the engine thread: transformers' lazy imports are not thread-safe.
                tokenizer, hf_config = await asyncio.to_thread(_load_front_end, self.args, self.startup,
                                                               self.args._lora_config() is not None)
        except Exception as e:
            tokenizer, hf_config = None, None
            front_error = f"{type(e).__name__}: {e}"
        else:
            front_error = None
        if self._transport is None:
            self._transport = ThreadTransport(self.args, self._on_message)
        ready: Ready = await self._ready
        error = ready.error or front_error
        if error is not None:
            transport, self._transport = self._transport, None
            transport.send(SHUTDOWN)
            transport.join(5.0)
            raise RuntimeError(f"engine failed to start: {error}")
        self.info, self.tokenizer = ready.info, tokenizer
        self._front_end = (tokenizer, hf_config)
        self.default_sampling = self.args.default_sampling()  # validated at EngineArgs; a small file read
        lora = self.args._lora_config()
        self.processor = Processor(tokenizer, ready.info, eos_token_ids(ready.info.config_eos_token_id, tokenizer),
                                   AdapterChecker(hf_config, lora) if lora else None)
        self.output_processor = OutputProcessor(tokenizer)
        return self.info

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineDeadError."""
        if self._transport is None:
            return
        transport, self._transport = self._transport, None
        transport.send(SHUTDOWN)
        await asyncio.to_thread(transport.join, timeout)
        self._fail_all("the engine is shut down")

    @property
    def is_running(self) -> bool:
        return self._transport is not None and self.dead_reason is None

    @property
    def capacity(self) -> int:
        return self.args.max_num_seqs + self.max_queue_len

    @property
    def num_inflight_seqs(self) -> int:
        return self._num_inflight_seqs

    @property
    def num_bytes_received(self) -> int:
        """Bytes the engine process has sent this process (0 with the engine on a thread)."""
        return getattr(self._transport, "num_bytes_received", 0)

    @property
    def pid(self) -> int | None:
        """The engine process's id (None with the engine on a thread)."""
        return getattr(self._transport, "pid", None)

    def has_request(self, request_id: str) -> bool:
        """The request is in flight here."""
        return request_id in self._streams

    def health(self) -> list[dict]:
        """Each engine core behind this front end: whether it runs, and why not."""
        return [{"engine": 0, "running": self.is_running, "error": None if self.is_running else self.dead_reason,
                 "pid": self.pid}]

    def add_listener(self, listener: Callable[[StepReport], None]) -> None:
        self._listeners.append(listener)

    def add_dead_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once, on the event loop, if the engine loop dies (not on shutdown)."""
        self._on_dead.append(listener)

    # ---- requests -------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          prompt_text: str | None = None, cache_pin: tuple[int, float] | None = None,
                          deadline: float | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request. Raises ValueError (it cannot run on this engine: the message says why),
        EngineOverloadedError (over capacity) or EngineDeadError. A failure inside the core later ends
        the stream with an output whose finish_reason is "error".

        cache_pin: (prefix tokens, TTL seconds) to pin in the prefix cache (see Engine.add_request).
        deadline: event-loop time (loop.time()) after which the request is aborted (RequestStream).
        lora_request: run with this adapter (checked here, once per adapter id; see check_lora)."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._num_inflight_seqs + params.n > self.capacity:
            raise EngineOverloadedError(
                f"the server is at capacity ({self._num_inflight_seqs} sequences in flight; at most "
                f"{self.args.max_num_seqs} running + {self.max_queue_len} waiting); retry later")
        arrival = time.monotonic()
        children = self.processor.make_requests(request_id, list(prompt_token_ids), params, arrival, cache_pin,
                                                lora_request)
        self.output_processor.add_group(request_id, prompt_text, prompt_token_ids,
                                        [c.request_id for c in children], params, arrival)
        stream = RequestStream(self, request_id, params.n, deadline,
                               delta=params.output_kind == RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        self._num_inflight_seqs += params.n
        self._transport.send(Add(children))
        return stream

    # ---- read-only questions to the core --------------------------------------------------------
    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raises ValueError naming what is wrong with the adapter (it loads it: call off the event loop)."""
        self.processor.check_lora(lora_request)

    async def explain_prefix(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> dict:
        """Engine.explain_prefix, asked between two steps. Raises ValueError (e.g. an empty prompt)."""
        self.processor.check_explain_prompt(token_ids)
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        explanation = await self._query("explain_prefix", list(token_ids), lora_id)
        return self.processor.explain(explanation, token_ids)

    async def prefix_cache_stats(self) -> dict:
        """Engine.prefix_cache_stats, asked between two steps."""
        return await self._query("prefix_cache_stats")

    async def _query(self, method: str, *args):
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        query_id = next(self._query_ids)
        answered = asyncio.get_running_loop().create_future()
        self._pending_queries[query_id] = answered
        self._transport.send(Query(query_id, method, args))
        try:
            result, error, internal = await answered
        finally:
            self._pending_queries.pop(query_id, None)
        if error is not None:
            raise EngineInternalError(error) if internal else ValueError(error)
        return result

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request; its final output (finish_reason "abort") ends its stream."""
        if self._transport is not None and request_id in self._streams:
            self._transport.send(Abort(self.output_processor.sample_ids(request_id)))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight; each stream ends with RequestAbortedError(reason) rather than
        an ordinary final output. Returns how many requests were aborted."""
        ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)
            self._streams[request_id]._queue.put_nowait(RequestAbortedError(reason))
            self._forget(request_id)
        return len(ids)

    # ---- messages from the loop (on the event loop) ---------------------------------------------
    def _on_message(self, message: object) -> None:
        if isinstance(message, CoreStep):
            self._on_step(message)
        elif isinstance(message, QueryResult):
            future = self._pending_queries.get(message.query_id)
            if future is not None and not future.done():
                future.set_result((message.result, message.error, message.internal))
        elif isinstance(message, Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, Stopped):
            died = message.error is not None and self._transport is not None  # not after start() failed
            if died:
                logger.error("engine loop stopped: %s", message.error)
                self.dead_reason = f"the engine{' (' + self.label + ')' if self.label else ''} stopped after an " \
                                   f"internal error ({_first_line(message.error)})"
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(Ready(None, message.error or "stopped before it was ready"))
            self._fail_all(self.dead_reason or "the engine is shut down")
            if died:
                for listener in self._on_dead:
                    listener(self.dead_reason)

    def _on_step(self, step: CoreStep) -> None:
        self.stats = step.stats
        processed = self.output_processor.process(step.outputs)
        if processed.reqs_to_abort and self._transport is not None:
            self._transport.send(Abort(processed.reqs_to_abort))
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._queue.put_nowait(out)
            if out.finished:
                self._forget(out.request_id)
        report = StepReport(processed.request_outputs, step.stats, processed.stats, step.kv_events)
        for listener in self._listeners:
            listener(report)

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_inflight_seqs -= stream.num_seqs

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        for future in self._pending_queries.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for request_id, stream in list(self._streams.items()):
            stream._queue.put_nowait(EngineDeadError(reason))
            self._forget(request_id)


def _first_line(error: str) -> str:
    """A traceback's last line (the exception), or a one-line message as it is."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else error


def _load_front_end(args: EngineArgs, phases: PhaseTimes, with_config: bool):
    """The tokenizer and (with_config: LoRA adapters are checked against it) the model's config, read by the front
    end itself while the core loads weights."""
    from kvserve.model_loader.loader import ModelSource, load_hf_config, load_tokenizer

    source = ModelSource.resolve(args.model)
    with phases.phase("tokenizer"):
        tokenizer = load_tokenizer(source, args.load_format == "dummy")
    if not with_config:
        return tokenizer, None
    with phases.phase("front-end config"):
        return tokenizer, load_hf_config(source)
