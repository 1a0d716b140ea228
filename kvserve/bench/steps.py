"""`kvserve bench steps`: where a workload's time goes, step by step (offline, no HTTP).

Every request of the workload is queued at once (arrival times are ignored) and the engine is stepped by
hand; each step is timed and put in a bucket by what it carried: prompt tokens (>= 256, or fewer beside
decodes) or decodes only (by batch size). One line per bucket: steps, seconds, share of the run, tokens,
ms per step, and tokens/s. Use it before optimising: a step's cost is set by its token count and by how
much attention context its requests carry, and the buckets show which kind of step dominates.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

from kvserve.bench.streaming import StreamingFigure, read_rate, weight_bytes_per_token
from kvserve.bench.workload import load_workload
from kvserve.config import EngineArgs
from kvserve.utils.cpu_features import describe_isa

_BUCKETS = ("prompt >= 256", "prompt < 256", "decode >= 32", "decode 8-31", "decode < 8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True,
                        help="JSONL workload (token ids), or a built-in name (or decode1: `bench compare`'s one "
                             "request of 256 output tokens, whose decode is measured against the weight-streaming "
                             "limit)")
    parser.add_argument("--num-requests", type=int, help="use only the first N requests (default: all)")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))


def bucket(num_tokens: int, num_decodes: int) -> str:
    prompt = num_tokens - num_decodes
    if prompt >= 256:
        return _BUCKETS[0]
    if prompt > 0:
        return _BUCKETS[1]
    return _BUCKETS[2] if num_decodes >= 32 else _BUCKETS[3] if num_decodes >= 8 else _BUCKETS[4]


def profile(engine, requests, phases: dict[str, float] | None = None,
            single_stream: list[float] | None = None) -> dict[str, list[float]]:
    """{bucket: [steps, seconds, tokens]} for the whole workload; `phases` (if given) receives the seconds
    of each part of a step: the scheduler (schedule + update), the worker outside the forward pass
    (inputs, sampling), the forward pass with the LM head, and the front end (outputs); `single_stream` (if
    given) receives [steps, seconds] of the steps that decoded one token of one request alone."""
    from kvserve.sampling_params import SamplingParams

    for i, r in enumerate(requests):
        engine.add_request(f"steps-{i}", r.prompt_token_ids, SamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False))
    core, runner = engine.core, engine.core.executor.worker.runner
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    phases = {} if phases is None else phases
    single = [0, 0.0] if single_stream is None else single_stream
    phases.update(dict.fromkeys(("scheduler", "worker outside forward", "forward", "front end"), 0.0))
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        out = core.scheduler.schedule()
        t1 = time.perf_counter()
        forward_before = runner.forward_s
        runner_out = core.executor.execute_model(out)
        t2 = time.perf_counter()
        outputs = core.scheduler.update(out, runner_out)
        t3 = time.perf_counter()
        engine.output_processor.process(outputs)
        t4 = time.perf_counter()
        forward = runner.forward_s - forward_before
        phases["scheduler"] += (t1 - t0) + (t3 - t2)
        phases["worker outside forward"] += (t2 - t1) - forward
        phases["forward"] += forward
        phases["front end"] += t4 - t3
        num_decodes = sum(n == 1 for n in out.num_scheduled_tokens.values())
        row = totals[bucket(out.total_num_scheduled_tokens, num_decodes)]
        row[0] += 1
        row[1] += t4 - t0
        row[2] += out.total_num_scheduled_tokens
        if out.total_num_scheduled_tokens == 1 and num_decodes == 1:
            single[0] += 1
            single[1] += t4 - t0
    return dict(totals)


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import Engine

    workload = args.workload
    if workload == "decode1" and not os.path.exists(workload):
        from kvserve.bench.compare import decode1_workload
        workload = decode1_workload(os.path.join(tempfile.gettempdir(), "kvserve-workloads"))
    requests = load_workload(workload, args.num_requests)
    engine = Engine(EngineArgs.from_cli(args))
    Engine.freeze_gc()
    phases: dict[str, float] = {}
    single: list[float] = [0, 0.0]
    totals = profile(engine, requests, phases, single)
    wall = sum(t[1] for t in totals.values())
    num_steps = sum(int(t[0]) for t in totals.values())
    print(f"{args.workload}: {len(requests)} requests, {num_steps} steps, {wall:.1f} s in steps")
    print(f"instruction sets: {describe_isa()}")
    print("per step: " + ", ".join(f"{name} {1000 * secs / num_steps:.2f} ms" for name, secs in phases.items()))
    print(f"{'bucket':<15}{'steps':>7}{'seconds':>9}{'share':>7}{'tokens':>9}{'ms/step':>9}{'tok/s':>8}")
    for name in _BUCKETS:
        if name in totals:
            n, secs, toks = totals[name]
            print(f"{name:<15}{int(n):>7}{secs:>9.1f}{secs / wall:>7.0%}{int(toks):>9}{1000 * secs / n:>9.1f}"
                  f"{toks / secs:>8.0f}")
    if single[0]:
        model = engine.core.executor.worker.runner.model
        figure = StreamingFigure(single[0] / single[1], weight_bytes_per_token(model), read_rate())
        print(f"single-stream decode ({int(single[0])} steps of one token alone): {figure.describe()}")
    return 0

