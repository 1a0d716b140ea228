"""`kvserve bench lora`: a workload spread round-robin over N LoRA adapters, three ways, same run:

- `base`: the requests on the base model alone (no LoRA): the ceiling;
- `multi-lora`: one engine with `--enable-lora --max-loras N`, every adapter in the same batches;
- `one engine per adapter`: for each adapter in turn, an engine serving only its requests (the "separate
  deployments" multi-LoRA replaces), run one after another; their seconds add up.

The adapters are random PEFT-format files (rank --rank on q/k/v/o and the MLP projections) written to a
temporary folder: no download, and the timing does not depend on what they learnt. Greedy; prints output
tok/s and ratios. Never asserts. Engine flags apply to every engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import torch

from kvserve.bench.workload import WorkloadRequest, load_workload
from kvserve.config import EngineArgs

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed", help="workload .jsonl file, or a built-in name")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16, help="rank of the random adapters")
    parser.add_argument("--skip-separate", action="store_true",
                        help="do not run the one-engine-per-adapter baseline (it loads N engines)")
    parser.add_argument("--json", action="store_true", help="print results as JSON too")
    group = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(group)


def write_random_adapter(path: str, hf_config, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a Llama-shaped model."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (n_in, n_out) in shapes.items():
            side = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{side}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_TARGETS),
                   "bias": "none", "use_rslora": False}, f)


def run_engine(args: EngineArgs, requests: list[WorkloadRequest], loras: list) -> tuple[float, int]:
    """(seconds, output tokens) of one engine running `requests` at once, request i with loras[i]."""
    from kvserve.engine.engine import Engine
    from kvserve.sampling_params import SamplingParams

    engine = Engine(args)
    warm = requests[0]  # allocator, first-call paths, the adapter's first load: not timed
    engine.add_request("warm", warm.prompt_token_ids, SamplingParams(temperature=0, max_tokens=2, detokenize=False),
                       lora_request=loras[0])
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for r, lora in zip(requests, loras):
        engine.add_request(r.id, r.prompt_token_ids, SamplingParams(
            temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False), lora_request=lora)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def run(args) -> int:
    from kvserve.lora.request import LoRARequest

    engine_args = EngineArgs.from_cli(args)
    requests = load_workload(args.workload)
    hf_config = engine_args.create_engine_config().model.hf_config
    n = args.num_adapters
    print(f"workload {args.workload}: {len(requests)} requests round-robin over {n} random rank-{args.rank} "
          f"adapters; torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-lora-bench-") as tmp:
        adapters = []
        for i in range(n):
            path = os.path.join(tmp, f"adapter{i}")
            write_random_adapter(path, hf_config, args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        loras = [adapters[i % n] for i in range(len(requests))]
        seconds, tokens = run_engine(dataclasses.replace(engine_args, enable_lora=False), requests,
                                     [None] * len(requests))
        rows.append(("base model alone", seconds, tokens))
        print(f"[lora] base: {tokens / seconds:.1f} output tok/s", flush=True)
        multi = dataclasses.replace(engine_args, enable_lora=True, max_loras=n, max_lora_rank=args.rank)
        seconds, tokens = run_engine(multi, requests, loras)
        rows.append((f"multi-lora ({n} adapters, one engine)", seconds, tokens))
        print(f"[lora] multi-lora: {tokens / seconds:.1f} output tok/s", flush=True)
        if not args.skip_separate:
            one = dataclasses.replace(engine_args, enable_lora=True, max_loras=1, max_lora_rank=args.rank)
            total_s = total_tokens = 0
            for i, adapter in enumerate(adapters):
                mine = [r for j, r in enumerate(requests) if j % n == i]
                seconds, tokens = run_engine(one, mine, [adapter] * len(mine))
                total_s, total_tokens = total_s + seconds, total_tokens + tokens
            rows.append((f"one engine per adapter ({n}, one after another)", total_s, total_tokens))
            print(f"[lora] separate: {total_tokens / total_s:.1f} output tok/s", flush=True)
    base_tps = rows[0][2] / rows[0][1]
    multi_tps = rows[1][2] / rows[1][1]
    print()
    print(f"{'setup':<48} {'seconds':>8} {'out tok/s':>10} {'vs base':>8} {'multi-lora x':>13}")
    for name, seconds, tokens in rows:
        tps = tokens / seconds
        print(f"{name:<48} {seconds:>8.1f} {tps:>10.1f} {tps / base_tps:>7.2f}x {multi_tps / tps:>12.2f}x")
    if args.json:
        print(json.dumps([{"setup": name, "seconds": s, "output_tokens": t, "output_tps": t / s}
                          for name, s, t in rows], indent=2))
    return 0
