"""The GPU figures of scripts/gpu_check.sh, on an 8B-shaped dummy model (Llama-3-8B's config, random bf16
weights, prompts as token ids):

  1. the offline `mixed` workload through kvserve, and through transformers in static batches of 16, same run;
  2. decode steps at batch 1 and 64, as fractions of the device's HBM bandwidth and dense bf16 tensor-core
     peak (the step's bytes: every weight but the embedding table, plus the K/V it reads; its FLOPs:
     2 x those weights x batch, plus attention).

Writes one JSON object per figure to --out (gpu_check.sh prints the table). Never asserts; a figure below
its target is marked in the table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

# (name fragment, HBM bytes/s, dense bf16 FLOP/s) from the vendors' spec sheets; first match wins.
_PEAKS = (("H200", 4.8e12, 989e12), ("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12),
          ("H20", 4.0e12, 148e12), ("A100-SXM4-80GB", 2.039e12, 312e12), ("A100 80GB PCIe", 1.935e12, 312e12),
          ("A100", 1.555e12, 312e12), ("L40S", 0.864e12, 362e12), ("L4", 0.3e12, 121e12),
          ("A10", 0.6e12, 125e12))
# Dense bf16 FLOPs per SM per clock by compute capability (for a device not in the table).
_FLOPS_PER_SM_CLOCK = {(9, 0): 4096, (8, 0): 2048, (8, 9): 1024, (8, 6): 1024}

# (prompt tokens, output tokens) of kvserve/bench/workloads/mixed.jsonl, for a machine without the file.
_MIXED_SHAPES = [(157, 167), (443, 128), (508, 21), (128, 228), (413, 77), (62, 105), (433, 118), (437, 124),
                 (249, 59), (286, 91), (56, 114), (196, 218), (255, 86), (261, 193), (185, 117), (156, 201),
                 (151, 203), (444, 43), (42, 250), (314, 118), (63, 100), (273, 236), (429, 87), (96, 86),
                 (427, 203), (499, 97), (461, 158), (137, 72), (435, 210), (152, 166), (170, 60), (136, 197),
                 (430, 59), (356, 115), (382, 94), (403, 121), (393, 149), (425, 73), (114, 151), (355, 221),
                 (160, 115), (215, 36), (139, 107), (121, 205), (286, 162), (431, 86), (490, 49), (138, 54),
                 (467, 234), (266, 204), (228, 66), (174, 150), (249, 184), (105, 109), (302, 168), (325, 26),
                 (354, 74), (261, 169), (151, 98), (183, 127), (96, 82), (127, 83), (484, 199), (89, 135)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peaks_from_properties() -> tuple[float, float] | None:
    """(bytes/s, FLOP/s) from GPU 0's properties (memory clock x bus width x 2 for DDR; SMs x clock x dense
    bf16 FLOPs per SM per clock), where this torch exposes the clocks."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    sm_khz = getattr(props, "clock_rate", 0)
    per_sm = _FLOPS_PER_SM_CLOCK.get((props.major, props.minor), 1024)
    if not (clock_khz and bus_bits and sm_khz):
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8, props.multi_processor_count * sm_khz * 1e3 * per_sm


def device_peaks() -> tuple[float, float, str]:
    """(bytes/s, FLOP/s, where they came from) for GPU 0: the spec sheet where the name is known (boost
    clocks, what the limits are quoted at), else the properties."""
    name = torch.cuda.get_device_properties(0).name
    derived = peaks_from_properties()
    seen = (f"; properties say {derived[0] / 1e12:.2f} TB/s, {derived[1] / 1e12:.0f} TFLOP/s" if derived
            else "; this torch exposes no clocks")
    for fragment, bw, flops in _PEAKS:
        if fragment in name:
            return bw, flops, f"spec sheet for {fragment}{seen}"
    if derived:
        return derived[0], derived[1], "device properties"
    raise SystemExit(f"unknown device {name!r} and its properties give no clocks: add it to _PEAKS")


def load_requests(path: str | None):
    from kvserve.bench.workload import WorkloadRequest, load_workload

    if path and os.path.isfile(path):
        return load_workload(path), path
    g = torch.Generator().manual_seed(0)
    reqs = [WorkloadRequest(f"synthetic-{i}", torch.randint(10, 49000, (p,), generator=g).tolist(), m)
            for i, (p, m) in enumerate(_MIXED_SHAPES)]
    return reqs, "synthetic prompts of mixed's lengths (mixed.jsonl not found)"


def emit(out, **fields) -> None:
    print(json.dumps(fields), flush=True)
    out.write(json.dumps(fields) + "\n")
    out.flush()


