"""`kvserve bench offline`: a workload through kvserve and, in the same run, through `transformers`
(one request at a time, and static left-padded batches), printing throughputs and ratios. Never asserts.

Counting: output tokens are what each request asked for (its max_tokens, ignore_eos); tokens a static batch
generates past a request's own max_tokens are padding waste and not counted. Total = prompt + output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass

import torch

from kvserve.bench.roofline import measure_matmul_rate, workload_flops
from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.config import EngineArgs
from kvserve.utils.cpu_features import describe_isa

_BASELINES = ("hf-single", "hf-batch")


@dataclass
class RunResult:
    name: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: list[int] = dataclasses.field(default_factory=list)
    """Per request, the prompt tokens served from the prefix cache (kvserve only; the roofline leaves them out)."""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="JSONL workload (token ids), or a built-in "
                                                          "name: mixed, prefix, interference, repeat")
    parser.add_argument("--num-requests", type=int, help="use only the first N requests (default: all)")
    parser.add_argument("--baselines", default=",".join(_BASELINES),
                        help=f"comma-separated subset of {', '.join(_BASELINES)}, or 'none'")
    parser.add_argument("--baseline-requests", type=int,
                        help="run the transformers baselines on the first N requests only (their tok/s is then "
                             "a rate over that subset; kvserve always runs the whole workload; default: all)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of hf-batch")
    parser.add_argument("--json", action="store_true", help="print results as JSON too")
    group = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(group)


def run_kvserve(llm, requests: list[WorkloadRequest]) -> RunResult:
    from kvserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False)
              for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return RunResult("kvserve", seconds, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     sum(len(o.outputs[0].token_ids) for o in outs), [o.num_cached_tokens for o in outs])


@torch.inference_mode()
def run_hf_single(model, requests: list[WorkloadRequest]) -> RunResult:
    start = time.perf_counter()
    produced = 0
    for r in requests:
        out = model.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=r.max_tokens, do_sample=False,
                             min_new_tokens=r.max_tokens if r.ignore_eos else 0, pad_token_id=0)
        produced += out.shape[1] - len(r.prompt_token_ids)
    seconds = time.perf_counter() - start
    return RunResult("transformers one-at-a-time", seconds, len(requests),
                     sum(len(r.prompt_token_ids) for r in requests), produced)


@torch.inference_mode()
def hf_static_batches(model, requests: list[WorkloadRequest], batch_size: int, device: str = "cpu") -> int:
    """`model.generate` over static batches of `batch_size` (every row runs to its batch's longest output);
    returns the output tokens the requests asked for."""
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, r in enumerate(batch):  # left padding, as HF generation requires for decoder-only models
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        useful += sum(min(r.max_tokens, out.shape[1] - width) for r in batch)
    return useful


def run_hf_batched(model, requests: list[WorkloadRequest], batch_size: int) -> RunResult:
    start = time.perf_counter()
    useful = hf_static_batches(model, requests, batch_size)
    seconds = time.perf_counter() - start
    return RunResult(f"transformers static batches of {batch_size}", seconds, len(requests),
                     sum(len(r.prompt_token_ids) for r in requests), useful)


def load_hf_model(model: str | None):
    """The same weights through transformers (for GGUF: transformers' own dequantizing loader)."""
    import os

    from transformers import AutoModelForCausalLM

    from kvserve.model_loader.loader import ModelSource

    source = ModelSource.resolve(model)
    if source.kind == "gguf":
        folder, name = os.path.split(os.path.abspath(source.path))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()


def _print_table(results: list[RunResult], reference: RunResult) -> None:
    print(f"{'engine':<36} {'reqs':>5} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} "
          f"{'kvserve/this (out)':>19} {'(total)':>8}")
    for r in results:
        print(f"{r.name:<36} {r.num_requests:>5} {r.seconds:>8.1f} {r.output_tps:>10.1f} {r.total_tps:>12.1f} "
              f"{reference.output_tps / r.output_tps:>18.2f}x {reference.total_tps / r.total_tps:>7.2f}x")


def run(args) -> int:
    from kvserve.engine.llm import LLM

    baselines = [] if args.baselines == "none" else [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = sorted(set(baselines) - set(_BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {', '.join(_BASELINES)}")
    requests = load_workload(args.workload, args.num_requests)
    engine_args = EngineArgs.from_cli(args)
    print(f"workload {args.workload}: {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.max_tokens for r in requests)} output tokens; torch threads {torch.get_num_threads()}")
    llm = LLM(**dataclasses.asdict(engine_args))
    llm.engine.freeze_gc()
    run_kvserve(llm, requests[:2])  # warm-up (allocator, first-call paths); not timed
    # NOTE: a cold prefix cache for the timed run, as `bench compare` gives every server: the warm-up's blocks
    # would hand a shared-prefix workload its prefix for free (prefix: all 32 requests hit, none computed it).
    llm.engine.scheduler.kv.reset_prefix_cache()
    results = [run_kvserve(llm, requests)]
    print(f"kvserve: {results[0].seconds:.1f} s, {results[0].output_tps:.1f} output tok/s, "
          f"{llm.engine.scheduler.stats.num_preemptions} preemptions", flush=True)
    machine = measure_matmul_rate(llm.engine.hf_config)
    achieved = workload_flops(llm.engine.hf_config, requests, results[0].cached_tokens) / results[0].seconds / 1e9
    roofline = (f"roofline: machine fp32 matmul {machine:.1f} GFLOP/s at the model's layer shapes (512 rows); "
                f"kvserve achieved {achieved:.1f} GFLOP/s of model FLOPs on this workload = {achieved / machine:.0%}")
    del llm
    if baselines:
        model = load_hf_model(engine_args.model)
        base_reqs = requests[:args.baseline_requests] if args.baseline_requests else requests
        for name in baselines:
            res = run_hf_single(model, base_reqs) if name == "hf-single" else \
                run_hf_batched(model, base_reqs, args.hf_batch_size)
            print(f"{res.name}: {res.seconds:.1f} s, {res.output_tps:.1f} output tok/s", flush=True)
            results.append(res)
    print()
    _print_table(results, results[0])
    print(roofline)
    print(f"instruction sets: {describe_isa()}")
    if args.json:
        print(json.dumps([dataclasses.asdict(r) | {"output_tps": r.output_tps, "total_tps": r.total_tps}
                          for r in results], indent=2))
    return 0
