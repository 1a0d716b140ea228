"""`kvserve bench tp`: a workload offline at tensor_parallel_size 1 and N, same run: throughputs, the
bytes each rank sends per step and per token (measured, and the cost model's figure for the same steps),
then the cost model's all-reduce share for a Llama-3-70B shape (bench/tp_cost.py; docs/PARALLELISM.md).

Default model: a random-weight Llama with SmolLM2-135M's shape except 8 query / 2 KV heads (head_dim 72),
since the built-in SmolLM2's 9 heads split over 1, 3 or 9 ranks only; its tokenizer is SmolLM2's. Output
lengths are the workload's (ignore_eos), so random weights cost what real ones would. `--cost-model-only`
prints the table without running anything.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from kvserve.bench.tp_cost import LLAMA_3_70B, format_table, table
from kvserve.bench.workload import load_workload

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed", help="JSONL workload (token ids), or a built-in name")
    parser.add_argument("--num-requests", type=int, help="use only the first N requests (default: all)")
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder whose heads N divides; default: a random SmolLM2-shaped Llama "
                             "with 8 heads / 2 KV heads")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="N, compared with 1")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per rank (default: cores / N for TP=N, all cores for TP=1)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per rank")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of TP=1 and TP=N; the best counts")
    parser.add_argument("--cost-model-only", action="store_true", help="print the cost-model table and exit")


def _synthetic_model(path: str) -> str:
    import torch
    import transformers as tf

    from kvserve.model_loader.gguf_loader import builtin_model_path, load_gguf_tokenizer

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    load_gguf_tokenizer(builtin_model_path()).save_pretrained(path)
    return path


def _engine(model: str, tp: int, threads: int | None, kv: str, requests):
    from kvserve.engine.llm import LLM

    llm = LLM(model, tensor_parallel_size=tp, num_threads=threads, kv_cache_memory=kv, speculative_config=None)
    _run(llm, requests[:2])  # warm-up
    return llm


def _run(llm, requests) -> dict:
    """One timed pass of the workload, and what the ranks sent during it."""
    from kvserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False)
              for r in requests]
    group = getattr(llm.engine.core.executor, "group", None)
    before = _snapshot(group)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _snapshot(group)
    return {"tp": llm.engine.config.parallel.tensor_parallel_size, "seconds": seconds,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "comm": {k: after[k] - before[k] for k in after}}


def _hf_config(model: str):
    from kvserve.model_loader.loader import ModelSource, load_hf_config

    return load_hf_config(ModelSource.resolve(model))


def _snapshot(group) -> dict:
    if group is None:
        return {"steps": 0, "all_reduce_bytes": 0, "all_gather_bytes": 0, "broadcast_bytes": 0,
                "all_reduce_calls": 0}
    s = group.stats
    return {"steps": s.steps, "all_reduce_bytes": s.all_reduce_bytes, "all_gather_bytes": s.all_gather_bytes,
            "broadcast_bytes": s.broadcast_bytes, "all_reduce_calls": s.all_reduce_calls}


def run(args) -> int:
    if args.tensor_parallel_size < 2:
        raise ValueError(f"--tensor-parallel-size must be >= 2 (it is compared with 1), got "
                         f"{args.tensor_parallel_size}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not args.cost_model_only:
        _measure(args)
    print(f"\ncost model, {LLAMA_3_70B.name} shape (bf16, H100 SXM roofline, no overlap; bench/tp_cost.py):")
    print(format_table(table()))
    return 0


def _measure(args) -> None:
    import os

    requests = load_workload(args.workload, args.num_requests)
    cores = os.cpu_count() or 1
    n = args.tensor_parallel_size
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _synthetic_model(tmp)
        name = args.model or "synthetic SmolLM2 shape, 8 heads / 2 KV heads"
        print(f"workload {args.workload}: {len(requests)} requests; model {name}; {cores} cores")
        llms = [_engine(model, 1, args.num_threads or cores, args.kv_cache_memory, requests),
                _engine(model, n, args.num_threads or max(1, cores // n), args.kv_cache_memory, requests)]
        best: list[dict | None] = [None, None]
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits both alike; the best round counts
            for i, llm in enumerate(llms):
                r = _run(llm, requests)
                if best[i] is None or r["seconds"] < best[i]["seconds"]:
                    best[i] = r
        for llm in llms:
            llm.shutdown()
        one, many = best
        hf = _hf_config(model)
    print("\n| TP | seconds | output tok/s | total tok/s | vs TP=1 |\n|---|---|---|---|---|")
    for r in (one, many):
        print(f"| {r['tp']} | {r['seconds']:.1f} | {r['output_tokens'] / r['seconds']:.1f} | "
              f"{(r['output_tokens'] + r['prompt_tokens']) / r['seconds']:.1f} | "
              f"{one['seconds'] / r['seconds']:.2f}x |")
    c = many["comm"]
    steps, tokens = max(1, c["steps"]), many["output_tokens"] + many["prompt_tokens"]
    per_rank = c["all_reduce_bytes"] + c["all_gather_bytes"]
    print(f"\nbytes each rank sends at TP={n} (ring-algorithm count, kvserve/distributed/comm.py), {c['steps']} steps:")
    print(f"  all-reduce {c['all_reduce_bytes'] / steps / 1024:.1f} KiB/step ({c['all_reduce_calls'] / steps:.0f} "
          f"calls/step), logits all-gather {c['all_gather_bytes'] / steps / 1024:.1f} KiB/step; "
          f"{per_rank / tokens:.0f} B per (prompt + output) token")
    formula = (2 * hf.num_hidden_layers + 1) * 2 * (n - 1) / n * hf.hidden_size * 4
    print(f"  cost model: {formula:.0f} B of all-reduce per computed token (fp32 here; prefix-cache hits are not "
          f"computed, preemption recomputes)")
    print(f"  driver's step broadcast (scheduler diff + sampled tokens): {c['broadcast_bytes'] / steps:.0f} B/step "
          f"from rank 0, {c['broadcast_bytes'] / tokens:.1f} B per token")
