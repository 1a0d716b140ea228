"""`kvserve bench soak`: its judging of answers and its traffic in isolation, then 0.4 minutes of soak
against a real `kvserve serve` (tiny model, admission limits of 8 + 8 sequences so bursts overflow).

The server run takes about 40 s: start-up plus SOAK_MINUTES of traffic plus the idle wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
from types import SimpleNamespace

import httpx
import pytest
from tests.helpers.server import start_server, stop_server

from kvserve.bench.soak import judge_stream, judge_whole
from kvserve.bench.soak_report import _slope, memory_slopes, scan_log
from kvserve.bench.soak_traffic import (ABORTED, CHAT, COMPLETED, COMPLETIONS, MESSAGES, OVERLOADED, REJECTED,
                                        UNEXPECTED, PlannedRequest, ServerInfo, TrafficGenerator)
from kvserve.cli.main import main

SOAK_MINUTES = 0.4
OPENAI_ERROR = json.dumps({"error": {"message": "no", "type": "invalid_request_error"}}).encode()
ANTHROPIC_ERROR = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}).encode()


def _req(endpoint: str = COMPLETIONS, valid: bool = True, stream: bool = False, **kw) -> PlannedRequest:
    return PlannedRequest(endpoint, b"{}", stream, valid, **kw)


# ---- judging, without a server ---------------------------------------------------------------
@pytest.mark.parametrize("endpoint, valid, status, body, outcome", [
    (COMPLETIONS, True, 200, b'{"choices": [{"text": "a"}]}', COMPLETED),
    (COMPLETIONS, True, 200, b'{"choices": []}', UNEXPECTED),
    (MESSAGES, True, 200, b'{"type": "message", "content": []}', COMPLETED),
    (CHAT, True, 429, OPENAI_ERROR, OVERLOADED),
    (MESSAGES, True, 529, ANTHROPIC_ERROR, OVERLOADED),
    (MESSAGES, True, 429, ANTHROPIC_ERROR, UNEXPECTED),  # Anthropic's overload status is 529
    (CHAT, False, 400, OPENAI_ERROR, REJECTED),
    (MESSAGES, False, 404, ANTHROPIC_ERROR, REJECTED),
    (MESSAGES, False, 400, OPENAI_ERROR, UNEXPECTED),  # wrong dialect under /v1/messages
    (CHAT, False, 422, b'{"detail": []}', UNEXPECTED),  # FastAPI's own shape
    (CHAT, False, 200, b'{"choices": [{}]}', UNEXPECTED),
    (CHAT, True, 400, OPENAI_ERROR, UNEXPECTED),
    (COMPLETIONS, True, 500, OPENAI_ERROR, UNEXPECTED),
])
def test_judge_whole(endpoint, valid, status, body, outcome):
    assert judge_whole(_req(endpoint, valid), status, body).outcome == outcome


def _sse(*frames: str) -> httpx.Response:
    return httpx.Response(200, content="".join(f"{f}\n\n" for f in frames).encode())


@pytest.mark.parametrize("endpoint, frames, outcome", [
    (COMPLETIONS, ['data: {"choices": []}', "data: [DONE]"], COMPLETED),
    (COMPLETIONS, ['data: {"choices": []}'], UNEXPECTED),
    (COMPLETIONS, ['data: {"error": {"message": "boom", "type": "server_error"}}', "data: [DONE]"], UNEXPECTED),
    (CHAT, ["data: {not json", "data: [DONE]"], UNEXPECTED),
    (MESSAGES, ['event: message_start\ndata: {"type": "message_start"}',
                'event: message_stop\ndata: {"type": "message_stop"}'], COMPLETED),
    (MESSAGES, ['event: message_start\ndata: {"type": "message_start"}'], UNEXPECTED),
    (MESSAGES, ['event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}'],
     UNEXPECTED),
])
def test_judge_stream(endpoint, frames, outcome):
    result = asyncio.run(judge_stream(_req(endpoint, stream=True), _sse(*frames)))
    assert result.outcome == outcome, result


def test_judge_stream_hangs_up_after_k_chunks():
    frames = ['data: {"choices": []}'] * 5 + ["data: [DONE]"]
    assert asyncio.run(judge_stream(_req(stream=True, disconnect_after_chunks=2), _sse(*frames))).outcome == ABORTED
    assert asyncio.run(judge_stream(_req(stream=True, disconnect_after_chunks=9), _sse(*frames))).outcome == COMPLETED


def test_scan_log_reads_only_new_lines_and_names_the_exception(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("2026 ERROR old: before the soak\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("2026 INFO kvserve: fine\n2026 ERROR kvserve.server.errors: unhandled error on POST /v1/messages\n"
                "Traceback (most recent call last):\n  File \"serving.py\", line 201, in unless_disconnected\n"
                "    return task.result()\nasyncio.exceptions.InvalidStateError: Result is not set.\n"
                "ERROR:    Exception in ASGI application\n")
    found = scan_log(str(log), offset)
    assert found["num_error_lines"] == 3
    assert found["first_lines"][1] == ("Traceback: asyncio.exceptions.InvalidStateError: Result is not set. "
                                       "[File \"serving.py\", line 201, in unless_disconnected]")
    assert scan_log(None, 0) is None


def test_memory_slope_skips_warmup_and_absent_gauges():
    assert _slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert _slope([(1, 1), (1, 2), (1, 3)]) is None and _slope([(0, 1), (1, 2)]) is None
    # 10 MB per 1,000 requests after warm-up; the warm-up sample (a jump) is left out
    samples = [{"elapsed_s": t, "num_finished": 100 * t, "server": None, "engine": 5e8 + 1e6 * t,
                "total": 5e8 + 1e6 * t} for t in range(1, 11)]
    samples[0]["engine"] = samples[0]["total"] = 1e8
    m = memory_slopes(samples, duration_s=10)
    assert m["num_samples_used"] == 9 and m["server_mb_per_1k_requests"] is None
    assert m["engine_mb_per_1k_requests"] == pytest.approx(10.0)


def test_traffic_fits_max_model_len_and_covers_every_invalid_rule():
    info = ServerInfo("m", 512, tuple(range(100, 1100)), 1.3)
    gen = TrafficGenerator(info, random.Random(0))
    valid = [gen.next() for _ in range(2000)]
    for req in valid:
        if req.valid and req.endpoint == COMPLETIONS:
            body = json.loads(req.body)
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
            assert all(len(p) + body["max_tokens"] <= 512 for p in prompts)
            assert req.num_choices == len(prompts) * body.get("n", 1)
    assert {r.endpoint for r in valid} == {COMPLETIONS, CHAT, MESSAGES}
    assert {"shared_prefix", "pinned"} <= {t for r in valid for t in r.tags}
    num_hang_ups = sum(r.disconnect_after_chunks is not None or r.cancel_after_s is not None for r in valid)
    assert 0.15 < num_hang_ups / len(valid) < 0.25
    rules = {(r.endpoint, r.tags[1]) for r in (gen.invalid() for _ in range(200))}
    assert ("/v1/messages", "invalid:missing_max_tokens") in rules and (COMPLETIONS, "invalid:too_long_prompt") in rules
    assert len(rules) == len({(e, t) for e in (COMPLETIONS, CHAT, MESSAGES) for t in gen._invalid_cases(e, False)})


# ---- against a real server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def soaked(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    server = start_server(tiny_llama[0], tmp / "server.log", "--max-num-seqs", "8", "--max-queue-len", "8",
                          "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--stats-interval", "1",
                          timeout=180.0)  # NOTE: start-up is slow while other work holds the shared cores
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["bench", "soak", "--base-url", server.base_url, "--minutes", str(SOAK_MINUTES),
                       "--concurrency", "16", "--burst-size", "48", "--seed", "1", "--idle-timeout", "20",
                       "--log-file", str(server.log_path), "--json", str(tmp / "soak.json")])
    finally:
        server_exit = stop_server(server)
    return SimpleNamespace(rc=rc, report=json.loads((tmp / "soak.json").read_text()), text=out.getvalue(),
                           server_exit=server_exit, log=server.log())


def test_soak_sends_every_kind_of_traffic_and_reports_every_figure(soaked):
    r = soaked.report
    assert soaked.server_exit == 0, soaked.log[-3000:]
    assert r["num_requests"] >= 100, r["num_requests"]
    for kind in ("completions", "chat", "messages", "streamed", "whole", "invalid", "burst", "shared_prefix",
                 "pinned", "disconnect_planned"):
        assert r["traffic"].get(kind, 0) > 0, (kind, r["traffic"])
    o = r["outcomes"]
    assert o["completed"] > 0 and o["completed_streams"] > 0 and o["client_aborted"] > 0, o
    assert o["rejected_invalid"] > 0 and o["overloaded"] > 0 and {"429", "529"} <= set(o["by_status"]), o
    assert sum(o["by_status"].values()) + o["client_aborted"] >= r["num_requests"] - o["unexpected"]
    assert set(r["kv"]) >= {"usage_perc", "pinned_blocks", "request_blocks", "total_blocks", "leaked_blocks"}
    assert r["idle"] and r["health_status"] == 200 and r["kv"]["leaked_blocks"] == 0, r["kv"]
    mem = r["memory"]
    assert mem["num_samples_used"] >= 3 and "engine_mb_per_1k_requests" in mem and "server_mb_per_1k_requests" in mem
    assert r["log"]["path"] and isinstance(r["log"]["num_error_lines"], int)
    assert soaked.rc == (0 if r["passed"] else 1)
    assert soaked.text.strip().splitlines()[-1] == f"soak: {r['verdict']}"


def test_soak_finds_nothing_unexpected(soaked):
    r = soaked.report
    # NOTE: these fail against today's server; the fixes are in flight (issue 9). Do not relax them:
    # finding these is what the soak is for. Seen so far: a whole (non-streamed) request whose client
    # hangs up logs "InvalidStateError: Result is not set." tracebacks (serving.unless_disconnected), and
    # temperature NaN or Infinity, or repetition_penalty NaN (NaN and Infinity are not even JSON), get a
    # 200 instead of a 400.
    assert r["outcomes"]["unexpected"] == 0, json.dumps(r["unexpected"], indent=1)[:4000]
    assert r["log"]["num_error_lines"] == 0, r["log"]["first_lines"]
    assert r["passed"] and soaked.rc == 0, r["verdict"]
