"""Prefix caching through the server (its app in process): Anthropic cache_control pins and their usage
fields (exact), the debug endpoints (explain, totals), the prefix-cache metrics, and OpenAI's cached_tokens.

Expected token counts are computed here from /tokenize (the same chat template), independently of the
server's own breakpoint arithmetic. Prompts start with text or ids used nowhere else, so no other test
has cached their blocks.
"""
from __future__ import annotations

import uuid

import pytest
from tests.helpers.server import in_process, metric

BLOCK = 16  # the server's --block-size (the default)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from in_process(tiny_llama[0], "--stats-interval", "0", "--enable-debug-endpoints")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    return server.anthropic()


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def _ids(http, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    return http.post("/tokenize", json=body).json()["tokens"]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _system_text(http, n_words: int) -> str:
    """A system prompt never sent before whose cached prefix ends in the block where two requests that
    differ only in the user message diverge (so the second reads exactly the pinned blocks)."""
    tag = uuid.uuid4().hex[:8]
    for extra in range(BLOCK):
        text = f"Manual {tag}: " + " ".join(WORDS[i % len(WORDS)] for i in range(n_words + extra))
        pin = _common(_ids(http, [{"role": "system", "content": text}], False),
                      _ids(http, [{"role": "system", "content": text}, {"role": "user", "content": "A?"}]))
        diverge = _common(_ids(http, [{"role": "system", "content": text}, {"role": "user", "content": "A?"}]),
                          _ids(http, [{"role": "system", "content": text}, {"role": "user", "content": "B?"}]))
        if pin // BLOCK == diverge // BLOCK:
            return text
    raise AssertionError("no padding puts the divergence in the pin's last block")


def _pin_tokens(http, system: str, user: str) -> tuple[int, int]:
    """(tokens up to the end of the system block, total prompt tokens) for system + one user message."""
    full = _ids(http, [{"role": "system", "content": system}, {"role": "user", "content": user}])
    return _common(_ids(http, [{"role": "system", "content": system}], False), full), len(full)


def _stats(http) -> dict:
    r = http.get("/debug/prefix-cache")
    assert r.status_code == 200, r.text
    return r.json()


def test_cache_control_usage_is_exact(http, claude, model):
    system = _system_text(http, 40)
    block = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    pin, total1 = _pin_tokens(http, system, "A?")
    pinned = pin // BLOCK * BLOCK
    assert pinned >= 2 * BLOCK
    before = _stats(http)["pinned_blocks"]

    first = claude.messages.create(model=model, system=block, messages=[{"role": "user", "content": "A?"}],
                                   max_tokens=1)
    u = first.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens, u.input_tokens) == (0, pinned, total1 - pinned)
    assert u.cache_creation.ephemeral_5m_input_tokens == pinned and u.cache_creation.ephemeral_1h_input_tokens == 0
    assert _stats(http)["pinned_blocks"] == before + pinned // BLOCK  # the pin reached the engine
    assert metric(http, "kvserve:prefix_cache_pinned_blocks") == before + pinned // BLOCK

    _, total2 = _pin_tokens(http, system, "B?")
    with claude.messages.stream(model=model, system=block, messages=[{"role": "user", "content": "B?"}],
                                max_tokens=1) as stream:
        second = stream.get_final_message()
    u = second.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens, u.input_tokens) == (pinned, 0, total2 - pinned)


