"""Playbook rows about scheduling and allocation: static vs continuous batching, contiguous vs paged KV,
chunked prefill on vs off. Each side is a fresh engine built from the user's flags with one switch changed."""
from __future__ import annotations

from itertools import pairwise

from kvserve.bench import playbook_workloads as wl
from kvserve.bench.itl import replay
from kvserve.bench.playbook_report import Row
from kvserve.bench.playbook_run import Context, close, make_engine, run_all
from kvserve.bench.serve import _stats


def continuous_batching(ctx: Context) -> Row:
    p = ctx.preset
    requests = wl.varied(p.varied_requests, p.varied_prompt, p.varied_max_output, ctx.vocab_size)
    runs = {}
    for name, static in (("static", True), ("continuous", False)):
        engine = make_engine(ctx.engine_args, static_batching=static, max_num_seqs=p.batch_seqs)
        runs[name] = run_all(engine, requests)
        close(engine)
        ctx.log(f"[continuous-batching] {name}: {runs[name].output_tps:.1f} output tok/s")
    s, c = runs["static"], runs["continuous"]
    ls, lc = _stats(s.latencies), _stats(c.latencies)
    return Row("continuous-batching", "continuous vs static batching", "4-10x throughput", (4.0, 10.0),
               headline=c.output_tps / s.output_tps, headline_label="throughput",
               details={"static_output_tps": s.output_tps, "continuous_output_tps": c.output_tps,
                        "static_latency_mean_s": ls["mean_ms"] / 1e3, "continuous_latency_mean_s": lc["mean_ms"] / 1e3,
                        "static_latency_p99_s": ls["p99_ms"] / 1e3, "continuous_latency_p99_s": lc["p99_ms"] / 1e3,
                        "identical_outputs": sum(s.outputs[k] == c.outputs.get(k) for k in s.outputs),
                        "requests": len(requests), "max_num_seqs": p.batch_seqs},
               command=ctx.command("continuous-batching"),
               note="both sides the same engine; static: --static-batching (a batch runs until its longest "
                    "request ends)")


def paged_attention(ctx: Context) -> Row:
    p = ctx.preset
    bs = ctx.engine_args.block_size
    num_blocks = p.paged_slabs * -(-p.paged_max_model_len // bs)
    requests = wl.free_form(p.paged_requests, p.paged_prompt, p.paged_output, ctx.vocab_size, seed=1)
    runs = {}
    for name in ("contiguous", "paged"):
        engine = make_engine(ctx.engine_args, kv_reservation=name, num_gpu_blocks_override=num_blocks,
                             max_model_len=p.paged_max_model_len, max_num_seqs=max(p.paged_requests, 1))
        runs[name] = run_all(engine, requests)
        close(engine)
        ctx.log(f"[paged-attention] {name}: peak {runs[name].peak_running} requests, "
                f"{runs[name].output_tps:.1f} output tok/s")
    c, g = runs["contiguous"], runs["paged"]
    return Row("paged-attention", "PagedAttention vs contiguous KV", "2-3x more concurrent requests", (2.0, 3.0),
               headline=g.peak_running / max(1, c.peak_running), headline_label="concurrent requests",
               details={"kv_blocks": num_blocks, "max_model_len": p.paged_max_model_len,
                        "contiguous_peak_requests": c.peak_running, "paged_peak_requests": g.peak_running,
                        "contiguous_output_tps": c.output_tps, "paged_output_tps": g.output_tps,
                        "throughput_ratio": g.output_tps / c.output_tps, "requests": len(requests)},
               command=ctx.command("paged-attention"),
               note=f"a KV pool of {p.paged_slabs} max_model_len slabs; contiguous: --kv-reservation contiguous "
                    "(every request sets aside max_model_len); paged requests are bounded by the workload here")


def chunked_prefill(ctx: Context) -> Row:
    p = ctx.preset
    requests = wl.interference(p.short_requests, p.long_requests, p.short_prompt, p.short_output, p.long_prompt,
                               p.long_arrival_s, ctx.vocab_size)
    short = {r.id for r in requests if r.arrival_s == 0.0}
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    runs = {}
    for name, chunked in (("off", False), ("on", True)):
        engine = make_engine(ctx.engine_args, enable_chunked_prefill=chunked)
        times = replay(engine, requests, f"{name}-")
        close(engine)
        itl = [b - a for rid, ts in times.items() if rid in short for a, b in pairwise(ts)]
        seconds = max(t for ts in times.values() for t in ts)
        runs[name] = {"total_tps": tokens / seconds, "itl": _stats(itl)}
        ctx.log(f"[chunked-prefill] {name}: {tokens / seconds:.1f} tok/s, decode ITL p99 "
                f"{runs[name]['itl']['p99_ms']:.0f} ms")
    off, on = runs["off"], runs["on"]
    return Row("chunked-prefill", "chunked prefill on vs off", "1.1-1.3x throughput, much better P99", (1.1, 1.3),
               headline=on["total_tps"] / off["total_tps"], headline_label="throughput",
               details={"off_total_tps": off["total_tps"], "on_total_tps": on["total_tps"],
                        "off_decode_itl_p99_ms": off["itl"]["p99_ms"], "on_decode_itl_p99_ms": on["itl"]["p99_ms"],
                        "decode_itl_p99_ratio_off_over_on": off["itl"]["p99_ms"] / max(on["itl"]["p99_ms"], 1e-9),
                        "long_prompt_tokens": p.long_prompt, "short_requests": p.short_requests},
               command=ctx.command("chunked-prefill"),
               note="short requests decode while long prompts arrive; on: the engine's defaults "
                    "(chunks sized by --target-itl-ms); off: --no-enable-chunked-prefill")
