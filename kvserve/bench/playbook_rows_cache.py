"""Playbook rows about reusing computed KV: prefix caching on an agent loop and on RAG (on vs off), and prompt
caching (an Anthropic `cache_control` pair: the second call's TTFT against the first's)."""
from __future__ import annotations

import statistics
import time

from kvserve.bench import playbook_workloads as wl
from kvserve.bench.playbook_report import Row
from kvserve.bench.playbook_run import Context, close, greedy, make_engine, run_all
from kvserve.bench.workload import WorkloadRequest

_PIN_TTL_S = 300.0  # Anthropic's default cache lifetime (5 minutes)


def _on_off(ctx: Context, key: str, rounds: list[list[WorkloadRequest]]) -> dict[str, dict]:
    """Each round's requests queued at once, the rounds one after another, prefix caching on and off."""
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for rnd in rounds for r in rnd)
    runs = {}
    for name, enable in (("on", True), ("off", False)):
        engine = make_engine(ctx.engine_args, enable_prefix_caching=enable)
        stats = engine.scheduler.stats
        query0, hit0 = stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens
        seconds, ttfts = 0.0, []
        for i, rnd in enumerate(rounds):
            run = run_all(engine, rnd, tag=f"{i}-")
            seconds += run.seconds
            ttfts += run.ttfts
        runs[name] = {"total_tps": tokens / seconds, "ttft_median_s": statistics.median(ttfts),
                      "hit_rate": (stats.num_prefix_hit_tokens - hit0) / max(1, stats.num_prefix_query_tokens - query0)}
        close(engine)
        ctx.log(f"[{key}] prefix caching {name}: {runs[name]['total_tps']:.1f} tok/s, "
                f"hit rate {runs[name]['hit_rate']:.0%}")
    return runs


def _prefix_row(key: str, technique: str, runs: dict[str, dict], command: str, note: str) -> Row:
    on, off = runs["on"], runs["off"]
    return Row(key, technique, "2-6x on agents and RAG", (2.0, 6.0),
               headline=on["total_tps"] / off["total_tps"], headline_label="throughput",
               details={"on_total_tps": on["total_tps"], "off_total_tps": off["total_tps"],
                        "on_ttft_median_s": on["ttft_median_s"], "off_ttft_median_s": off["ttft_median_s"],
                        "ttft_ratio_off_over_on": off["ttft_median_s"] / max(on["ttft_median_s"], 1e-9),
                        "on_hit_rate": on["hit_rate"]},
               command=command, note=note)


def prefix_agent(ctx: Context) -> Row:
    p = ctx.preset
    rounds = wl.agent(p.agent_sessions, p.agent_steps, p.agent_system, p.agent_step, p.agent_output, ctx.vocab_size)
    return _prefix_row("prefix-agent", "prefix caching, agent loop", _on_off(ctx, "prefix-agent", rounds),
                       ctx.command("prefix-agent"),
                       f"{p.agent_sessions} sessions x {p.agent_steps} steps; each step re-sends the system prompt "
                       f"and a scratchpad grown by {p.agent_step} tokens")


def prefix_rag(ctx: Context) -> Row:
    p = ctx.preset
    requests = wl.rag(p.rag_requests, p.rag_docs, p.rag_doc_len, p.rag_question, p.rag_output, ctx.vocab_size)
    # NOTE: a document's first question goes first: requests queued in one step as the first reader of their
    # document cannot hit it yet, and a RAG service's documents are read again and again, not all at once.
    rounds = [requests[:p.rag_docs], requests[p.rag_docs:]]
    return _prefix_row("prefix-rag", "prefix caching, RAG", _on_off(ctx, "prefix-rag", rounds),
                       ctx.command("prefix-rag"),
                       f"{p.rag_requests} requests over {p.rag_docs} shared {p.rag_doc_len}-token documents: one "
                       "question per document first, then the rest at once")


def _ttft(engine, request_id: str, prompt: list[int], pin: int) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, greedy(1), cache_pin=(pin, _PIN_TTL_S))
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
    return ttft


def prompt_caching(ctx: Context) -> Row:
    p = ctx.preset
    docs = wl.rag(2 * p.prompt_cache_pairs, p.prompt_cache_pairs, p.prompt_cache_len, 16, 1, ctx.vocab_size, seed=3)
    engine = make_engine(ctx.engine_args, enable_prefix_caching=True)
    uncached, cached = [], []
    for i in range(p.prompt_cache_pairs):
        first, second = docs[i], docs[i + p.prompt_cache_pairs]  # the same document, another question
        uncached.append(_ttft(engine, f"pair{i}-a", first.prompt_token_ids, p.prompt_cache_len))
        cached.append(_ttft(engine, f"pair{i}-b", second.prompt_token_ids, p.prompt_cache_len))
    close(engine)
    u, c = statistics.median(uncached), statistics.median(cached)
    ctx.log(f"[prompt-caching] TTFT uncached {u * 1e3:.0f} ms, cached {c * 1e3:.0f} ms")
    return Row("prompt-caching", "prompt caching (cache_control)", "~90% less TTFT on the cached part", (0.85, 0.95),
               headline=1 - c / u, headline_label="less TTFT %",
               details={"uncached_ttft_ms": u * 1e3, "cached_ttft_ms": c * 1e3, "cached_prefix_tokens": p.prompt_cache_len,
                        "pairs": p.prompt_cache_pairs},
               command=ctx.command("prompt-caching"),
               note="the engine's pinned prefix (what /v1/messages makes of a cache_control breakpoint): the first "
                    "call computes and pins the document, the second reuses it")
