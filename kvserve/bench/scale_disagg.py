"""Sections a and c of `kvserve bench scale`: disaggregated prefill/decode against one colocated engine.

a (interference): the `interference` workload's short requests decode while its long prompts arrive. Run twice
  on each layout, without the long prompts (the no-prefill baseline) and with them: the short ones' ITL p50/p99
  and the long ones' TTFT. Colocated: one engine with 2 threads and the default step budget. Disaggregated: a
  prefill instance (kv_producer, core 0) and a decode instance (kv_consumer, core 1), 1 thread each, behind
  `kvserve proxy --prefill URL --decode URL`, their KV moved by the connector (SharedStorageConnector on
  /dev/shm by default). Without `kvserve proxy` this section says so and measures nothing.
c (transfer): a 2k-token prompt on the prefill instance (it computes and saves the KV), the same prompt on the
  decode instance (it loads the KV), and another as long on the decode instance (computed, nothing saved): the
  KV transfer's share of the disaggregated TTFT (scale_report.transfer_share), and the bytes the connector
  wrote per token (for shared storage: the files under its path) beside the KV pool's own bytes per token.
Every run prefixes its prompts with a token of its own, so none hits what another one cached.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.scale_procs import Fleet, command_exists, max_model_len, scrape, stream
from kvserve.bench.scale_report import ratio, transfer_share
from kvserve.bench.serve import _stats
from kvserve.bench.workload import WorkloadRequest, load_workload

_TAG_BASE = 2000


@dataclass
class DisaggPlan:
    quick: bool
    connector: str = "SharedStorageConnector"
    extra_config: dict = field(default_factory=dict)
    storage_dir: str = ""
    transfer_repeats: int = 3
    max_prompt_tokens: int | None = None
    """Longest prompt the instances take (a long prompt is cut to it: a small model's context may be short)."""

    def fit(self, ids: list[int]) -> list[int]:
        return ids if self.max_prompt_tokens is None else ids[:self.max_prompt_tokens]

    def transfer_config(self, role: str) -> str:
        extra = dict(self.extra_config)
        if self.connector in ("SharedStorageConnector", "ExampleConnector"):
            extra.setdefault("shared_storage_path", self.storage_dir)
        return json.dumps({"kv_connector": self.connector, "kv_role": role, "kv_connector_extra_config": extra})

    def interference(self) -> tuple[list[WorkloadRequest], list[WorkloadRequest]]:
        """(short decode-heavy requests at t=0, long prompts arriving later)."""
        requests = load_workload("interference")
        short = [r for r in requests if r.arrival_s == 0]
        long = [dataclasses.replace(r, prompt_token_ids=self.fit(r.prompt_token_ids))
                for r in requests if r.arrival_s > 0]
        if self.quick:
            short = [dataclasses.replace(r, max_tokens=96) for r in short[:8]]
            long = long[:1]
        return short, long


async def _replay(url: str, requests: list[WorkloadRequest], tag: int) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        start = time.perf_counter()

        async def one(r: WorkloadRequest):
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            body = {"prompt": [_TAG_BASE + tag, *r.prompt_token_ids], "max_tokens": r.max_tokens,
                    "ignore_eos": r.ignore_eos, "repetition_penalty": 1.0}
            return await stream(client, "/v1/completions", body)
        return list(await asyncio.gather(*(one(r) for r in requests)))


def _itl(results: list) -> dict[str, float]:
    return _stats([x for r in results if r.ok for x in r.itls_s])


def interference_run(url: str, plan: DisaggPlan, tag: int) -> dict:
    """The no-prefill baseline, then the short requests with the long prompts arriving."""
    short, long = plan.interference()
    base = asyncio.run(_replay(url, short, tag))
    both = asyncio.run(_replay(url, short + long, tag + 1))
    failed = [r.error for r in base + both if not r.ok]
    itl = lambda results: _stats([x for r in results if r.ok for x in r.itls_s])
    out = {"itl_no_prefill": itl(base), "itl": itl(both[:len(short)]),
           "long_ttft": _stats([r.ttft_s for r in both[len(short):] if r.ok]), "failed": len(failed),
           "errors": sorted(set(failed))[:3]}
    out["itl_p99_ratio"] = ratio(out["itl"]["p99_ms"], out["itl_no_prefill"]["p99_ms"])
    return out


def start_pools(fleet: Fleet, serve_flags: list[str], plan: DisaggPlan, cores: list[set[int] | None]):
    prefill = fleet.serve("prefill", [*serve_flags, "--num-threads", "1", "--kv-transfer-config",
                                      plan.transfer_config("kv_producer")], cores=cores[0])
    decode = fleet.serve("decode", [*serve_flags, "--num-threads", "1", "--kv-transfer-config",
                                    plan.transfer_config("kv_consumer")], cores=cores[1])
    fit_context(plan, decode.url)
    return prefill, decode


def fit_context(plan: DisaggPlan, url: str) -> None:
    """Cut long prompts to the instance's context, leaving room for the run's tag and the outputs."""
    plan.max_prompt_tokens = min(plan.max_prompt_tokens or 10 ** 9, max_model_len(url) - 64)


def run_disaggregated(fleet: Fleet, prefill_url: str, decode_url: str, plan: DisaggPlan, tag: int) -> dict:
    missing = command_exists("proxy")
    if missing is not None:
        return {"skipped": f"`kvserve proxy` is not available here ({missing}): disaggregated serving not measured"}
    try:
        proxy = fleet.start("proxy", ["proxy", "--prefill", prefill_url, "--decode", decode_url])
    except RuntimeError as e:
        return {"skipped": f"`kvserve proxy` did not start: {e}"}
    try:
        return interference_run(proxy.url, plan, tag)
    finally:
        fleet.stop(proxy)


def _dir_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass  # a temporary file renamed meanwhile
    return total


async def _probe(url: str, prompt: list[int]):
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        result = await stream(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    if not result.ok:
        raise RuntimeError(f"the transfer probe failed at {url}: {result.error}")
    return result


def run_transfer(prefill_url: str, decode_url: str, plan: DisaggPlan, block_size: int) -> dict:
    long = plan.fit(max(load_workload("interference"), key=lambda r: len(r.prompt_token_ids)).prompt_token_ids)
    rows = []
    for i in range(plan.transfer_repeats):
        moved = [_TAG_BASE + 500 + 2 * i, *long[1:]]
        computed = [_TAG_BASE + 501 + 2 * i, *long[1:]]
        before = _dir_bytes(plan.storage_dir) if plan.storage_dir else 0
        produce = asyncio.run(_probe(prefill_url, moved))
        written = (_dir_bytes(plan.storage_dir) - before) if plan.storage_dir else None
        consume = asyncio.run(_probe(decode_url, moved))
        compute = asyncio.run(_probe(decode_url, computed))
        rows.append({"producer_ttft_s": produce.ttft_s, "consumer_ttft_s": consume.ttft_s,
                     "compute_ttft_s": compute.ttft_s, "bytes_written": written,
                     "loaded_tokens": consume.cached_tokens})
    med = {k: statistics.median(r[k] for r in rows) for k in ("producer_ttft_s", "consumer_ttft_s", "compute_ttft_s")}
    share = transfer_share(med["producer_ttft_s"], med["compute_ttft_s"], med["consumer_ttft_s"])
    stored_tokens = (len(long) // block_size) * block_size
    pool = scrape(decode_url)
    pool_tokens = pool.get("kvserve:kv_cache_total_blocks", 0.0) * block_size
    written = [r["bytes_written"] for r in rows if r["bytes_written"] is not None]
    return {"prompt_tokens": len(long), "runs": rows, **med, **share,
            "bytes_per_token": statistics.median(written) / stored_tokens if written else None,
            "pool_bytes_per_token": pool.get("kvserve:kv_cache_memory_bytes", 0.0) / pool_tokens if pool_tokens else None,
            "loaded_tokens": min((r["loaded_tokens"] or 0) for r in rows)}
