"""`kvserve bench quality`: what quantization and bf16 cost in quality, measured against the float32 model.

Every setting (the reference, in float32, then each `--quantization` value alone, each `--kv-cache-dtype` value
alone and each `--dtype` value alone)
runs the workload's prompts teacher-forced: the prompt tokens go in as they are and each position's
next-token distribution comes back through prompt logprobs (the prompt's own forward pass, top `--top-k`
entries plus the actual token). Prompts run in `--chunk`-token prefill chunks, so most attention reads come
from the KV cache, which is what a quantized cache changes. Per setting, over all positions:

- top-1 agreement: the setting's most likely next token is the reference's;
- mean KL(reference || setting) over the reference's top-k tokens with the rest pooled into one outcome (a
  lower bound on the full KL: pooling outcomes never increases it); a token outside the setting's own top-k
  gets the smaller of its top-k floor and its leftover mass;
- perplexity of the actual next tokens, and its ratio to the reference's.
Never asserts; prints one table.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
from dataclasses import dataclass

import numpy as np

from kvserve.bench.workload import load_workload
from kvserve.config import EngineArgs


@dataclass
class Distributions:
    """Teacher-forced next-token distributions of one setting, position by position (all prompts)."""

    top_ids: list[np.ndarray]        # per position: [k] token ids by descending logprob
    top_logprobs: list[np.ndarray]   # per position: [k]
    target_logprobs: np.ndarray      # [positions] the actual next token's logprob
    seconds: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed", help="prompts (.jsonl, or a built-in name)")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the workload (all)")
    parser.add_argument("--quantization", default="int8",
                        help="comma-separated weight quantizations (the engine's --quantization values) to "
                             "compare, each alone, or with a model dtype as QUANT+DTYPE (int8+bfloat16); "
                             "empty: none")
    parser.add_argument("--kv-cache-dtype", default="",
                        help="comma-separated KV-cache dtypes (the engine's --kv-cache-dtype values) to compare, "
                             "each alone; empty: none")
    parser.add_argument("--dtype", default="",
                        help="comma-separated model dtypes (the engine's --dtype values, e.g. bfloat16) to compare, "
                             "each alone; empty: none. The reference always runs in float32")
    parser.add_argument("--top-k", type=int, default=64, help="entries per position the metrics use")
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    # NOTE: --quantization, --kv-cache-dtype and --dtype are this command's lists of settings, not one engine value.
    EngineArgs.add_cli_args(parser.add_argument_group("engine (the reference setting; others change one flag)"),
                            exclude=_SETTING_FLAGS)


_SETTING_FLAGS = ("quantization", "kv_cache_dtype", "dtype")


def settings(args) -> list[tuple[str, dict]]:
    """(label, EngineArgs changes) per setting, the reference first."""
    out = [("reference", {})]
    for q in filter(None, (s.strip() for s in args.quantization.split(","))):
        q, _, d = q.partition("+")
        if d:
            out.append((f"--quantization {q} --dtype {d}", {"quantization": q, "dtype": d}))
        else:
            out.append((f"--quantization {q}", {"quantization": q}))
    for d in filter(None, (s.strip() for s in args.kv_cache_dtype.split(","))):
        out.append((f"--kv-cache-dtype {d}", {"kv_cache_dtype": d}))
    for d in filter(None, (s.strip() for s in args.dtype.split(","))):
        out.append((f"--dtype {d}", {"dtype": d}))
    return out


def teacher_forced(engine_args: EngineArgs, prompts: list[list[int]], top_k: int) -> Distributions:
    from kvserve.engine.engine import Engine
    from kvserve.sampling_params import SamplingParams

    engine = Engine(engine_args)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top_k, detokenize=False)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    seconds = time.perf_counter() - start
    top_ids, top_lps, targets = [], [], []
    for i, ids in enumerate(prompts):
        for pos, entry in enumerate(finished[f"p{i}"].prompt_logprobs[1:], start=1):
            ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in entry.items()), key=lambda e: (e[0], e[1]))
            top = [(tok, lp) for rank, tok, lp in ranked if rank <= top_k][:top_k]
            top_ids.append(np.array([t for t, _ in top], dtype=np.int64))
            top_lps.append(np.array([lp for _, lp in top], dtype=np.float64))
            targets.append(entry[ids[pos]].logprob)
    del engine
    gc.collect()
    return Distributions(top_ids, top_lps, np.array(targets, dtype=np.float64), seconds)


def compare(ref: Distributions, other: Distributions) -> dict:
    agree, kls = 0, []
    for ids_p, lp_p, ids_q, lp_q in zip(ref.top_ids, ref.top_logprobs, other.top_ids, other.top_logprobs):
        agree += int(ids_p[0] == ids_q[0])
        q_of = dict(zip(ids_q.tolist(), lp_q.tolist()))
        q_rest = max(1.0 - float(np.exp(lp_q).sum()), 1e-12)
        q_floor = min(float(np.exp(lp_q[-1])), q_rest)
        p = np.exp(lp_p)
        q = np.array([math.exp(q_of[t]) if t in q_of else q_floor for t in ids_p.tolist()])
        p_tail = max(1.0 - float(p.sum()), 0.0)
        q_tail = max(1.0 - float(q.sum()), 1e-12)
        kl = float(np.sum(p * (lp_p - np.log(q))))
        if p_tail > 0:
            kl += p_tail * math.log(p_tail / q_tail)
        kls.append(max(kl, 0.0))
    n = len(ref.top_ids)
    return {"positions": n, "top1_agreement": agree / n, "mean_kl": float(np.mean(kls)),
            "perplexity": float(np.exp(-other.target_logprobs.mean())),
            "perplexity_ratio": float(np.exp(ref.target_logprobs.mean() - other.target_logprobs.mean()))}


def run(args) -> int:
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    requests = load_workload(args.workload, args.num_prompts)
    prompts = [r.prompt_token_ids for r in requests]
    engine_flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _SETTING_FLAGS})
    # NOTE: float32 pinned, not auto: the reference must not follow auto to bf16 on a CPU that has it.
    base = dataclasses.replace(EngineArgs.from_cli(engine_flags), dtype="float32", max_num_batched_tokens=args.chunk,
                               max_logprobs=max(args.top_k, 20), speculative_config=None)
    rows, ref = [], None
    for label, changes in settings(args):
        dist = teacher_forced(dataclasses.replace(base, **changes), prompts, args.top_k)
        if ref is None:
            ref = dist
        row = {"setting": label, **compare(ref, dist), "seconds": dist.seconds}
        rows.append(row)
        print(f"[quality] {label}: top-1 {row['top1_agreement']:.2%}, KL {row['mean_kl']:.4f}, "
              f"ppl {row['perplexity']:.3f}", flush=True)
    print()
    print(f"{len(prompts)} prompts, {rows[0]['positions']} positions, top-{args.top_k}, {args.chunk}-token chunks")
    print(f"{'setting':<28} {'top-1 agree':>11} {'mean KL':>9} {'perplexity':>10} {'ppl ratio':>9}")
    for r in rows:
        print(f"{r['setting']:<28} {r['top1_agreement']:>11.2%} {r['mean_kl']:>9.4f} {r['perplexity']:>10.3f} "
              f"{r['perplexity_ratio']:>8.3f}x")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0
