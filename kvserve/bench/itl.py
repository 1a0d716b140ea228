"""`kvserve bench itl`: the latency-aware step budget (--target-itl-ms auto, the former 150 ms default) against
the fixed token budget (0), in one run, offline (no HTTP).

For each setting a fresh engine is built and warmed up, then `interference` is replayed with its arrival
times on the wall clock (the engine is stepped by hand; requests join when their time comes) and `mixed`
is run with every request queued at once. With --repeat N the settings take turns N times (interleaved,
so that a machine's drift hits each alike) and the table shows each figure's median over the rounds.
Reported: the ITL p50 / p99 of interference's requests that arrive at t=0 (the short ones, measured
between the steps that give them tokens, as a streaming client sees them), the long prompts' TTFT,
mixed's TTFT p50 and total tok/s with its ratio to the fixed budget, and the step cost model's
coefficients as fitted by the end of each setting's run (scheduler/step_cost.py). The issue's targets:
short ITL p99 <= 3x p50 with default flags, mixed's TTFT and tok/s no worse than the fixed budget's.
--cpu-isa avx2 runs it all as on an AVX2 machine (the process restarts itself with cpu_isa.emulation_env).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

from kvserve.bench.serve import _stats
from kvserve.bench.workload import WORKLOAD_DIR, WorkloadRequest, load_workload
from kvserve.cli.standalone import standalone_main
from kvserve.config import EngineArgs
from kvserve.config.engine_args import LEGACY_TARGET_ITL_MS
from kvserve.config.scheduler import AUTO, parse_target_itl_ms
from kvserve.utils.cpu_isa import ISAS, emulation_env, selected_isa, supported_isas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload-dir", default=WORKLOAD_DIR,
                        help="folder holding interference.jsonl and mixed.jsonl (default: the built-in workloads)")
    parser.add_argument("--targets", default=None,
                        help="comma-separated --target-itl-ms values to compare, auto or ms (default: the engine's "
                             f"--target-itl-ms, or auto where that is 0, then {LEGACY_TARGET_ITL_MS:g} (the former "
                             "default), then 0 (the fixed budget))")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds, the settings interleaved in each; the table shows medians over the rounds")
    parser.add_argument("--cpu-isa", choices=ISAS, default=None,
                        help="run as on a CPU of this class (KVSERVE_CPU_ISA, ATEN_CPU_CAPABILITY, "
                             "ONEDNN_MAX_CPU_ISA; the process restarts itself with them); default: this CPU's")
    parser.add_argument("--mixed-requests", type=int, default=None,
                        help="run only the first N requests of mixed (a quicker, rougher check; default: all)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))


def _params(r: WorkloadRequest):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False)


def replay(engine, requests: list[WorkloadRequest], tag: str) -> dict[str, list[float]]:
    """Step the engine until every request is done, adding each at its arrival time (wall clock). Returns
    request id -> the times (s since the start) of the steps that gave it tokens."""
    pending = sorted(requests, key=lambda r: r.arrival_s)
    times: dict[str, list[float]] = {r.id: [] for r in requests}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.add_request(f"{tag}{r.id}", r.prompt_token_ids, _params(r))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0].arrival_s - now)))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            if any(out.new_token_ids):
                times[out.request_id[len(tag):]].append(stamp)
    return times


def measure(args: EngineArgs, interference: list[WorkloadRequest], mixed: list[WorkloadRequest]) -> dict:
    from kvserve.engine.engine import Engine

    engine = Engine(args)
    Engine.freeze_gc()
    replay(engine, [dataclasses.replace(r, arrival_s=0.0) for r in mixed[:2]], "warm-")
    times = replay(engine, interference, "i-")
    arrivals = {r.id: r.arrival_s for r in interference}
    short = [x for rid, ts in times.items() if arrivals[rid] == 0.0 for x in (b - a for a, b in zip(ts, ts[1:]))]
    long_ttft = [ts[0] - arrivals[rid] for rid, ts in times.items() if arrivals[rid] > 0.0 and ts]
    start = time.perf_counter()
    mixed_times = replay(engine, [dataclasses.replace(r, arrival_s=0.0) for r in mixed], "m-")
    seconds = time.perf_counter() - start
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in mixed)
    cost = engine.scheduler.step_cost
    fitted = cost.describe() if hasattr(cost, "describe") else repr(cost)
    del engine, cost
    gc.unfreeze()  # NOTE: frozen objects are never collected: the next setting's engine would sit beside this one
    gc.collect()
    return {"target_itl_ms": args.target_itl_ms, "short_itl": _stats(short), "long_ttft": _stats(long_ttft),
            "mixed_ttft": _stats([ts[0] for ts in mixed_times.values() if ts]), "mixed_seconds": seconds,
            "mixed_total_tps": tokens / seconds, "step_cost": fitted}


def parse_targets(text: str | None, engine_target: float | str) -> list[float | str]:
    """--targets as a list; default: the engine's (auto where it is 0), the former default, the fixed budget."""
    if text is None:
        first = engine_target or AUTO
        return list(dict.fromkeys([first, LEGACY_TARGET_ITL_MS, 0.0]))
    try:
        targets = [parse_target_itl_ms(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--targets must be comma-separated values of auto or ms >= 0, got {text!r}") from None
    if not targets:
        raise ValueError(f"--targets must be comma-separated values of auto or ms >= 0, got {text!r}")
    return targets


def restart_env(isa: str | None, environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to restart this process in for --cpu-isa (None: no restart: none asked, or in place)."""
    if isa is None:
        return None
    if isa not in supported_isas():
        raise ValueError(f"--cpu-isa {isa}: this CPU cannot run it (it runs {', '.join(supported_isas())})")
    wanted = emulation_env(isa)
    if all(environ.get(k) == v for k, v in wanted.items()):
        return None
    return {**environ, **wanted}


def _label(target: float | str, unit: str = " ms") -> str:
    return target if target == AUTO else f"{target:g}{unit}"


def _median_row(rounds: list[dict]) -> dict:
    """One setting's figures, each the median over the rounds."""
    med = statistics.median
    return {"target_itl_ms": rounds[0]["target_itl_ms"],
            "short_p50": med(r["short_itl"]["median_ms"] for r in rounds),
            "short_p99": med(r["short_itl"]["p99_ms"] for r in rounds),
            "short_ratio": med(r["short_itl"]["p99_ms"] / r["short_itl"]["median_ms"] if r["short_itl"]["median_ms"]
                               else float("nan") for r in rounds),
            "long_ttft": med(r["long_ttft"]["median_ms"] for r in rounds),
            "mixed_ttft": med(r["mixed_ttft"]["median_ms"] for r in rounds),
            "mixed_tps": med(r["mixed_total_tps"] for r in rounds)}


def print_table(results: list[dict], targets: list[float | str]) -> None:
    rows = [_median_row([r for r in results if r["target_itl_ms"] == t]) for t in targets]
    fixed = next((r for r in rows if r["target_itl_ms"] == 0), rows[-1])
    print(f"\n{'--target-itl-ms':>16}{'short ITL p50':>15}{'p99':>8}{'p99/p50':>9}{'long TTFT p50':>15}"
          f"{'mixed TTFT p50':>16}{'mixed tok/s':>13}{'vs fixed':>10}")
    for r in rows:
        print(f"{_label(r['target_itl_ms'], unit=''):>16}{r['short_p50']:>15.0f}{r['short_p99']:>8.0f}{r['short_ratio']:>8.1f}x"
              f"{r['long_ttft']:>15.0f}{r['mixed_ttft']:>16.0f}{r['mixed_tps']:>13.1f}"
              f"{r['mixed_tps'] / fixed['mixed_tps']:>9.3f}x")
    print("targets: short ITL p99 <= 3x p50 (default flags); mixed TTFT p50 and tok/s no worse than the fixed budget (0)")


def run(args: argparse.Namespace) -> int:
    env = restart_env(args.cpu_isa, dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    base = EngineArgs.from_cli(args)
    targets = parse_targets(args.targets, base.target_itl_ms)
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    interference = load_workload(os.path.join(args.workload_dir, "interference.jsonl"))
    if args.mixed_requests is not None and args.mixed_requests < 1:
        raise ValueError(f"--mixed-requests must be >= 1, got {args.mixed_requests}")
    mixed = load_workload(os.path.join(args.workload_dir, "mixed.jsonl"), args.mixed_requests)
    print(f"[itl] cpu isa: {selected_isa()}; settings {', '.join(_label(t) for t in targets)}; {args.repeat} round(s)",
          flush=True)
    results = []
    for round_ in range(args.repeat):
        for target in targets:
            r = measure(dataclasses.replace(base, target_itl_ms=target), interference, mixed)
            results.append({**r, "round": round_})
            tag = f"[itl] target {_label(target)}" + (f" (round {round_ + 1})" if args.repeat > 1 else "")
            print(f"{tag}: short ITL p50 {r['short_itl']['median_ms']:.0f} ms, p99 {r['short_itl']['p99_ms']:.0f} ms; "
                  f"mixed TTFT p50 {r['mixed_ttft']['median_ms']:.0f} ms, {r['mixed_total_tps']:.1f} tok/s", flush=True)
            if target:  # NOTE: with 0 the model is not fitted (the prior): nothing to see
                print(f"{tag}: fitted step cost {r['step_cost']}", flush=True)
    print_table(results, targets)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.itl`: the same as `kvserve bench itl`."""
    return standalone_main("kvserve bench itl", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
