"""Disaggregated prefill/decode for tests (tests/e2e/test_proxy.py): each connector's --kv-transfer-config for a
prefill and a decode instance, `kvserve proxy` in a subprocess, and the instances' KV block accounting read
from /metrics."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from tests.helpers.router import Router, start_routing
from tests.helpers.server import Server, metric, stop_server


def transfer_config(connector: str, role: str, store: Path) -> str:
    """The --kv-transfer-config JSON of a prefill (role "prefill") or decode ("decode") instance."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    config: dict = {"kv_connector": connector, "kv_role": kv_role}
    if connector in ("SharedStorageConnector", "ExampleConnector"):
        config["kv_connector_extra_config"] = {"shared_storage_path": str(store)}
    elif connector in ("NixlConnector", "PullConnector"):
        # a free side-channel port each; a short lease, so KV prefilled for a decode that never came (a
        # decode instance killed, a body the decode side refused) is freed within a test's block check
        config.update(kv_port=0, kv_connector_extra_config={"lease_s": 5})
    return json.dumps(config)


def start_proxy(prefill: list[str], decode: list[str], log_path: Path, *flags: str, timeout: float = 60.0) -> Router:
    return start_routing(["proxy", *[a for url in prefill for a in ("--prefill", url)],
                          *[a for url in decode for a in ("--decode", url)], *flags], log_path, timeout=timeout)


def stop_servers(servers: list[Server]) -> None:
    """SIGTERM to all at once, then wait for each (killed ones included)."""
    for srv in servers:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGCONT)  # NOTE: a stopped process never sees SIGTERM
            srv.proc.send_signal(signal.SIGTERM)
    for srv in servers:
        stop_server(srv)


def free_blocks(server: Server) -> int:
    """KV blocks of the instance's pool that no request (running, or held for a transfer) holds."""
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        total = metric(http, "kvserve:kv_cache_total_blocks")
        return int(total - metric(http, "kvserve:kv_cache_request_blocks"))


def assert_free_blocks_return(servers: dict[str, Server], start: dict[str, int], timeout: float = 15.0) -> None:
    """Every instance's free block count comes back to its starting value (no block leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        now = {name: free_blocks(srv) for name, srv in servers.items()}
        if all(now[name] == start[name] for name in servers) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert now == {name: start[name] for name in servers}, f"free blocks now {now}, at the start {start}"
