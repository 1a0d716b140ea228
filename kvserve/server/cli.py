"""`kvserve serve`: the OpenAI-compatible HTTP server on uvicorn, with every engine flag.

SIGTERM (or Ctrl+C) stops accepting connections and new requests (503), lets in-flight requests finish
within --shutdown-timeout seconds, then aborts what is left (open streams end with an error event and
`[DONE]`), stops the engine and exits 0. If the engine loop dies, in-flight requests get errors, /health
answers 503 and the process exits 1, so a supervisor restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from kvserve.config import EngineArgs
from kvserve.model_loader.loader import ModelSource
from kvserve.server.api_server import build_app
from kvserve.server.config import ServerConfig
from kvserve.utils.cli_help import DefaultsHelpFormatter
from kvserve.utils.startup_clock import format_phases, process_age_s

logger = logging.getLogger("kvserve.server")

# Seconds after the aborts for the streams' closing error events to reach their clients.
_ABORT_FLUSH_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    import_s = process_age_s()  # the interpreter's start and every import up to here
    config = ServerConfig.from_cli(args)
    engine_args = EngineArgs.from_cli(args)
    ModelSource.resolve(engine_args.model)  # a wrong --model fails here, before anything is announced
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]

    def on_ready() -> None:
        engine = app.state.kvserve.engine
        # NOTE: `kvserve bench startup` reads this line (utils/startup_clock.py); the front end's phases overlap
        # the engine's, so the phases add up to more than `ready`.
        logger.info(format_phases({"import": import_s, **engine.startup.seconds, **engine.info.startup_s,
                                   "ready": process_age_s()}))
        # NOTE: tests start the server with --port 0 and read the chosen port from this line.
        print(f"kvserve: serving on http://{_url_host(host)}:{port}", flush=True)

    app = build_app(config, engine_args, on_ready=on_ready, on_engine_dead=lambda reason: server.fail(reason),
                    engine_process=getattr(args, "engine_process", None))
    # NOTE: uvicorn's own grace period outlasts ours, so the error events of aborted streams get written.
    server = _GracefulServer(uvicorn.Config(
        app, log_level="info", access_log=config.access_log,
        timeout_graceful_shutdown=config.shutdown_timeout + _ABORT_FLUSH_S, timeout_keep_alive=5),
        app, drain_timeout=config.shutdown_timeout)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    return server.exit_code


def _bind(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) so that port 0 resolves to a real port before the engine loads; until
    uvicorn listens, connections are refused rather than left hanging."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, minus its re-raising of the signal after shutdown: a drained shutdown on
    SIGTERM is a success, so the process exits 0 instead of dying by the signal (status 143).

    On shutdown it first marks the server as draining (new requests: 503), and aborts whatever is still
    in flight after `drain_timeout` seconds, so every stream ends with an error event, not a cut."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout: float):
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self.exit_code = 0

    def fail(self, reason: str) -> None:
        """The engine died: shut down and exit non-zero."""
        logger.error("shutting down: %s", reason)
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        state = getattr(self.app.state, "kvserve", None)  # None: the engine never started
        aborter = None
        if state is not None:
            state.draining = True
            aborter = asyncio.create_task(self._abort_after(state, self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            if aborter is not None:
                aborter.cancel()

    @staticmethod
    async def _abort_after(state, timeout: float) -> None:
        await asyncio.sleep(timeout)
        num = state.engine.abort_all("the server is shutting down (--shutdown-timeout passed)")
        if num:
            logger.warning("aborted %d request(s) still running after --shutdown-timeout %g s", num, timeout)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for in-flight requests
        else:
            logger.info("received %s: no new connections; waiting for in-flight requests",
                        signal.Signals(sig).name)
            self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.server.cli`: the same as `kvserve serve`."""
    parser = argparse.ArgumentParser(prog="kvserve serve", description="serve the OpenAI-compatible HTTP API",
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
