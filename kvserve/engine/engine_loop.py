"""The engine loop: an EngineCore stepping continuously, driven by messages, on a thread or in a child process.

    front end --Add / Abort / Query--> transport --> EngineLoop (owns the EngineCore)
    front end <--CoreStep (per-step deltas, stats) / QueryResult / Ready / Stopped-- transport

The loop makes every core call (the core is not thread-safe), blocks on its inbox while idle (no spinning)
and, while busy, applies whatever arrived between two steps, so an abort frees its KV blocks before the
next step runs. Both transports carry the same messages; only how they cross differs. The front end that
drives it is engine/async_engine.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import EngineArgs
from kvserve.core_types import EngineCoreOutput, EngineCoreRequest
from kvserve.engine.core import EngineCore, EngineInfo
from kvserve.kv_cache.events import KVEvent
from kvserve.engine.engine_process import EngineProcess
from kvserve.utils.memory import resident_memory_bytes
from kvserve.utils.startup_clock import PhaseTimes

logger = logging.getLogger(__name__)


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



# ---- messages between the front end and the loop (all picklable, for the process transport) ----
@dataclass(frozen=True)
class Add:
    requests: list[EngineCoreRequest]  # the samples of one user request, validated by the front end


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Query:
    """A read-only question for the core, answered between steps (the debug endpoints)."""

    query_id: int
    method: str  # one of _QUERY_METHODS
    args: tuple = ()


# NOTE: an allow-list, so a message can never make the loop call a core method that changes state.
_QUERY_METHODS = ("explain_prefix", "prefix_cache_stats")


@dataclass(frozen=True)
class QueryResult:
    query_id: int
    result: object
    error: str | None  # the core's ValueError message; None on success
    internal: bool = False


@dataclass(frozen=True)
class CoreStep:
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    kv_events: list[KVEvent] = field(default_factory=list)
    """What entered and left the prefix cache in this step (--kv-events-config; else empty)."""


@dataclass(frozen=True)
class Ready:
    info: EngineInfo | None
    error: str | None


@dataclass(frozen=True)
class Stopped:
    error: str | None  # None after a requested shutdown


SHUTDOWN = "shutdown"


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
        self._rss = (0.0, 0)  # (when read, bytes)

    def run(self) -> None:
        core = self.core
        while True:
            failed: list[EngineCoreOutput] = []
            for command in self._recv(not core.has_unfinished_requests()):
                if command == SHUTDOWN:
                    return
                failed += self._apply(command)
            if core.has_unfinished_requests():
                start = time.perf_counter()
                outputs = core.step()
                self._busy_s += time.perf_counter() - start
                self._num_steps += 1
                self._emit(CoreStep(failed + outputs, self.stats(), core.drain_kv_events()))
            elif failed:
                self._emit(CoreStep(failed, self.stats()))

    def _apply(self, command) -> list[EngineCoreOutput]:
        if isinstance(command, Abort):
            self.core.abort_requests(command.request_ids)
            return []
        if isinstance(command, Query):
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

    def _answer(self, query: Query) -> None:
        if query.method not in _QUERY_METHODS:
            self._emit(QueryResult(query.query_id, None, f"unknown engine query {query.method!r}"))
            return
        try:
            result = getattr(self.core, query.method)(*query.args)
        except ValueError as e:
            self._emit(QueryResult(query.query_id, None, str(e)))
        except Exception as e:  # read-only queries: a failure leaves the core as it was
            logger.exception("engine query %s failed", query.method)
            self._emit(QueryResult(query.query_id, None, f"{type(e).__name__}: {e}", internal=True))
        else:
            self._emit(QueryResult(query.query_id, result, None))

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
            resident_memory_bytes=self._resident_memory(),
            num_spec_drafts_total=sched.stats.num_spec_drafts,
            num_spec_draft_tokens_total=sched.stats.num_spec_draft_tokens,
            num_spec_accepted_tokens_total=sched.stats.num_spec_accepted_tokens,
            num_spec_accepted_per_pos_total=tuple(sched.stats.num_spec_accepted_per_pos or ()))


    def _resident_memory(self) -> int:
        """Resident memory, read at most every RSS_INTERVAL_S: a /proc read on every step of a 10 ms decode
        is ~1% of the step, for a gauge scraped every few seconds."""
        now = time.monotonic()
        if now - self._rss[0] >= RSS_INTERVAL_S:
            self._rss = (now, resident_memory_bytes())
        return self._rss[1]


RSS_INTERVAL_S = 0.5


def _serve_engine(args: EngineArgs, recv: Callable[[bool], list], emit: Callable[[object], None],
                  import_s: float | None = None) -> None:
    """Body of the engine thread or process: build the core, report ready, loop until shutdown.

    import_s: the engine has its own process, which took this long to start and import its modules."""
    own_process = import_s is not None
    phases = PhaseTimes()
    if own_process:
        phases.add("engine import", import_s)
    try:
        with phases.phase("config"):
            config = args.create_engine_config()
        core = EngineCore(config)
        phases.seconds.update(core.info.startup_s)  # weights, kernels, kv cache, warm-up
        if own_process:  # this process holds this one engine until it exits
            with phases.phase("gc freeze"):
                EngineCore.freeze_gc()
    except Exception as e:  # a bad --model or flag: the server reports it and exits
        logger.debug("engine start-up failed", exc_info=True)
        emit(Ready(None, f"{type(e).__name__}: {e}"))
        return
    emit(Ready(dataclasses.replace(core.info, startup_s=phases.seconds), None))
    try:
        EngineLoop(core, recv, emit).run()
    except Exception:
        emit(Stopped(traceback.format_exc()))
        return
    finally:
        core.shutdown()  # tensor parallelism: the worker processes end with the loop
    emit(Stopped(None))


# ---- transports ---------------------------------------------------------------------------------
def drain_queue(q: queue.SimpleQueue, block: bool, timeout: float | None = None) -> list:
    """Everything in q now; when `block`, first waiting for one item (at most `timeout` seconds, if given)."""
    items = []
    try:
        items.append(q.get(block=block, timeout=timeout if block else None))
        while True:
            items.append(q.get_nowait())
    except queue.Empty:
        pass
    return items


class ThreadTransport:
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
        return drain_queue(self._inbox, block)

    def send(self, command: object) -> None:
        self._inbox.put(command)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def process_main(args: EngineArgs, conn, import_s: float) -> None:
    """The engine process's body once it has its arguments (engine/engine_process.py started it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def recv(block: bool) -> list:
        commands = []
        try:
            if block or conn.poll(0):
                commands.append(conn.recv())
            while conn.poll(0):
                commands.append(conn.recv())
        except EOFError:  # the server process is gone
            commands.append(SHUTDOWN)
        return commands

    _serve_engine(args, recv, conn.send, import_s)


class ProcessTransport:
    """The loop in a spawned child process, over a duplex pipe; a reader thread forwards its messages.

    process: the engine process `kvserve serve` started first thing (engine/engine_process.py), its imports
    done or under way; None: one is started now."""

    def __init__(self, args: EngineArgs, on_message: Callable[[object], None], process: EngineProcess | None = None):
        loop = asyncio.get_running_loop()
        process = process or EngineProcess()
        process.send_args(args)
        self._conn, self._process = process.conn, process.process
        self.num_bytes_received = 0

        def read() -> None:
            while True:
                try:
                    raw = self._conn.recv_bytes()
                    self.num_bytes_received += len(raw)
                    message = _loads(raw)
                except (EOFError, OSError):
                    message = Stopped(f"engine process exited (code {self._process.exitcode})")
                try:
                    loop.call_soon_threadsafe(on_message, message)
                except RuntimeError:
                    return
                if isinstance(message, Stopped):
                    return

        self._reader = threading.Thread(target=read, name="kvserve-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

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
