"""Section b of `kvserve bench scale`: the groups and chat workloads through `kvserve router` over 2 replicas
(each pinned to its own core, 1 thread), once per policy, and straight to one 2-thread engine with both replicas'
KV capacity: token-weighted prefix hit rate (the replicas' /metrics counters), TTFT, and load skew (the router's
per-replica request counts), beside the best possible hit rate (scale_report.best_hit_rate).

Each replica holds half the blocks the groups workload reuses (--replica-kv-share), plus room for the requests in
flight: one replica cannot keep every group's prefix, two can. The replicas are started once; each run prefixes its prompts
with a tag of its own (a token, or a word of the system prompt), so no run hits what an earlier one cached.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import httpx

from kvserve.bench.scale_procs import Fleet, scrape, stream
from kvserve.bench.scale_report import best_hit_rate, counter_delta, load_skew, max_private_tokens, measured_hit_rate
from kvserve.bench.scale_workloads import ChatRequest, load_chat, load_groups
from kvserve.bench.serve import _stats
from kvserve.bench.workload import WorkloadRequest

POLICIES = ("round_robin", "cache_aware", "precise")
EVENTS = ["--kv-events-config", '{"enable_kv_cache_events": true}']
_TAG_BASE = 1000  # ordinary tokens (low ids are special ones)


@dataclass(frozen=True)
class RoutingPlan:
    quick: bool
    block_size: int
    concurrency: int = 4
    balance_abs_threshold: int = 1
    balance_rel_threshold: float = 1.5
    capacity_share: float = 0.5
    """Each replica's KV blocks: this share of the blocks the groups workload reuses (and room for requests in
    flight); below 0.5 even the best placement evicts."""

    def groups(self) -> list[WorkloadRequest]:
        return load_groups(4, 4) if self.quick else load_groups()

    def chat(self) -> list[ChatRequest]:
        return load_chat(4, 3) if self.quick else load_chat()


def cache_blocks(prompts: list[list[int]], block_size: int, share: float = 0.5) -> int:
    """The share of the blocks the workload reuses that each replica keeps."""
    return math.ceil(share * best_hit_rate(prompts, block_size, 1).blocks_to_hold)


def replica_blocks(prompts: list[list[int]], max_tokens: int, block_size: int, concurrency: int,
                   share: float = 0.5) -> int:
    """KV blocks per replica: cache_blocks, and room for the requests in flight (each its own part of the prompt,
    its output and a partial block)."""
    per_request = -(-(max_private_tokens(prompts, block_size) + max_tokens) // block_size) + 1
    return cache_blocks(prompts, block_size, share) + concurrency * per_request


def _tagged_completion(r: WorkloadRequest, tag: int) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": [_TAG_BASE + tag, *r.prompt_token_ids], "max_tokens": r.max_tokens,
                               "ignore_eos": r.ignore_eos, "repetition_penalty": 1.0}


def _tagged_chat(r: ChatRequest, tag: int) -> tuple[str, dict]:
    system, *rest = r.messages
    messages = [{**system, "content": f"Session {tag}. {system['content']}"}, *rest]
    return "/v1/chat/completions", {"messages": messages, "max_tokens": r.max_tokens, "ignore_eos": r.ignore_eos,
                                    "repetition_penalty": 1.0}


async def _send_all(url: str, waves: list[list[tuple[str, dict]]], concurrency: int) -> list:
    """Each wave's requests with at most `concurrency` in flight, the waves one after the other."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def one(path: str, body: dict):
            async with gate:
                return await stream(client, path, body)
        results = []
        for wave in waves:
            results += await asyncio.gather(*(one(p, b) for p, b in wave))
    return results


def _waves(name: str, plan: RoutingPlan, tag: int) -> list[list[tuple[str, dict]]]:
    if name == "groups":
        return [[_tagged_completion(r, tag) for r in plan.groups()]]
    chat = plan.chat()
    return [[_tagged_chat(r, tag) for r in chat if r.turn == t] for t in sorted({r.turn for r in chat})]


def _prompt_ids(name: str, plan: RoutingPlan, keys, tag: int) -> list[list[int]]:
    """The token ids each request's prompt will have on the replica."""
    ids = [body["prompt"] if path == "/v1/completions" else keys.key(path, body).token_ids
           for wave in _waves(name, plan, tag) for path, body in wave]
    if any(i is None for i in ids):
        raise ValueError("the model's tokenizer cannot render the chat workload (no chat template?)")
    return ids


