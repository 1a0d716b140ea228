"""RayTransport: the engine loop in a Ray actor (`--data-parallel-size N --distributed-executor-backend ray`), on
this machine or any node of a Ray cluster; the third transport beside the thread and the process
(engine/engine_loop.py), carrying the same messages.

    front end --send--> EngineActor.send (in order: a concurrency group of one) --> inbox --> EngineLoop
    front end <--reader thread: EngineActor.poll (long poll, a group of its own)-- outbox <-- EngineLoop

The actor runs the loop on a thread of its own process (a Ray worker); with tensor parallelism its ranks are
Ray actors too (worker/tp_ray.py, joining the same Ray). An actor that dies (its node lost, killed) ends the
poll with a Ray error, reported as the engine's Stopped message, as a dead engine process is.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable

from kvserve.config import EngineArgs
from kvserve.engine.engine_loop import Stopped, _serve_engine, drain_queue

logger = logging.getLogger(__name__)
_POLL_S = 0.5


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'kvserve[ray]' (or use mp on "
                         "one machine)") from e
    return ray


def connect_ray(num_slots: int = 2) -> bool:
    """Join a running Ray (RAY_ADDRESS, or `ray start` on this machine) or start a local one with at least
    num_slots CPU slots; True when started here."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    # NOTE: ray.init replaces this process's SIGTERM handler (with one that exits at once) and adds its own crash
    # handler in C++, which aborts a server's graceful shutdown: the server's own handlers stay
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        return _init_ray(ray, num_slots)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def _init_ray(ray, num_slots: int) -> bool:
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        pass
    # NOTE: CPU slots are Ray's bookkeeping for placement, not cores
    ray.init(num_cpus=max(2, num_slots, os.cpu_count() or 1), include_dashboard=False)
    return True


class EngineActor:
    """The engine loop in a Ray actor: commands in through send(), messages out through poll()."""

    def __init__(self, args: EngineArgs):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve_engine, args=(args, self._recv, self._outbox.put),
                                        name="kvserve-engine", daemon=True)
        self._thread.start()

    def _recv(self, block: bool) -> list:
        return drain_queue(self._inbox, block)

    def send(self, commands: list) -> None:
        for command in commands:
            self._inbox.put(command)

    def poll(self) -> list:
        """What the loop emitted, waiting up to _POLL_S for the first message."""
        return drain_queue(self._outbox, True, _POLL_S)

    def pid(self) -> int:
        return os.getpid()


class RayTransport:
    """The loop in an EngineActor; a reader thread long-polls it and forwards its messages to the event loop."""

    def __init__(self, args: EngineArgs, on_message: Callable[[object], None]):
        ray = import_ray()
        loop = asyncio.get_running_loop()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        rest = os.environ.get("PYTHONPATH")
        actor_cls = ray.remote(concurrency_groups={"send": 1, "poll": 1})(EngineActor)
        self._actor = actor_cls.options(
            num_cpus=1, runtime_env={"env_vars": {"PYTHONPATH": root + (os.pathsep + rest if rest else "")}},
        ).remote(args)
        self._ray = ray
        self.pid: int | None = None
        self._stopped = threading.Event()

        def read() -> None:
            try:
                self.pid = ray.get(self._actor.pid.options(concurrency_group="poll").remote())
            except Exception:  # noqa: BLE001 — the poll below reports the actor's death
                pass
            while True:
                try:
                    messages = ray.get(self._actor.poll.options(concurrency_group="poll").remote())
                except Exception as e:  # noqa: BLE001 — the actor died (killed, node lost) or Ray went away
                    messages = [Stopped(f"engine actor died ({type(e).__name__})")]
                for message in messages:
                    try:
                        loop.call_soon_threadsafe(on_message, message)
                    except RuntimeError:
                        return
                    if isinstance(message, Stopped):
                        self._stopped.set()
                        return

        self._reader = threading.Thread(target=read, name="kvserve-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: object) -> None:
        if not self._stopped.is_set():
            self._actor.send.options(concurrency_group="send").remote([command])

    def join(self, timeout: float) -> None:
        """After SHUTDOWN: wait for the loop's Stopped, then end the actor."""
        self._stopped.wait(timeout)
        try:
            self._ray.kill(self._actor)
        except Exception:  # noqa: BLE001 — already gone
            pass

    def kill(self) -> None:
        """End the actor now (tests: an engine lost)."""
        self._ray.kill(self._actor)

