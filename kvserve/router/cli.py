"""`kvserve router --worker URL [--worker URL ...] --policy ...` (or `--pd-disaggregation --prefill URL --decode
URL`): the router on uvicorn."""
from __future__ import annotations

import argparse
import logging

import uvicorn

from kvserve.router.app import build_router_app
from kvserve.router.config import RouterConfig
from kvserve.server.cli import _bind, _GracefulServer, _url_host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    RouterConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    return serve(RouterConfig.from_cli(args))


def serve(config: RouterConfig) -> int:
    """The router (or `kvserve proxy`) on uvicorn until SIGTERM; the exit status."""
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]

    def on_ready() -> None:
        # NOTE: tests start the router with --port 0 and read the chosen port from this line.
        print(f"kvserve: routing on http://{_url_host(host)}:{port}", flush=True)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    app = build_router_app(config, on_ready=on_ready)
    # NOTE: serve's server class, so SIGTERM ends in-flight requests gracefully and the exit status is 0.
    server = _GracefulServer(uvicorn.Config(app, log_level="info", access_log=False, timeout_keep_alive=5), app,
                             drain_timeout=0.0)
    server.run(sockets=[sock])
    return 0 if server.started else 1