def measure(url: str, replicas: list[str], name: str, plan: RoutingPlan, tag: int, router: str | None) -> dict:
    """One workload through `url`; hit rate from the replicas' counters, skew from the router's counts.
    `query_tokens` (the prompt tokens the replicas looked up) differs from the best's when the chat prompts the
    router keys on are not the ones the replicas run."""
    before = [scrape(r) for r in replicas]
    counts_before = _router_counts(router)
    results = asyncio.run(_send_all(url, _waves(name, plan, tag), plan.concurrency))
    deltas = [counter_delta(b, scrape(r)) for b, r in zip(before, replicas)]
    ok = [r for r in results if r.ok]
    out = {"hit_rate": measured_hit_rate(deltas), "ttft": _stats([r.ttft_s for r in ok]),
           "query_tokens": sum(d.get("kvserve:prefix_cache_queries_total", 0.0) for d in deltas),
           "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:3]}
    if router is not None:
        counts = [a - b for a, b in zip(_router_counts(router), counts_before)]
        out.update(requests_per_replica=counts, skew=load_skew(counts))
    return out


def _router_counts(router: str | None) -> list[int]:
    if router is None:
        return []
    workers = httpx.get(f"{router}/workers", timeout=30).json()["workers"]
    return [w["num_requests_total"] for w in workers]


def run_routing(fleet: Fleet, serve_flags: list[str], plan: RoutingPlan, keys, policies=POLICIES,
                cores: list[set[int] | None] = (None, None), log=print) -> dict:
    prompts = {name: _prompt_ids(name, plan, keys, 0) for name in ("groups", "chat")}
    blocks = replica_blocks(prompts["groups"], max(r.max_tokens for r in plan.groups()), plan.block_size,
                            plan.concurrency, plan.capacity_share)
    section = {"replica_blocks": blocks, "block_size": plan.block_size, "concurrency": plan.concurrency,
               "balance_rel_threshold": plan.balance_rel_threshold, "workloads": {}}
    cache = 2 * cache_blocks(prompts["groups"], plan.block_size, plan.capacity_share)
    for name, ids in prompts.items():
        best = best_hit_rate(ids, plan.block_size, 2, cache)
        section["workloads"][name] = {
            "requests": len(ids), "best_hit_rate": best.rate, "query_tokens": best.query_tokens,
            "best_one_engine": best_hit_rate(ids, plan.block_size, 1, cache).rate,
            "capacity_ok": best_hit_rate(ids, plan.block_size, 2).blocks_to_hold <= cache, "policies": {}}
    replicas = [fleet.serve(f"replica{i}", [*serve_flags, "--num-threads", "1", "--num-gpu-blocks-override",
                                            str(blocks), *EVENTS], cores=cores[i]) for i in range(2)]
    urls = [r.url for r in replicas]
    tag = 1
    for policy in policies:
        router = fleet.start(f"router-{policy}", ["router", *[a for u in urls for a in ("--worker", u)],
                                                  "--policy", policy, "--balance-abs-threshold",
                                                  str(plan.balance_abs_threshold), "--balance-rel-threshold",
                                                  str(plan.balance_rel_threshold)])
        for name in prompts:
            result = measure(router.url, urls, name, plan, tag, router.url)
            section["workloads"][name]["policies"][policy] = result
            log(f"[scale b] {name} {policy}: hit rate {100 * result['hit_rate']:.1f}%, TTFT p50 "
                f"{result['ttft']['median_ms']:.0f} ms, requests per replica {result['requests_per_replica']}")
            tag += 1
        fleet.stop(router)
    for r in replicas:
        fleet.stop(r)
    one = fleet.serve("one-engine", [*serve_flags, "--num-threads", "2", "--num-gpu-blocks-override", str(2 * blocks)])
    for name in prompts:
        result = measure(one.url, [one.url], name, plan, tag, None)
        section["workloads"][name]["policies"]["one engine (2 threads)"] = result
        log(f"[scale b] {name} one engine: hit rate {100 * result['hit_rate']:.1f}%, TTFT p50 "
            f"{result['ttft']['median_ms']:.0f} ms")
        tag += 1
    fleet.stop(one)
    return section

