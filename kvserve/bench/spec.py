"""`kvserve bench spec`: speculative decoding off vs on, same run, same engine flags otherwise.

Each case is a workload at a concurrency (at most that many requests in flight; the next starts when one
finishes), greedy, run through an engine without speculation and one with `--speculative-config`
(default: ngram, K=4, lookup 2-5, adaptive). Prints output tok/s of both, their ratio, the acceptance
rate (accepted / scored draft tokens), tokens per verification, and whether the outputs are identical.
Never asserts. Default cases: repeat at concurrency 1 and 16, mixed at 64 (all at once).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.config import EngineArgs
from kvserve.config.engine_args import DEFAULT_SPECULATIVE_CONFIG
from kvserve.config.speculative import SpeculativeConfig

DEFAULT_SPEC = json.loads(DEFAULT_SPECULATIVE_CONFIG)
DEFAULT_CASES = "repeat:1,repeat:16,mixed:64"


@dataclass
class SideResult:
    seconds: float
    output_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    outputs: dict

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads-dir", default=os.path.join("..", "shared", "workloads"),
                        help="folder of the workload .jsonl files")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="comma-separated WORKLOAD:CONCURRENCY (workload = file name without .jsonl)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each side this many times, alternating, and keep each side's fastest")
    parser.add_argument("--json", action="store_true", help="print results as JSON too")
    group = parser.add_argument_group("engine (--speculative-config applies to the 'on' side; default: "
                                      + json.dumps(DEFAULT_SPEC) + ")")
    EngineArgs.add_cli_args(group)


def run_side(engine, requests: list[WorkloadRequest], concurrency: int) -> SideResult:
    from kvserve.sampling_params import SamplingParams

    stats = engine.scheduler.stats
    before = (stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens)
    pending = deque(requests)
    in_flight, outputs = 0, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            r = pending.popleft()
            engine.add_request(r.id, r.prompt_token_ids, SamplingParams(
                temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False))
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    return SideResult(seconds, sum(len(t) for t in outputs.values()), stats.num_spec_drafts - before[0],
                      stats.num_spec_draft_tokens - before[1], stats.num_spec_accepted_tokens - before[2], outputs)


def _cases(spec: str) -> list[tuple[str, int]]:
    cases = []
    for item in spec.split(","):
        name, _, conc = item.strip().partition(":")
        if not name or not conc.isdigit() or int(conc) < 1:
            raise ValueError(f"--cases: {item!r} is not WORKLOAD:CONCURRENCY")
        cases.append((name, int(conc)))
    return cases


def run(args) -> int:
    from kvserve.engine.engine import Engine

    cases = _cases(args.cases)
    engine_args = EngineArgs.from_cli(args)
    spec_config = SpeculativeConfig.parse(engine_args.speculative_config)
    if spec_config is None:
        raise ValueError("kvserve bench spec compares speculation off vs on: --speculative-config cannot be none")
    spec_config = {f.name: getattr(spec_config, f.name) for f in dataclasses.fields(spec_config)}
    workloads = {name: load_workload(os.path.join(args.workloads_dir, f"{name}.jsonl")) for name, _ in cases}
    max_conc = max(c for _, c in cases)
    common = dataclasses.replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs, max_conc))
    off = Engine(dataclasses.replace(common, speculative_config=None))
    on = Engine(dataclasses.replace(common, speculative_config=spec_config))
    Engine.freeze_gc()
    print(f"speculative config: {json.dumps(spec_config)}; torch threads {torch.get_num_threads()}", flush=True)
    first = next(iter(workloads.values()))[:2]
    for engine in (off, on):  # warm-up (allocator, first-call paths); not timed
        run_side(engine, first, 2)
    rows = []
    for name, conc in cases:
        reqs = workloads[name]
        best: dict[str, SideResult] = {}
        for _ in range(max(1, args.rounds)):
            for side, engine in (("off", off), ("on", on)):
                res = run_side(engine, reqs, conc)
                if side not in best or res.seconds < best[side].seconds:
                    best[side] = res
        a, b = best["off"], best["on"]
        identical = sum(a.outputs[k] == b.outputs.get(k) for k in a.outputs)
        row = {"workload": name, "concurrency": conc, "requests": len(reqs), "off_output_tps": a.output_tps,
               "on_output_tps": b.output_tps, "speedup": b.output_tps / a.output_tps,
               "acceptance_rate": b.num_accepted_tokens / b.num_draft_tokens if b.num_draft_tokens else 0.0,
               "tokens_per_verification": 1 + b.num_accepted_tokens / b.num_drafts if b.num_drafts else 1.0,
               "draft_tokens": b.num_draft_tokens, "accepted_tokens": b.num_accepted_tokens,
               "identical_outputs": identical, "off_seconds": a.seconds, "on_seconds": b.seconds}
        rows.append(row)
        print(f"[spec] {name} @ {conc}: off {a.output_tps:.1f} tok/s, on {b.output_tps:.1f} tok/s "
              f"({row['speedup']:.2f}x), acceptance {row['acceptance_rate']:.0%}", flush=True)
    print()
    print(f"{'workload':<12} {'conc':>4} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'accept':>7} "
          f"{'tok/verify':>10} {'drafted':>8} {'identical':>10}")
    for r in rows:
        print(f"{r['workload']:<12} {r['concurrency']:>4} {r['off_output_tps']:>10.1f} {r['on_output_tps']:>9.1f} "
              f"{r['speedup']:>6.2f}x {r['acceptance_rate']:>7.0%} {r['tokens_per_verification']:>10.2f} "
              f"{r['draft_tokens']:>8} {r['identical_outputs']:>6}/{r['requests']}")
    if args.json:
        print(json.dumps({"speculative_config": spec_config, "cases": rows}, indent=2))
    return 0
