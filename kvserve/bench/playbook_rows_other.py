"""Playbook rows about the model's work: speculative decoding (n-gram and a draft model, copy-heavy and
free-form), multi-LoRA vs one engine per adapter, MoE's fused expert path vs the reference, batch invariance's
cost, and the rows this engine cannot measure."""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch

from kvserve.bench import lora as lora_bench
from kvserve.bench import moe as moe_bench
from kvserve.bench import playbook_workloads as wl
from kvserve.bench.engine_flags import engine_flags
from kvserve.bench.playbook_report import NOT_MEASURABLE, NOT_MEASURED, Row
from kvserve.bench.playbook_run import Context, close, make_engine, run_all
from kvserve.bench.spec import DEFAULT_SPEC, run_side

SPEC_CLAIM = ("1.5-2x decode", (1.5, 2.0))
SELF_LIMITING_FLOOR = 0.97
"""Free-form speculation must keep this much of the no-speculation speed (the policy turns drafts down)."""


def _spec_sides(ctx: Context, config: dict | None, workloads: dict) -> dict:
    engine = make_engine(ctx.engine_args, speculative_config=config)
    out = {name: run_side(engine, reqs, ctx.preset.spec_concurrency) for name, reqs in workloads.items()}
    close(engine)
    return out


def speculative(ctx: Context) -> list[Row]:
    p = ctx.preset
    workloads = {"copy-heavy": wl.copy_heavy(p.spec_requests, p.spec_prompt, p.spec_output, ctx.vocab_size),
                 "free-form": wl.free_form(p.spec_requests, p.spec_prompt, p.spec_output, ctx.vocab_size)}
    methods = {"spec-ngram": ("speculative decoding, n-gram", DEFAULT_SPEC)}
    if ctx.draft_model:
        methods["spec-draft"] = ("speculative decoding, draft model",
                                 {"method": "draft_model", "model": ctx.draft_model, "num_speculative_tokens": 4})
    methods = {k: v for k, v in methods.items() if not ctx.keys or k in ctx.keys}
    off = _spec_sides(ctx, None, workloads) if methods else {}
    rows = []
    for key, (technique, config) in methods.items():
        on = _spec_sides(ctx, config, workloads)
        ratio = {name: on[name].output_tps / off[name].output_tps for name in workloads}
        accept = {name: on[name].num_accepted_tokens / max(1, on[name].num_draft_tokens) for name in workloads}
        ctx.log(f"[{key}] copy-heavy {ratio['copy-heavy']:.2f}x, free-form {ratio['free-form']:.2f}x")
        rows.append(Row(key, technique, *SPEC_CLAIM, headline=ratio["copy-heavy"], headline_label="decode, copy-heavy",
                        details={"copy_heavy_speedup": ratio["copy-heavy"], "free_form_speedup": ratio["free-form"],
                                 "copy_heavy_acceptance": accept["copy-heavy"],
                                 "free_form_acceptance": accept["free-form"],
                                 "free_form_kept_floor": ratio["free-form"] >= SELF_LIMITING_FLOOR,
                                 "identical_outputs": all(on[n].outputs == off[n].outputs for n in workloads)},
                        command=ctx.command(key),
                        note=f"free-form must stay >= {SELF_LIMITING_FLOOR}x: the draft-length policy stops "
                             "speculating where drafts are rejected"))
    if not ctx.draft_model:
        rows.append(Row("spec-draft", "speculative decoding, draft model", *SPEC_CLAIM, status=NOT_MEASURED,
                        command=ctx.command("spec-draft") + " --draft-model PATH",
                        note="needs --draft-model PATH: a smaller model sharing the target's tokenizer"))
    return rows


