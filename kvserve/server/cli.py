"""`kvserve serve`: the OpenAI-compatible HTTP server on uvicorn, with every engine flag.

SIGTERM (or Ctrl+C) stops accepting connections, lets in-flight requests finish within
--shutdown-timeout seconds, aborts what is left, stops the engine and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from kvserve.config import EngineArgs
from kvserve.server.api_server import build_app
from kvserve.server.config import ServerConfig

logger = logging.getLogger("kvserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    config = ServerConfig.from_cli(args)
    engine_args = EngineArgs.from_cli(args)
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    # NOTE: tests start the server with --port 0 and read the chosen port from this line.
    print(f"kvserve: serving on http://{_url_host(host)}:{port}", flush=True)
    server = _GracefulServer(uvicorn.Config(
        build_app(config, engine_args), log_level="info", access_log=config.access_log,
        timeout_graceful_shutdown=config.shutdown_timeout, timeout_keep_alive=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1


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
    SIGTERM is a success, so the process exits 0 instead of dying by the signal (status 143)."""

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
    parser = argparse.ArgumentParser(prog="kvserve serve", description="serve the OpenAI-compatible HTTP API")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
