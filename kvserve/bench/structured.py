"""`kvserve bench structured`: what a JSON schema costs per generated token, same run, same engine.

The constrained side runs the workload (greedy, all requests at once) with `structured_outputs` = the schema;
each request stops when its JSON is complete. The unconstrained side then runs the same prompts with each
request's max_tokens set to the length the constrained side produced (ignore_eos), so both sides decode the
same number of tokens per request in the same batch shapes: the ratio of their output tok/s is the cost of
compiling, filling and applying the bitmasks. Prints both, the ratio, and how many outputs parse as JSON.
Never asserts.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.config import EngineArgs

# NOTE: long enough that a model keeps writing (a summary and a keyword list), strict enough to be a real
# grammar (required fields, an enum, bounded strings and integer), bounded so that answers can complete.
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "kind": {"enum": ["code", "documentation", "prose", "other"]},
        "summary": {"type": "string", "maxLength": 400},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8},
        "lines": {"type": "integer", "minimum": 0, "maximum": 100000},
    },
    "required": ["title", "kind", "summary", "keywords", "lines"],
}


@dataclass
class SideResult:
    seconds: float
    outputs: dict[str, list[int]]
    texts: dict[str, str]

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed", help="workload .jsonl file, or a built-in name")
    parser.add_argument("--schema", default=None,
                        help="a JSON schema file for the constrained side (default: a built-in object schema "
                             "with strings, an enum, an array and an integer)")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests of the workload (all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each side this many times, alternating, and keep each side's fastest")
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))


def run_side(engine, requests: list[WorkloadRequest], params_of) -> SideResult:
    # NOTE: both sides share one engine and the same prompts: without this, the second side would find every
    # prompt in the prefix cache and skip its prefill.
    engine.scheduler.kv.reset_prefix_cache()
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.id, r.prompt_token_ids, params_of(r))
    outputs, texts = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                texts[out.request_id] = out.outputs[0].text
    return SideResult(time.perf_counter() - start, outputs, texts)


def run(args) -> int:
    from kvserve.engine.engine import Engine
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

    schema = DEFAULT_SCHEMA
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    requests = load_workload(args.workload, args.num_requests)
    engine_args = EngineArgs.from_cli(args)
    engine = Engine(engine_args)
    Engine.freeze_gc()
    so = StructuredOutputsParams(json=schema)
    engine.processor.check_structured_outputs(so)
    print(f"{len(requests)} requests from {args.workload}; torch threads {torch.get_num_threads()}", flush=True)

    def constrained(r: WorkloadRequest) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=r.max_tokens, structured_outputs=so)

    # warm-up, not timed: the vocabulary's xgrammar view and the schema's compile happen here (once per engine)
    start = time.perf_counter()
    run_side(engine, requests[:2], constrained)
    warm_s = time.perf_counter() - start
    best: dict[str, SideResult] = {}
    lengths: dict[str, int] = {}
    for _ in range(max(1, args.rounds)):
        on = run_side(engine, requests, constrained)
        lengths = {k: max(1, len(v)) for k, v in on.outputs.items()}
        off = run_side(engine, requests, lambda r: SamplingParams(temperature=0, max_tokens=lengths[r.id],
                                                                  ignore_eos=True))
        for side, res in (("on", on), ("off", off)):
            if side not in best or res.seconds < best[side].seconds:
                best[side] = res
    on, off = best["on"], best["off"]
    parsed = sum(_parses(t) for t in on.texts.values())
    ratio = on.output_tps / off.output_tps
    row = {"requests": len(requests), "output_tokens": on.output_tokens,
           "unconstrained_output_tps": off.output_tps, "constrained_output_tps": on.output_tps,
           "ratio": ratio, "slowdown": 1 - ratio, "valid_json": parsed,
           "mean_output_tokens": on.output_tokens / len(requests), "warmup_s": warm_s}
    print()
    print(f"{'requests':>8} {'out tokens':>10} {'unconstrained tok/s':>20} {'json schema tok/s':>18} "
          f"{'ratio':>6} {'valid JSON':>11}")
    print(f"{len(requests):>8} {on.output_tokens:>10} {off.output_tps:>20.1f} {on.output_tps:>18.1f} "
          f"{ratio:>5.2f}x {parsed:>6}/{len(requests)}")
    print(f"(warm-up incl. the vocabulary's grammar view and the compile: {warm_s:.1f} s)")
    if args.json:
        print(json.dumps(row, indent=2))
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