def multi_lora(ctx: Context) -> Row:
    from kvserve.lora.request import LoRARequest

    p, args = ctx.preset, ctx.engine_args
    n = p.lora_adapters
    requests = wl.free_form(p.lora_requests, 32, p.lora_output, ctx.vocab_size, seed=5)
    probe = make_engine(args)
    num_blocks = probe.block_pool.num_blocks
    close(probe)
    with tempfile.TemporaryDirectory(prefix="kvserve-playbook-lora-") as tmp:
        adapters = []
        for i in range(n):
            path = os.path.join(tmp, f"adapter{i}")
            lora_bench.write_random_adapter(path, ctx.hf_config, p.lora_rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        multi = dataclasses.replace(args, enable_lora=True, max_loras=n, max_lora_rank=p.lora_rank,
                                    num_gpu_blocks_override=num_blocks)
        multi_s, multi_tokens = lora_bench.run_engine(multi, requests, [adapters[i % n] for i in range(len(requests))])
        one = dataclasses.replace(args, enable_lora=True, max_loras=1, max_lora_rank=p.lora_rank,
                                  num_gpu_blocks_override=max(1, num_blocks // n))
        sep_s = sep_tokens = 0
        for i, adapter in enumerate(adapters):
            mine = [r for j, r in enumerate(requests) if j % n == i]
            seconds, tokens = lora_bench.run_engine(one, mine, [adapter] * len(mine))
            sep_s, sep_tokens = sep_s + seconds, sep_tokens + tokens
    multi_tps, sep_tps = multi_tokens / multi_s, sep_tokens / sep_s
    ctx.log(f"[multi-lora] multi {multi_tps:.1f} tok/s, one engine per adapter {sep_tps:.1f} tok/s")
    return Row("multi-lora", "multi-LoRA vs one engine per adapter", "5-10x vs separate deployments", (5.0, 10.0),
               headline=multi_tps / sep_tps, headline_label="throughput",
               details={"adapters": n, "multi_lora_output_tps": multi_tps, "separate_output_tps": sep_tps,
                        "kv_blocks_total": num_blocks},
               command=ctx.command("multi-lora"),
               note=f"the separate engines split the KV pool ({num_blocks} blocks / {n}) and run one after another "
                    "on this machine (N deployments would each also hold the weights: not counted)")


def moe(ctx: Context) -> Row:
    p = ctx.preset
    parser = argparse.ArgumentParser()
    moe_bench.add_arguments(parser)
    args = parser.parse_args(["--hidden-size", str(p.moe_hidden), "--intermediate-size", str(p.moe_intermediate),
                              "--num-experts", str(p.moe_experts), "--top-k", str(p.moe_top_k),
                              "--batch-sizes", p.moe_batches, "--repeat", str(p.moe_repeat)])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        block = moe_bench.transformers_block(args, torch.float32, g)
        layer = moe_bench.kvserve_layer(args, block)
        paths = moe_bench.timed_paths(layer, block.gate.weight, ["fused", "reference"], None)
        rows = [moe_bench.time_batch(args, block, layer, paths, int(b), torch.float32, g, 1.0)
                for b in p.moe_batches.split(",")]
    speedups = {f"batch_{r['batch']}": r["reference"]["ms"] / r["fused"]["ms"] for r in rows}
    best = max(speedups.values())
    ctx.log(f"[moe] fused vs reference: {', '.join(f'{k} {v:.2f}x' for k, v in speedups.items())}")
    shape = (f"--hidden-size {p.moe_hidden} --intermediate-size {p.moe_intermediate} --num-experts {p.moe_experts} "
             f"--top-k {p.moe_top_k} --batch-sizes {p.moe_batches} --impls fused,reference")
    return Row("moe", "MoE fused experts vs reference", "2-4x from routing optimisations", (2.0, 4.0),
               headline=best, headline_label="layer, best batch",
               details=speedups | {"vs_transformers_" + f"batch_{r['batch']}": r["fused"]["speedup_vs_transformers"]
                                   for r in rows},
               command=f"{ctx.command('moe')}   (or: kvserve bench moe {shape})",
               note="one MoE layer (router + experts), fp32, random weights; the reference loops over experts")


def batch_invariance(ctx: Context) -> Row:
    """--batch-invariant's throughput cost on the varied workload: the default engine's output tok/s over the
    invariant one's (2.0x: the mode halves throughput). It also checks the mode's promise on the spot: the
    workload's first request alone gives the tokens it gave among the others."""
    flags = " ".join(engine_flags(dataclasses.replace(ctx.engine_args, batch_invariant=True)))
    row = Row("batch-invariance", "batch invariance: cost", "(its throughput cost, x)", None,
              command=f"{ctx.command('batch-invariance')}   (the mode alone: kvserve serve {flags})")
    p = ctx.preset
    requests = wl.varied(p.varied_requests, p.varied_prompt, p.varied_max_output, ctx.vocab_size, seed=7)
    runs = {}
    for flag in (False, True):
        engine = make_engine(ctx.engine_args, batch_invariant=flag)
        runs[flag] = run_all(engine, requests)
        if flag:
            alone = run_all(engine, requests[:1], tag="alone-")
        close(engine)
    tps = {flag: run.output_tps for flag, run in runs.items()}
    first = requests[0].id
    row.headline, row.headline_label = tps[False] / tps[True], "cost, default / invariant throughput"
    row.details = {"default_output_tps": tps[False], "invariant_output_tps": tps[True],
                   "throughput_ratio": tps[True] / tps[False],
                   "alone_equals_batched": alone.outputs[first] == runs[True].outputs[first]}
    row.note = ("the cost is default / invariant output tok/s (above 1: slower); fixed-order kernels "
                "(docs/features/batch-invariance.md)")
    ctx.log(f"[batch-invariance] cost {row.headline:.2f}x (invariant {tps[True]:.1f} vs {tps[False]:.1f} tok/s)")
    return row


def medusa_eagle(ctx: Context) -> Row:
    return Row("medusa-eagle", "Medusa / EAGLE heads", "2-3x decode", (2.0, 3.0), status=NOT_MEASURABLE,
               note="kvserve has no Medusa or EAGLE heads: the n-gram and draft-model rows are its speculation")
