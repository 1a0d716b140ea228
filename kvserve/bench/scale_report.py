"""The arithmetic of `kvserve bench scale`: the best possible prefix hit rate of a workload over R replicas, the
measured one from the replicas' counters, load skew, the KV transfer's share of TTFT, and the report's lines
with the issue's targets beside the figures.

Best possible hit rate: one block of a prompt (its chained hash, as the engine keys it) can be a hit for every
request that holds it except the first on each replica that must hold it (in the workload's order). A prefix used by a share f of the
requests must be held by ceil(f x R) replicas (at most R): past 1/R of the traffic, one replica cannot take every
request that wants it and stay inside a balanced load. Hits are counted as the engine counts them: at most
(prompt length - 1) // block_size blocks of a prompt (its last token is always computed), in tokens, over the
prompt tokens queried. When the blocks the replicas must hold exceed their capacity, only the blocks worth the
most hits per block stay (a static placement; a cache that turns over at the right moments could do better).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from kvserve.kv_cache.block_hash import block_keys, hash_block_key

TARGETS = {
    "itl_p99": "decode ITL p99 under disaggregation <= 1.2x its value with no prefills arriving",
    "transfer": "KV transfer <= 5% of TTFT for a 2k-token prompt",
    "precise": "precise within 2 points of the best possible hit rate, and ahead of cache_aware",
    "skew": "load skew (most / fewest requests per replica) <= --balance-rel-threshold",
}


@dataclass(frozen=True)
class BestHitRate:
    hit_tokens: int
    query_tokens: int
    blocks_to_hold: int
    """Blocks used more than once, as the replicas hold them between them in that placement (a block on k
    replicas counts k): the cache that placement needs to reach the rate."""

    @property
    def rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _full_hashes(ids: list[int], block_size: int) -> list[int]:
    """The hashes of a prompt's full blocks: what computing it leaves in the cache."""
    return [hash_block_key(k) for k in block_keys(ids, block_size)]


def _block_counts(prompts: list[list[int]], block_size: int) -> Counter:
    counts: Counter = Counter()
    for ids in prompts:
        counts.update(_full_hashes(ids, block_size))
    return counts


def max_private_tokens(prompts: list[list[int]], block_size: int) -> int:
    """The most tokens of one prompt past its leading blocks that some other prompt shares."""
    counts = _block_counts(prompts, block_size)
    out = 0
    for ids in prompts:
        shared = 0
        for h in _full_hashes(ids, block_size):
            if counts[h] < 2:
                break
            shared += 1
        out = max(out, len(ids) - shared * block_size)
    return out


def best_hit_rate(prompts: list[list[int]], block_size: int, num_replicas: int,
                  capacity_blocks: int | None = None) -> BestHitRate:
    """In workload order: a block's first appearances, one per replica that must hold it, compute it (a prompt's
    last full block included: the next prompt may hit it); every later appearance in the blocks a prompt can
    take from the cache is a hit. capacity_blocks (all replicas together, past what requests in flight hold):
    when the reused blocks need more, only those worth the most hits per block held stay, parents before their
    children (a static placement: the bound for a cache that never turns over)."""
    counts = _block_counts(prompts, block_size)
    holders = {h: min(num_replicas, math.ceil(c * num_replicas / len(prompts))) for h, c in counts.items()}
    kept = _kept(prompts, block_size, counts, holders, capacity_blocks)
    seen: Counter = Counter()
    hits = 0
    for ids in prompts:
        hittable = (len(ids) - 1) // block_size
        for j, h in enumerate(_full_hashes(ids, block_size)):
            seen[h] += 1
            hits += j < hittable and seen[h] > holders[h] and h in kept
    held = sum(holders[h] for h in kept)
    return BestHitRate(hits * block_size, sum(len(p) for p in prompts), held)