def run_kvserve(llm, requests) -> tuple[float, int]:
    from kvserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
              for r in requests]
    _sync()
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    _sync()
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_step_seconds(llm, batch: int, prompt_len: int = 128, steps: int = 32) -> tuple[float, int]:
    """Mean seconds of a decode-only step with `batch` requests (their prefills done first, not timed);
    returns it with the mean context length of the timed steps."""
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True, detokenize=False)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [(31 * i + 7 * j) % 30000 + 10 for j in range(prompt_len)], params)
    budget = engine.config.scheduler.max_num_batched_tokens
    for _ in range(-(-batch * prompt_len // budget) + 3):  # every prefill done, a few decodes in
        engine.step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    seconds = (time.perf_counter() - start) / steps
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, prompt_len + 3 + steps // 2


@torch.inference_mode()
def run_hf_static(cfg, requests, batch_size: int, device: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else None).eval()
    from kvserve.bench.offline import hf_static_batches

    start = time.perf_counter()
    useful = hf_static_batches(model, requests, batch_size, device)
    _sync()
    seconds = time.perf_counter() - start
    del model
    return seconds, useful


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", help="mixed.jsonl (token ids); missing: synthetic prompts of its lengths")
    parser.add_argument("--out", required=True, help="JSON lines written here")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--model", help="a config-only folder (default: the built-in Llama-3-8B config)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (tests)")
    parser.add_argument("--num-requests", type=int, help="the first N requests only (default: all)")
    args = parser.parse_args()

    from kvserve.engine.llm import LLM
    from kvserve.model_loader.dummy import builtin_config_dir
    from kvserve.model_loader.loader import ModelSource, load_hf_config

    on_gpu = args.device == "cuda"
    bw, flops, peaks_from = device_peaks() if on_gpu else (1e11, 1e12, "made up: a CPU smoke test")
    model_dir = args.model or builtin_config_dir("Llama-3-8B")
    requests, source = load_requests(args.workload)
    requests = requests[:args.num_requests] if args.num_requests else requests
    with open(args.out, "w") as out:
        emit(out, kind="device", name=torch.cuda.get_device_name(0) if on_gpu else "cpu", hbm_bytes_s=bw,
             bf16_flops=flops, peaks_from=peaks_from, workload=source)
        start = time.perf_counter()
        llm = LLM(model=model_dir, load_format="dummy", device=args.device,
                  dtype="bfloat16" if on_gpu else "float32", max_num_seqs=64,
                  max_model_len=2048, speculative_config=None, enforce_eager=args.enforce_eager,
                  # NOTE: 0.6, not 0.9: the transformers baseline needs its own 16 GB later in this process,
                  # should anything keep the engine's pool alive; mixed needs ~6 GB of KV.
                  gpu_memory_utilization=0.6)
        worker = llm.engine.core.executor.worker
        emit(out, kind="startup", seconds=time.perf_counter() - start, backend=worker.backend.name,
             cuda_graphs=worker.runner.cuda_graphs is not None,
             kv_cache_gib=llm.engine.core.kv_spec.num_bytes / 2**30,
             plan=worker.memory_plan.describe() if worker.memory_plan else None)
        run_kvserve(llm, requests[:4])  # warm-up: Triton compiles the prefill variants, not timed
        seconds, produced = run_kvserve(llm, requests)
        emit(out, kind="offline", engine="kvserve", seconds=seconds, output_tokens=produced,
             output_tps=produced / seconds)

        model = worker.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        read_bytes = weight_bytes - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        matmul_params = read_bytes // 2
        spec = llm.engine.core.kv_spec
        cfg = llm.engine.hf_config
        for batch in (1, 64):
            step_s, context = decode_step_seconds(llm, batch)
            step_bytes = read_bytes + batch * context * spec.bytes_per_token
            step_flops = 2 * matmul_params * batch + 4 * batch * context * cfg.num_hidden_layers * \
                cfg.num_attention_heads * cfg.head_dim
            bound_s = max(step_bytes / bw, step_flops / flops)
            emit(out, kind="decode", batch=batch, step_ms=step_s * 1e3, tokens_s=batch / step_s,
                 bandwidth_frac=step_bytes / step_s / bw, tensor_core_frac=step_flops / step_s / flops,
                 roofline_frac=bound_s / step_s)
        hf_cfg = load_hf_config(ModelSource("hf", model_dir))
        del llm, model, worker
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        seconds, produced = run_hf_static(hf_cfg, requests, args.hf_batch_size, args.device)
        emit(out, kind="offline", engine=f"transformers static batches of {args.hf_batch_size}", seconds=seconds,
             output_tokens=produced, output_tps=produced / seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
