"""What every playbook row needs: the run's context, a fresh engine per side, and one driver that queues a
request set at once and steps it to the end, timing each request as a streaming client would see it."""
from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.bench.playbook_presets import Preset
from kvserve.bench.workload import WorkloadRequest
from kvserve.config import EngineArgs


@dataclass
class Context:
    engine_args: EngineArgs
    """The user's engine flags: every side of every row starts from them and changes one switch."""
    preset: Preset
    vocab_size: int
    hf_config: object
    command: Callable[[str], str]
    """Row key -> the command line that reproduces that row alone."""
    draft_model: str | None = None
    log: Callable[[str], None] = print
    keys: tuple[str, ...] = ()
    """The rows asked for (a measurement yielding several rows skips the sides of those not asked for)."""


@dataclass
class BatchRun:
    seconds: float
    output_tokens: int
    latencies: list[float] = field(default_factory=list)
    """Per request: seconds from the start to its last token."""
    ttfts: list[float] = field(default_factory=list)
    peak_running: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def greedy(max_tokens: int, ignore_eos: bool = True):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)


def make_engine(args: EngineArgs, **changes):
    """An engine with `changes` applied to args, warmed up (first-call paths) with a cold prefix cache."""
    from kvserve.engine.engine import Engine

    engine = Engine(dataclasses.replace(args, **changes))
    engine.add_request("warm-up", [101, 102, 103, 104], greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.kv.reset_prefix_cache()
    return engine


def close(engine) -> None:
    """Stop the engine's workers and collect it, so the next side's engine does not sit beside it."""
    engine.shutdown()
    gc.collect()


def run_all(engine, requests: list[WorkloadRequest], tag: str = "") -> BatchRun:
    """Queue every request at once, step until all are done."""
    start = time.perf_counter()
    for r in requests:
        engine.add_request(tag + r.id, r.prompt_token_ids, greedy(r.max_tokens, r.ignore_eos))
    first: dict[str, float] = {}
    run = BatchRun(0.0, 0)
    while engine.has_unfinished_requests():
        outs = engine.step()
        run.peak_running = max(run.peak_running, len(engine.scheduler.running))
        now = time.perf_counter() - start
        for out in outs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                run.latencies.append(now)
                run.outputs[out.request_id[len(tag):]] = list(out.outputs[0].token_ids)
    run.seconds = time.perf_counter() - start
    run.output_tokens = sum(len(t) for t in run.outputs.values())
    run.ttfts = list(first.values())
    return run
