"""`kvserve bench prefix`: a shared-prefix workload offline through `LLM`, with prefix caching on and then
off in the same run, printing throughput, time to first token and the prefix-cache hit rate. Never asserts.

All requests are submitted at once (one `LLM.generate`). TTFT is RequestMetrics.first_token_time -
arrival_time. The hit rate is the scheduler's hit tokens / prompt tokens over the timed run.

Best possible hit rate: the first request must compute the shared prefix; each later one can reuse its
full blocks (only full blocks are cached, and a hit never covers a prompt's last token), so

    best = sum over requests 2..N of min(floor(S / B) * B, floor((len_i - 1) / B) * B) / total prompt tokens

where S is the length of the token-id prefix common to all requests and B the block size. Requests
admitted in the same step as the first one cannot hit yet (their blocks are not computed), which is
why a run can fall short of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass

from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.config import EngineArgs


@dataclass
class PrefixRun:
    name: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    ttfts: list[float]
    hit_tokens: int
    query_tokens: int

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def ttft_median(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def ttft_p90(self) -> float:
        if len(self.ttfts) < 2:
            return self.ttfts[0]
        return statistics.quantiles(self.ttfts, n=10, method="inclusive")[8]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.query_tokens)

    def summary(self) -> dict:
        return {"name": self.name, "seconds": self.seconds, "total_tps": self.total_tps,
                "ttft_median_s": self.ttft_median, "ttft_p90_s": self.ttft_p90, "hit_rate": self.hit_rate,
                "hit_tokens": self.hit_tokens, "query_tokens": self.query_tokens}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="JSONL workload (token ids), or a built-in "
                                                          "name: mixed, prefix, interference, repeat")
    parser.add_argument("--num-requests", type=int, help="use only the first N requests (default: all)")
    parser.add_argument("--json", action="store_true", help="print results as JSON too")
    group = parser.add_argument_group("engine (--enable-prefix-caching is set by the benchmark, both ways)")
    EngineArgs.add_cli_args(group)


def shared_prefix_len(requests: list[WorkloadRequest]) -> int:
    """Length of the token-id prefix common to every request."""
    first = requests[0].prompt_token_ids
    n = len(first)
    for r in requests[1:]:
        ids = r.prompt_token_ids
        n = min(n, len(ids))
        n = next((i for i in range(n) if ids[i] != first[i]), n)
    return n


def best_hit_tokens(requests: list[WorkloadRequest], block_size: int) -> int:
    """Prompt tokens a perfect prefix cache could serve (see the module docstring)."""
    reusable = shared_prefix_len(requests) // block_size * block_size
    return sum(min(reusable, (len(r.prompt_token_ids) - 1) // block_size * block_size) for r in requests[1:])


def run_once(engine_args: EngineArgs, requests: list[WorkloadRequest], enable: bool) -> PrefixRun:
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_args, enable_prefix_caching=enable)))
    # Warm-up (first-call paths) on the tail of the last prompt, which shares no prefix with the workload;
    # then forget whatever it cached, so the timed run starts from an empty cache.
    llm.generate([requests[-1].prompt_token_ids[-32:]], SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    llm.engine.scheduler.kv.reset_prefix_cache()
    stats = llm.engine.scheduler.stats
    query0, hit0 = stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False)
              for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = PrefixRun(
        "on" if enable else "off", seconds, sum(len(r.prompt_token_ids) for r in requests),
        sum(len(o.outputs[0].token_ids) for o in outs),
        [o.metrics.first_token_time - o.metrics.arrival_time for o in outs],
        stats.num_prefix_hit_tokens - hit0, stats.num_prefix_query_tokens - query0)
    del llm
    gc.collect()
    return result


def run(args) -> int:
    requests = load_workload(args.workload, args.num_requests)
    engine_args = EngineArgs.from_cli(args)
    bs = engine_args.block_size
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    shared = shared_prefix_len(requests)
    print(f"workload {args.workload}: {len(requests)} requests, {prompt_tokens} prompt tokens, "
          f"{sum(r.max_tokens for r in requests)} output tokens; shared prefix {shared} tokens "
          f"({shared // bs} full blocks of {bs})", flush=True)
    runs = []
    for enable in (True, False):
        runs.append(run_once(engine_args, requests, enable))
        r = runs[-1]
        print(f"prefix caching {r.name}: {r.seconds:.1f} s", flush=True)
    on, off = runs
    print()
    print(f"{'prefix caching':<15} {'seconds':>8} {'total tok/s':>12} {'TTFT median':>12} {'TTFT p90':>10} "
          f"{'hit rate':>9}")
    for r in runs:
        print(f"{r.name:<15} {r.seconds:>8.1f} {r.total_tps:>12.1f} {r.ttft_median:>11.3f}s {r.ttft_p90:>9.3f}s "
              f"{100 * r.hit_rate:>8.1f}%")
    print(f"{'on/off':<15} {on.seconds / off.seconds:>7.2f}x {on.total_tps / off.total_tps:>11.2f}x "
          f"{on.ttft_median / off.ttft_median:>11.2f}x {on.ttft_p90 / off.ttft_p90:>9.2f}x")
    best = best_hit_tokens(requests, bs)
    reusable = shared // bs * bs
    print(f"\nbest possible hit rate: {100 * best / prompt_tokens:.1f}% = {best} / {prompt_tokens} prompt tokens "
          f"(each of the {len(requests) - 1} requests after the first reuses floor({shared}/{bs})*{bs} = "
          f"{reusable} shared-prefix tokens, capped at its own full blocks before its last token); "
          f"measured with caching on: {100 * on.hit_rate:.1f}%")
    if args.json:
        print(json.dumps({"runs": [r.summary() for r in runs], "shared_prefix_tokens": shared,
                          "best_hit_rate": best / prompt_tokens}, indent=2))
    return 0
