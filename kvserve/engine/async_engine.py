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

The loop runs on a thread of this process or, with `use_process=True` (what `kvserve serve` does by
default), in a spawned child process; both run the same EngineLoop on the same messages, only the
transport differs. docs/SERVER.md records the measurement behind the server's choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.config import EngineArgs
from kvserve.engine.core import EngineCore, EngineInfo
from kvserve.engine.core_types import EngineCoreOutput, EngineCoreRequest
from kvserve.engine.output_processor import IterationStats, OutputProcessor
from kvserve.lora.checker import AdapterChecker
from kvserve.lora.request import LoRARequest
from kvserve.engine.processor import Processor, eos_token_ids
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.utils.memory import resident_memory_bytes

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


@dataclass(frozen=True)
class EngineStats:
    """Engine state right after a step. Counters (num_*_total, busy_s) are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks held by requests (BlockPool.usage)."""
    num_preemptions_total: int = 0
    num_prefix_query_tokens_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_pinned_blocks: int = 0
    """KV blocks held by prompt-cache pins (cache_control) right now."""
    num_steps_total: int = 0
    busy_s: float = 0.0
    """Seconds spent inside Engine.step(); its growth over wall time is the loop's busy fraction."""
    num_kv_blocks_total: int = 0
    num_kv_request_blocks: int = 0
    """KV blocks held by requests' block tables (not counting blocks only prompt-cache pins hold)."""
    resident_memory_bytes: int = 0
    """Resident memory of the process the engine runs in."""
    num_spec_drafts_total: int = 0
    """Speculative decoding: verifications, draft tokens scored, accepted, and accepted per draft position."""
    num_spec_draft_tokens_total: int = 0
    num_spec_accepted_tokens_total: int = 0
    num_spec_accepted_per_pos_total: tuple[int, ...] = ()


