"""`kvserve bench scale`: scaling out on this machine, in one run, as ratios against one 2-thread engine.

    a  interference: decode ITL p50/p99 and TTFT while long prompts arrive, colocated vs disaggregated
       (a prefill and a decode instance behind `kvserve proxy`, KV moved by --kv-connector)   scale_disagg.py
    b  routing: a shared-prefix groups workload larger than one replica's KV cache and a multi-turn chat
       through `kvserve router` over 2 replicas, per policy: hit rate against the best possible, TTFT, skew
                                                                                              scale_routing.py
    c  the KV transfer's share of TTFT for a 2k-token prompt, and the bytes it moves per token  scale_disagg.py

Each instance of a pair is pinned to a core of its own with 1 thread (os.sched_setaffinity); the colocated
baseline is one engine with 2 threads on both. Nothing else should run on the machine. The issue's targets are
printed beside the figures. Every process's log is kept under --log-dir (default: a temporary folder).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile

from kvserve.bench.engine_flags import engine_flags
from kvserve.bench.scale_disagg import (DisaggPlan, fit_context, interference_run, run_disaggregated, run_transfer,
                                        start_pools)
from kvserve.bench.scale_procs import Fleet
from kvserve.bench.scale_report import TARGETS, routing_lines, verdict
from kvserve.bench.scale_routing import POLICIES, RoutingPlan, run_routing
from kvserve.cli.standalone import standalone_main
from kvserve.config import EngineArgs

SECTIONS = ("a", "b", "c")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: a, b, c")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--kv-connector", default="SharedStorageConnector",
                        help="the connector moving KV from the prefill to the decode instance (sections a, c)")
    parser.add_argument("--kv-connector-extra-config", default=None,
                        help="its kv_connector_extra_config, a JSON object (shared storage: a folder under /dev/shm "
                             "unless shared_storage_path is given)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="router policies of section b")
    parser.add_argument("--balance-abs-threshold", type=int, default=1,
                        help="the router's, section b (sglang-router's default, 64, never binds at a few requests "
                             "in flight: every request sharing a system prompt would go to one replica)")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.5, help="the router's, section b")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in section b")
    parser.add_argument("--replica-kv-share", type=float, default=0.5,
                        help="section b: each replica's KV blocks, as a share of the blocks the groups workload "
                             "reuses (plus room for the requests in flight); below 0.5 even the best placement evicts")
    parser.add_argument("--log-dir", default=None, help="keep every process's log here")
    EngineArgs.add_cli_args(parser.add_argument_group("engine (every instance)"))


def _parse(args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or any(s not in SECTIONS for s in sections):
        raise ValueError(f"--sections must be a comma-separated subset of a,b,c, got {args.sections!r}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in ("round_robin", "power_of_two", "cache_aware", "precise") for p in policies):
        raise ValueError(f"--policies must name router policies, got {args.policies!r}")
    if args.concurrency < 1 or args.balance_abs_threshold < 0 or args.balance_rel_threshold < 1:
        raise ValueError("--concurrency must be >= 1, --balance-abs-threshold >= 0, --balance-rel-threshold >= 1")
    if not 0 < args.replica_kv_share <= 1:
        raise ValueError(f"--replica-kv-share must be in (0, 1], got {args.replica_kv_share}")
    try:
        extra = json.loads(args.kv_connector_extra_config) if args.kv_connector_extra_config else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-connector-extra-config is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError("--kv-connector-extra-config must be a JSON object")
    return sections, policies, extra


def pinned_cores() -> tuple[list[set[int] | None], str]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None, None], f"not pinned: this process may use {len(cores)} core(s)"
    return [{cores[0]}, {cores[1]}], f"pairs pinned to cores {cores[0]} and {cores[1]}, 1 thread each"


def _keys(engine_args: EngineArgs):
    from kvserve.model_loader.gguf_loader import builtin_model_path
    from kvserve.model_loader.loader import ModelSource, load_tokenizer
    from kvserve.router.keys import KeyMaker

    return KeyMaker(load_tokenizer(ModelSource.resolve(engine_args.model or builtin_model_path())))


def run(args: argparse.Namespace) -> int:
    sections, policies, extra = _parse(args)
    engine_args = EngineArgs.from_cli(args)
    flags = engine_flags(engine_args)
    cores, pinning = pinned_cores()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvserve-bench-scale-")
    os.makedirs(log_dir, exist_ok=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    storage = tempfile.mkdtemp(prefix="kvserve-scale-kv-", dir=shm)
    plan = DisaggPlan(args.quick, args.kv_connector, extra, extra.get("shared_storage_path", storage))
    report = {"quick": args.quick, "pinning": pinning, "command_flags": flags, "log_dir": log_dir}
    print(f"[scale] {pinning}; logs in {log_dir}", flush=True)
    try:
        with Fleet(log_dir) as fleet:
            if "a" in sections:
                one = fleet.serve("colocated", [*flags, "--num-threads", "2"])
                fit_context(plan, one.url)
                report["a"] = {"colocated": interference_run(one.url, plan, tag=0)}
                fleet.stop(one)
            if "a" in sections or "c" in sections:
                prefill, decode = start_pools(fleet, flags, plan, cores)
                if "a" in sections:
                    report["a"]["disaggregated"] = run_disaggregated(fleet, prefill.url, decode.url, plan, tag=10)
                if "c" in sections:
                    report["c"] = run_transfer(prefill.url, decode.url, plan, engine_args.block_size)
                fleet.stop(prefill)
                fleet.stop(decode)
            if "b" in sections:
                rplan = RoutingPlan(args.quick, engine_args.block_size, args.concurrency,
                                    args.balance_abs_threshold, args.balance_rel_threshold, args.replica_kv_share)
                report["b"] = run_routing(fleet, flags, rplan, _keys(engine_args), policies, cores,
                                          log=lambda line: print(line, flush=True))
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    print("\n".join(format_report(report)))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


def format_report(report: dict) -> list[str]:
    lines = [f"kvserve bench scale{' --quick' if report['quick'] else ''}: {report['pinning']}"]
    if "a" in report:
        lines += ["", "a) interference: short requests' ITL while long prompts arrive",
                  f"{'layout':<16}{'ITL p50':>9}{'p99':>8}{'no-prefill p99':>16}{'p99 ratio':>11}{'long TTFT':>11}"]
        for layout, r in report["a"].items():
            if "skipped" in r:
                lines.append(f"{layout:<16}{r['skipped']}")
                continue
            lines.append(f"{layout:<16}{r['itl']['median_ms']:>7.0f}ms{r['itl']['p99_ms']:>6.0f}ms"
                         f"{r['itl_no_prefill']['p99_ms']:>14.0f}ms{r['itl_p99_ratio']:>10.2f}x"
                         f"{r['long_ttft']['median_ms']:>9.0f}ms")
            if r.get("failed"):
                lines.append(f"  {r['failed']} request(s) failed: {'; '.join(r['errors'])}")
        dis = report["a"].get("disaggregated", {})
        ok = None if "skipped" in dis else dis["itl_p99_ratio"] <= 1.2
        lines.append(f"target: {TARGETS['itl_p99']}: {verdict(ok)}")
    if "c" in report:
        c = report["c"]
        per_token = "n/a" if c["bytes_per_token"] is None else f"{c['bytes_per_token']:.0f} B"
        pool = "n/a" if c["pool_bytes_per_token"] is None else f"{c['pool_bytes_per_token']:.0f} B"
        lines += ["", f"c) KV transfer of a {c['prompt_tokens']}-token prompt",
                  f"prefill instance TTFT (computes, saves) {1000 * c['producer_ttft_s']:.0f} ms; decode instance "
                  f"TTFT (loads) {1000 * c['consumer_ttft_s']:.0f} ms; the same length computed there "
                  f"{1000 * c['compute_ttft_s']:.0f} ms",
                  f"transfer (save {1000 * c['save_s']:.0f} ms + load {1000 * c['load_s']:.0f} ms, an upper bound) "
                  f"is {100 * c['share']:.1f}% of the disaggregated TTFT; {per_token}/token written "
                  f"(the KV pool holds {pool}/token)",
                  f"the decode instance took {c['loaded_tokens']} of the {c['prompt_tokens']} prompt tokens "
                  f"from the connector (usage's cached_tokens, the fewest of {len(c['runs'])} runs)",
                  f"target: {TARGETS['transfer']}: {verdict(c['share'] <= 0.05)}"]
    if "b" in report:
        b = report["b"]
        lines += ["", f"b) routing over 2 replicas of {b['replica_blocks']} blocks (block size {b['block_size']}), "
                      f"{b['concurrency']} requests in flight"] + routing_lines(b)
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.scale`: the same as `kvserve bench scale`."""
    return standalone_main("kvserve bench scale", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
