"""Requests in groups that share long prefixes (completions sharing a text, chats sharing a system prompt, half of
them multi-turn), and their greedy answers from a server: what the scale-out tests (data parallelism, routers)
compare against one engine's answers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prefix_group_requests(prefix_words: int = 60, system_words: int = 50, system_stride: int = 3,
                          max_tokens: int = 8) -> list[tuple[str, dict]]:
    """52 (path, body) requests: 4 groups of 8 completions sharing a `prefix_words`-word text, 2 groups of 10
    chats sharing a `system_words`-word system prompt (odd ones multi-turn)."""
    out = []
    for g in range(4):
        prefix = " ".join(WORDS[(g + i) % len(WORDS)] for i in range(prefix_words))
        for r in range(8):
            out.append(("/v1/completions", {"prompt": f"{prefix} question {r}: {WORDS[r]}",
                                            "max_tokens": max_tokens, "temperature": 0}))
    for g in range(2):
        system = {"role": "system",
                  "content": " ".join(WORDS[(system_stride * g + i) % len(WORDS)] for i in range(system_words))}
        for r in range(10):
            turns = [system, {"role": "user", "content": f"tell me about {WORDS[r]}"}]
            if r % 2:
                turns += [{"role": "assistant", "content": WORDS[r + 1]}, {"role": "user", "content": "more"}]
            out.append(("/v1/chat/completions", {"messages": turns, "max_tokens": max_tokens, "temperature": 0}))
    return out


def greedy_answers(base_url: str, requests: list[tuple[str, dict]], threads: int = 8) -> list[tuple]:
    """(text, finish_reason, completion_tokens) of each request, sent `threads` at a time; each must answer 200."""
    def one(item):
        path, body = item
        r = httpx.post(f"{base_url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"], r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, requests))
