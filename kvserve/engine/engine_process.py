"""The engine's child process, started before the server has imported anything heavy.

`kvserve serve` spends its first seconds importing (torch, FastAPI, transformers) in the server process, and the
spawned engine process then imports the same again before it can load the model. Started here, first thing,
the engine process imports its modules while the server process imports its own; it then waits for its
EngineArgs on the pipe (EngineProcess.send_args, from the transport), and runs the engine loop
(engine/engine_loop.py) as a process started later would. This module imports nothing heavy itself: it is
what the server process imports before anything else.
"""
from __future__ import annotations

import multiprocessing


class EngineProcess:
    """A spawned engine process and its end of a duplex pipe. Unused (the server fails first, or runs its engine
    on a thread), it sees the pipe close, or the server's exit, and ends."""

    def __init__(self):
        # NOTE: spawn, not fork: fork after torch/tokenizer threads started can deadlock
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_main, args=(child_conn,), name="kvserve-engine", daemon=True)
        self.process.start()
        child_conn.close()

    def send_args(self, args) -> None:
        self.conn.send(args)

    def close(self) -> None:
        """Not needed after all: end the process (it is waiting for its arguments)."""
        self.conn.close()
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()


def _main(conn) -> None:
    import signal

    # NOTE: Ctrl+C (and a service manager's SIGTERM) can reach the whole process group; the server process
    # decides when the engine stops (it sends SHUTDOWN after draining; if it dies, the pipe's EOF stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kvserve.engine.engine_loop import process_main
    from kvserve.utils.startup_clock import process_age_s

    # Every model's config is a transformers config class; their base module's imports (torch.distributed.tensor,
    # sympy) are seconds, spent here while the server process is still importing rather than after.
    import transformers.configuration_utils  # noqa: F401

    import_s = process_age_s()  # the interpreter's start and the engine's imports, before the wait for work
    try:
        args = conn.recv()
    except EOFError:  # the server never needed us
        return
    process_main(args, conn, import_s)