def test_cache_control_on_a_message_block_with_1h_ttl(http, claude, model):
    system = f"Notes {uuid.uuid4().hex[:8]}."
    doc = " ".join(WORDS * 2)
    content = [{"type": "text", "text": doc, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
               {"type": "text", "text": "Summarize."}]
    out = claude.messages.create(model=model, system=system, messages=[{"role": "user", "content": content}],
                                 max_tokens=1)
    # the prefix ends inside the user turn: render the conversation cut after the document
    full = _ids(http, [{"role": "system", "content": system}, {"role": "user", "content": doc + "\nSummarize."}])
    cut = _ids(http, [{"role": "system", "content": system}, {"role": "user", "content": doc}], False)
    pinned = _common(cut, full) // BLOCK * BLOCK
    assert out.usage.cache_creation_input_tokens == pinned > 0 and out.usage.cache_read_input_tokens == 0
    assert out.usage.cache_creation.ephemeral_1h_input_tokens == pinned
    assert out.usage.input_tokens == len(full) - pinned


def test_top_level_cache_control_marks_the_last_block(http, claude, model):
    system = f"Log {uuid.uuid4().hex[:8]}."
    turns = [{"role": "user", "content": " ".join(WORDS)}, {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": " ".join(reversed(WORDS))}]
    out = claude.messages.create(model=model, system=system, messages=turns, max_tokens=1,
                                 cache_control={"type": "ephemeral"})
    conv = [{"role": "system", "content": system}, *turns]
    full = _ids(http, conv)
    pinned = _common(_ids(http, conv, False), full) // BLOCK * BLOCK
    assert out.usage.cache_creation_input_tokens == pinned > 0 and out.usage.cache_read_input_tokens == 0


def test_explain_reports_where_a_prompt_diverges(http, model):
    prompt = list(range(7000, 7096))  # 6 full blocks, ids used by no other test
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    changed = prompt[:40] + [9999] + prompt[41:]
    r = http.post("/debug/prefix-cache/explain", json={"prompt": changed})
    assert r.status_code == 200, r.text
    ex = r.json()
    assert ex["num_prompt_tokens"] == 96 and ex["diverges_at"] == 40 and ex["num_matched_tokens"] == 40
    assert ex["num_cached_tokens"] == 32  # the 2 full blocks before the one that differs
    assert ex["cached_text_after"] != ex["prompt_text_after"]
    same = http.post("/debug/prefix-cache/explain", json={"prompt": prompt}).json()
    assert same["num_cached_tokens"] == 80 and same["diverges_at"] is None  # never the last prompt token's block

    # chat messages go through the chat template, as /v1/chat/completions renders them
    text = " ".join(WORDS) + f" {uuid.uuid4().hex[:8]} " + " ".join(WORDS)
    messages = [{"role": "user", "content": text}]
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).raise_for_status()
    other = [{"role": "user", "content": text.replace("kilo", "KILO")}]
    ex = http.post("/debug/prefix-cache/explain", json={"messages": other}).json()
    expected = _common(_ids(http, messages), _ids(http, other))
    assert ex["diverges_at"] == ex["num_matched_tokens"] == expected
    assert ex["num_cached_tokens"] == expected // BLOCK * BLOCK

    for bad in ({}, {"prompt": []}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        r = http.post("/debug/prefix-cache/explain", json=bad)
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_totals_and_metrics_count_prefix_tokens(http, model):
    prompt = list(range(8000, 8080))  # 5 full blocks
    stats0 = _stats(http)
    q0, h0 = metric(http, "kvserve:prefix_cache_queries_total"), metric(http, "kvserve:prefix_cache_hits_total")
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    stats1 = _stats(http)
    assert stats1["query_tokens"] - stats0["query_tokens"] == 160
    assert stats1["hit_tokens"] - stats0["hit_tokens"] == 64  # (80 - 1) // 16 full blocks on the second call
    assert stats1["block_size"] == BLOCK and stats1["cached_blocks"] >= 5
    assert stats1["hit_rate"] == pytest.approx(stats1["hit_tokens"] / stats1["query_tokens"])
    assert metric(http, "kvserve:prefix_cache_queries_total") - q0 == 160
    assert metric(http, "kvserve:prefix_cache_hits_total") - h0 == 64


def test_openai_cached_tokens_on_a_repeated_long_chat(server, http, model):
    client = server.openai()
    # NOTE: a system prompt of its own: without one the template inserts a default that other tests share
    messages = [{"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}."},
                {"role": "user", "content": " ".join(WORDS * 3)}]
    n = len(_ids(http, messages))
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK > 0
