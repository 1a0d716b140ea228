"""GET /debug/prefix-cache/report through the server (its app in process): chat requests whose system prompt
carries a varying date are found, with the date's text, and logged (without the text); the start-up warning
for a KV pool that holds few requests at max_model_len."""
from __future__ import annotations

import pytest
from tests.helpers.server import in_process

RULES = " ".join(f"Rule {i}: answer politely and cite the handbook section {i}." for i in range(12))


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0", "--enable-debug-endpoints",
                          "--prefix-report-interval", "0.001")


def test_a_varying_date_in_the_system_prompt_is_reported(server):
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for day in range(1, 5):
            system = f"You are the support assistant of Example Corp. Today is 2031-07-{day:02d}. {RULES}"
            r = http.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 1, "messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": f"Question number {day}?"}]})
            assert r.status_code == 200, r.text
        report = http.get("/debug/prefix-cache/report").json()
    assert report["object"] == "prefix_cache.report" and report["recent_prompts"] == 4
    (d,) = report["divergences"]
    assert d["num_requests"] == 4
    assert d["varying_text"][0].strip() == "4"  # the tokenizer splits "04"; the last request's day first
    assert "Today is 2031-07-" in d["context_before"]
    assert d["tokens_lost_per_request"] > 0 and d["hit_rate_if_moved"] > d["hit_rate_now"]



def test_the_report_is_logged_without_the_prompts_text_and_the_pool_warning_at_start_up(server):
    with server.http() as http:  # after the test above: a request now finds a report to log
        model = http.get("/v1/models").json()["data"][0]["id"]
        system = f"You are the support assistant of Example Corp. Today is 2031-07-09. {RULES}"
        r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "Question number 9?"}]})
        assert r.status_code == 200, r.text
        http.get("/debug/prefix-cache/report")  # through the tokenizer thread, so after the log line's job
    log = server.log()
    line = next(x for x in log.splitlines() if "prefix cache: " in x and "recent requests share" in x)
    assert "2031" not in line and "GET /debug/prefix-cache/report" in line
    # the tiny model's pool: 65536 tokens, 64 requests at max_model_len 1024, under --max-num-seqs 256
    assert "the KV pool holds 65536 tokens: 64.00 requests of 1024 tokens at once" in log