@dataclass
class StepReport:
    """Everything one step produced: the changed requests' outputs, what the step did (its tokens and
    latencies, whatever the outputs' kinds) and the engine's stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats
    iteration: IterationStats


# ---- messages between the asyncio side and the loop (all picklable, for the process transport) ----
@dataclass(frozen=True)
class _Add:
    requests: list[EngineCoreRequest]  # the samples of one user request, validated by the front end


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Query:
    """A read-only question for the core, answered between steps (the debug endpoints)."""

    query_id: int
    method: str  # one of _QUERY_METHODS
    args: tuple = ()


# NOTE: an allow-list, so a message can never make the loop call a core method that changes state.
_QUERY_METHODS = ("explain_prefix", "prefix_cache_stats")


@dataclass(frozen=True)
class _QueryResult:
    query_id: int
    result: object
    error: str | None  # the core's ValueError message; None on success
    internal: bool = False


@dataclass(frozen=True)
class _CoreStep:
    outputs: list[EngineCoreOutput]
    stats: EngineStats


@dataclass(frozen=True)
class _Ready:
    info: EngineInfo | None
    error: str | None


@dataclass(frozen=True)
class _Stopped:
    error: str | None  # None after a requested shutdown


_SHUTDOWN = "shutdown"


class EngineLoop:
    """Owns an EngineCore: applies add/abort/query commands between steps and steps while there is work.

    `recv(block)` returns the commands that arrived (waiting for at least one when `block`);
    `emit(message)` hands a message to the asyncio side. Both are the transport's.
    """

    def __init__(self, core: EngineCore, recv: Callable[[bool], list], emit: Callable[[object], None]):
        self.core = core
        self._recv = recv
        self._emit = emit
        self._busy_s = 0.0
        self._num_steps = 0

    def run(self) -> None:
        core = self.core
        while True:
            failed: list[EngineCoreOutput] = []
            for command in self._recv(not core.has_unfinished_requests()):
                if command == _SHUTDOWN:
                    return
                failed += self._apply(command)
            if core.has_unfinished_requests():
                start = time.perf_counter()
                outputs = core.step()
                self._busy_s += time.perf_counter() - start
                self._num_steps += 1
                self._emit(_CoreStep(failed + outputs, self.stats()))
            elif failed:
                self._emit(_CoreStep(failed, self.stats()))

    def _apply(self, command) -> list[EngineCoreOutput]:
        if isinstance(command, _Abort):
            self.core.abort_requests(command.request_ids)
            return []
        if isinstance(command, _Query):
            self._answer(command)
            return []
        failed = []
        for req in command.requests:
            try:
                self.core.add_request(req)
            except Exception as e:  # NOTE: validated by the front end: this is the core's fault, not the client's
                logger.exception("adding request %s failed", req.request_id)
                failed.append(self.core.fail_request(req.request_id, f"{type(e).__name__}: {e}"))
        return failed

    def _answer(self, query: _Query) -> None:
        if query.method not in _QUERY_METHODS:
            self._emit(_QueryResult(query.query_id, None, f"unknown engine query {query.method!r}"))
            return
        try:
            result = getattr(self.core, query.method)(*query.args)
        except ValueError as e:
            self._emit(_QueryResult(query.query_id, None, str(e)))
        except Exception as e:  # read-only queries: a failure leaves the core as it was
            logger.exception("engine query %s failed", query.method)
            self._emit(_QueryResult(query.query_id, None, f"{type(e).__name__}: {e}", internal=True))
        else:
            self._emit(_QueryResult(query.query_id, result, None))

    def stats(self) -> EngineStats:
        sched = self.core.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=self.core.block_pool.usage,
            num_preemptions_total=sched.stats.num_preemptions,
            num_prefix_query_tokens_total=sched.stats.num_prefix_query_tokens,
            num_prefix_hit_tokens_total=sched.stats.num_prefix_hit_tokens,
            num_pinned_blocks=sched.kv.pins.num_pinned,
            num_steps_total=self._num_steps, busy_s=self._busy_s,
            num_kv_blocks_total=self.core.block_pool.num_blocks,
            num_kv_request_blocks=sched.kv.num_request_blocks,
            resident_memory_bytes=resident_memory_bytes(),
            num_spec_drafts_total=sched.stats.num_spec_drafts,
            num_spec_draft_tokens_total=sched.stats.num_spec_draft_tokens,
            num_spec_accepted_tokens_total=sched.stats.num_spec_accepted_tokens,
            num_spec_accepted_per_pos_total=tuple(sched.stats.num_spec_accepted_per_pos or ()))


def _serve_engine(args: EngineArgs, recv: Callable[[bool], list], emit: Callable[[object], None],
                  own_process: bool = False) -> None:
    """Body of the engine thread or process: build the core, report ready, loop until shutdown."""
    try:
        core = EngineCore(args.create_engine_config())
        if own_process:  # this process holds this one engine until it exits
            EngineCore.freeze_gc()
    except Exception as e:  # a bad --model or flag: the server reports it and exits
        logger.debug("engine start-up failed", exc_info=True)
        emit(_Ready(None, f"{type(e).__name__}: {e}"))
        return
    emit(_Ready(core.info, None))
    try:
        EngineLoop(core, recv, emit).run()
    except Exception:
        emit(_Stopped(traceback.format_exc()))
        return
    emit(_Stopped(None))


# ---- transports ---------------------------------------------------------------------------------
class _ThreadTransport:
    """The loop on a thread of this process; messages are handed over with call_soon_threadsafe."""

    def __init__(self, args: EngineArgs, on_message: Callable[[object], None]):
        loop = asyncio.get_running_loop()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()

        def emit(message: object) -> None:
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the event loop closed first (interpreter shutdown)
                pass

        self._thread = threading.Thread(target=_serve_engine, args=(args, self._recv, emit),
                                        name="kvserve-engine", daemon=True)
        self._thread.start()

    def _recv(self, block: bool) -> list:
        commands = []
        try:
            commands.append(self._inbox.get(block=block))
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return commands

    def send(self, command: object) -> None:
        self._inbox.put(command)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _process_main(args: EngineArgs, conn) -> None:
    # NOTE: Ctrl+C (and a service manager's SIGTERM) can reach the whole process group; the server process
    # decides when the engine stops (it sends _SHUTDOWN after draining; if it dies, the pipe's EOF stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def recv(block: bool) -> list:
        commands = []
        try:
            if block or conn.poll(0):
                commands.append(conn.recv())
            while conn.poll(0):
                commands.append(conn.recv())
        except EOFError:  # the server process is gone
            commands.append(_SHUTDOWN)
        return commands

    _serve_engine(args, recv, conn.send, own_process=True)


class _ProcessTransport:
    """The loop in a spawned child process, over a duplex pipe; a reader thread forwards its messages."""

    def __init__(self, args: EngineArgs, on_message: Callable[[object], None]):
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # NOTE: fork after torch/tokenizer threads started can deadlock
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_process_main, args=(args, child_conn), name="kvserve-engine",
                                    daemon=True)
        self._process.start()
        child_conn.close()
        self.num_bytes_received = 0

        def read() -> None:
            while True:
                try:
                    raw = self._conn.recv_bytes()
                    self.num_bytes_received += len(raw)
                    message = _loads(raw)
                except (EOFError, OSError):
                    message = _Stopped(f"engine process exited (code {self._process.exitcode})")
                try:
                    loop.call_soon_threadsafe(on_message, message)
                except RuntimeError:
                    return
                if isinstance(message, _Stopped):
                    return

        self._reader = threading.Thread(target=read, name="kvserve-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: object) -> None:
        try:
            self._conn.send(command)
        except OSError:  # the process died; the reader thread reports it
            pass

    def join(self, timeout: float) -> None:
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()


def _loads(raw: bytes):
    from multiprocessing.reduction import ForkingPickler

    return ForkingPickler.loads(raw)


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

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self.deadline):
                item = await self._queue.get()
        except TimeoutError:
            self.close()
            raise RequestTimeoutError("the request ran past the server's deadline (--request-timeout) "
                                      "and was aborted") from None
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            newer = self._queue.get_nowait()
            item = newer if isinstance(newer, BaseException) else _merge(item, newer, self.delta)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        for i, ids in enumerate(item.new_token_ids):
            self.num_output_tokens[i] += len(ids)
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
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
        new_texts=[a + b for a, b in zip(older.new_texts, newer.new_texts)])


class AsyncEngine:
    """The front end of an EngineCore stepping in the background, with admission control, for asyncio.

    Use from one event loop: `await start()`, then `stream = await add_request(...)` (raises ValueError
    for a request the engine cannot run, EngineOverloadedError past capacity) and `async for out in
    stream`. At most max_num_seqs + max_queue_len sequences (a request with n samples counts n) are in
    flight. Listeners get every StepReport on the event loop (metrics). `explain_prefix` and
    `prefix_cache_stats` ask the core itself (it may live in another process), between two steps.
    """

    def __init__(self, args: EngineArgs, *, max_queue_len: int = 256, use_process: bool = False):
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.args = args
        self.max_queue_len = max_queue_len
        self.use_process = use_process
        self.info: EngineInfo | None = None
        self.tokenizer = None  # set by start(); the front end's own (the core needs none)
        self.processor: Processor | None = None
        self.default_sampling: dict = {}
        """--generation-config defaults (set by start())."""
        self.output_processor: OutputProcessor | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self._transport: _ThreadTransport | _ProcessTransport | None = None
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending_queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._num_inflight_seqs = 0
        self._listeners: list[Callable[[StepReport], None]] = []
        self._on_dead: list[Callable[[str], None]] = []

    # ---- life cycle -----------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Start the loop and wait until the core is built; the tokenizer loads here meanwhile. Raises
        RuntimeError if the engine cannot start."""
        self._ready = asyncio.get_running_loop().create_future()
        transport = _ProcessTransport if self.use_process else _ThreadTransport
        if self.use_process:  # the child loads the weights while this process loads the tokenizer
            self._transport = transport(self.args, self._on_message)
        try:
            # NOTE: on a thread, not beside the engine thread: transformers' lazy imports are not thread-safe.
            tokenizer, hf_config = await asyncio.to_thread(_load_front_end, self.args)
        except Exception as e:
            tokenizer, hf_config = None, None
            front_error = f"{type(e).__name__}: {e}"
        else:
            front_error = None
        if self._transport is None:
            self._transport = transport(self.args, self._on_message)
        ready: _Ready = await self._ready
        error = ready.error or front_error
        if error is not None:
            transport, self._transport = self._transport, None
            transport.send(_SHUTDOWN)
            transport.join(5.0)
            raise RuntimeError(f"engine failed to start: {error}")
        self.info, self.tokenizer = ready.info, tokenizer
        self.default_sampling = self.args.default_sampling()  # validated at EngineArgs; a small file read
        lora = self.args._lora_config()
        self.processor = Processor(tokenizer, ready.info, eos_token_ids(hf_config, tokenizer),
                                   AdapterChecker(hf_config, lora) if lora else None)
        self.output_processor = OutputProcessor(tokenizer)
        return self.info

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineDeadError."""
        if self._transport is None:
            return
        transport, self._transport = self._transport, None
        transport.send(_SHUTDOWN)
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
        self._transport.send(_Add(children))
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
        self._transport.send(_Query(query_id, method, args))
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
            self._transport.send(_Abort(self.output_processor.sample_ids(request_id)))

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
        if isinstance(message, _CoreStep):
            self._on_step(message)
        elif isinstance(message, _QueryResult):
            future = self._pending_queries.get(message.query_id)
            if future is not None and not future.done():
                future.set_result((message.result, message.error, message.internal))
        elif isinstance(message, _Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, _Stopped):
            died = message.error is not None and self._transport is not None  # not after start() failed
            if died:
                logger.error("engine loop stopped: %s", message.error)
                self.dead_reason = "the engine stopped after an internal error"
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(_Ready(None, message.error or "stopped before it was ready"))
            self._fail_all(self.dead_reason or "the engine is shut down")
            if died:
                for listener in self._on_dead:
                    listener(self.dead_reason)

    def _on_step(self, step: _CoreStep) -> None:
        self.stats = step.stats
        processed = self.output_processor.process(step.outputs)
        if processed.reqs_to_abort and self._transport is not None:
            self._transport.send(_Abort(processed.reqs_to_abort))
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._queue.put_nowait(out)
            if out.finished:
                self._forget(out.request_id)
        report = StepReport(processed.request_outputs, step.stats, processed.stats)
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


def _load_front_end(args: EngineArgs):
    """The tokenizer and the model's config, read by the front end itself while the core loads weights."""
    from kvserve.models.loader import ModelSource, load_hf_config, load_tokenizer

    source = ModelSource.resolve(args.model)
    return load_tokenizer(source), load_hf_config(source)