def _kept(prompts, block_size, counts, holders, capacity_blocks) -> set[int]:
    first_seen: dict[int, int] = {}
    for ids in prompts:
        for j, h in enumerate(_full_hashes(ids, block_size)):
            first_seen.setdefault(h, j)
    reused = sorted((h for h, c in counts.items() if c > 1),
                    key=lambda h: (-(counts[h] - holders[h]) / holders[h], first_seen[h]))
    if capacity_blocks is None:
        return set(reused)
    kept, used = set(), 0
    for h in reused:
        if used + holders[h] <= capacity_blocks:
            kept.add(h)
            used += holders[h]
    return kept


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def measured_hit_rate(deltas: list[dict[str, float]]) -> float:
    """Token-weighted over the replicas: their prefix-cache hits over their queries (vLLM's counters)."""
    hits = sum(d.get("kvserve:prefix_cache_hits_total", 0.0) for d in deltas)
    queries = sum(d.get("kvserve:prefix_cache_queries_total", 0.0) for d in deltas)
    return hits / queries if queries else 0.0


def load_skew(counts: list[int]) -> float:
    """Most requests one replica served over the fewest (inf when one got none)."""
    if not counts or max(counts) == 0:
        return 1.0
    return max(counts) / min(counts) if min(counts) else math.inf


def transfer_share(producer_ttft_s: float, compute_ttft_s: float, consumer_ttft_s: float) -> dict[str, float]:
    """The KV transfer's share of a disaggregated TTFT (prefill instance, then decode instance, in turn).

    producer_ttft_s: the prompt on the prefill instance, saving its KV; compute_ttft_s: a prompt as long on an
    instance that saves nothing (the same compute); consumer_ttft_s: the prompt on the decode instance, loading
    the KV (it also computes the last partial block and samples: an upper bound on the load).
    """
    save = max(0.0, producer_ttft_s - compute_ttft_s)
    total = producer_ttft_s + consumer_ttft_s
    return {"save_s": save, "load_s": consumer_ttft_s, "ttft_s": total,
            "share": (save + consumer_ttft_s) / total if total else 0.0}


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def routing_lines(section: dict) -> list[str]:
    """Section b's table: one row per workload and policy."""
    lines = [f"{'workload':<8}{'policy':<24}{'hit rate':>9}{'best':>7}{'TTFT p50':>10}{'p99':>8}{'skew':>7}"]
    for name, w in section["workloads"].items():
        for policy, r in w["policies"].items():
            skew = r.get("skew")
            best = w["best_hit_rate"] if "skew" in r else w["best_one_engine"]
            lines.append(f"{name:<8}{policy:<24}{100 * r['hit_rate']:>8.1f}%{100 * best:>6.1f}%"
                         f"{r['ttft']['median_ms']:>8.0f}ms{r['ttft']['p99_ms']:>6.0f}ms"
                         f"{'' if skew is None else f'{skew:.2f}':>7}")
            if r.get("failed"):
                lines.append(f"  {r['failed']} request(s) failed: {'; '.join(r['errors'])}")
        if not w["capacity_ok"]:
            lines.append(f"  ({name}: the reused blocks exceed the replicas' cache: the best keeps those worth the most "
                         "hits, a static placement)")
    for name, w in section["workloads"].items():
        p = w["policies"]
        if "precise" in p and "cache_aware" in p:
            gap = 100 * (w["best_hit_rate"] - p["precise"]["hit_rate"])
            ok = gap <= 2.0 and p["precise"]["hit_rate"] > p["cache_aware"]["hit_rate"]
            lines.append(f"target ({name}): {TARGETS['precise']}: {gap:.1f} points below the best, "
                         f"{100 * (p['precise']['hit_rate'] - p['cache_aware']['hit_rate']):+.1f} against "
                         f"cache_aware: {verdict(ok)}")
        skews = [r["skew"] for r in p.values() if r.get("skew") is not None]
        if skews:
            worst = max(skews)
            lines.append(f"target ({name}): {TARGETS['skew']} ({section['balance_rel_threshold']:g}): worst "
                         f"{worst:.2f}: {verdict(worst <= section['balance_rel_threshold'])}")
    return lines
