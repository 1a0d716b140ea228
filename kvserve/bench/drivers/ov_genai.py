"""Peer driver: OpenVINO GenAI's ContinuousBatchingPipeline (paged attention + continuous batching in C++).

Args (JSON file): model (OpenVINO IR folder), workload, threads, max_num_batched_tokens, kv_cache_gb,
prefix_caching, precision ("f32", or "default": OpenVINO's own choice). Requests are added when they arrive and the pipeline is stepped by this loop, so every
token is timestamped when the step that made it returns: the same points a streaming server would send.
With precision "f32" inference and KV-cache precision are set explicitly, because on CPUs with bf16 or AMX
OpenVINO would otherwise pick bf16 (and u8 for the KV cache) by itself; "default" leaves that choice to it.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

import replay


def main() -> None:
    args = replay.read_args()
    sched = ov_genai.SchedulerConfig()
    sched.max_num_batched_tokens = int(args["max_num_batched_tokens"])
    sched.cache_size = int(args["kv_cache_gb"])
    sched.dynamic_split_fuse = True  # chunked prefill beside decodes, as vLLM and kvserve do
    sched.enable_prefix_caching = bool(args["prefix_caching"])
    sched.max_num_seqs = 256
    properties = {"INFERENCE_NUM_THREADS": int(args["threads"])}
    if args.get("precision", "f32") == "f32":
        properties.update({"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                           "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    pipe = ov_genai.ContinuousBatchingPipeline(args["model"], sched, "CPU", properties)

    def config(max_tokens: int, ignore_eos: bool):
        gc = ov_genai.GenerationConfig()
        gc.max_new_tokens = max_tokens
        gc.ignore_eos = ignore_eos
        gc.do_sample = False
        return gc

    def ids_tensor(ids: list[int]):
        return ov.Tensor(np.array([ids], dtype=np.int64))

    # warm-up: compile and first-step allocations are not the workload's
    pipe.generate([ids_tensor([7, 8, 9, 10])], [config(4, True)])

    requests = replay.load_requests(args["workload"])
    timings = [replay.RequestTiming(str(r["id"]), len(r["prompt_token_ids"]), float(r.get("arrival_s", 0.0)))
               for r in requests]
    clock = replay.Clock()
    active: list[tuple[replay.RequestTiming, object]] = []
    nxt = 0
    while nxt < len(requests) or active:
        while nxt < len(requests) and timings[nxt].arrival_s <= clock.now():
            r = requests[nxt]
            handle = pipe.add_request(nxt, ids_tensor(r["prompt_token_ids"]),
                                      config(int(r["max_tokens"]), bool(r.get("ignore_eos", True))))
            active.append((timings[nxt], handle))
            nxt += 1
        if not active:
            clock.sleep_until(timings[nxt].arrival_s)
            continue
        pipe.step()
        now = clock.now()
        still = []
        for timing, handle in active:
            while handle.can_read():
                for out in handle.read().values():
                    timing.token_ids.extend(int(t) for t in out.generated_ids)
                    timing.token_times.extend([now] * len(out.generated_ids))
            status = handle.get_status()
            if status == ov_genai.GenerationStatus.RUNNING:
                still.append((timing, handle))
            elif status != ov_genai.GenerationStatus.FINISHED:
                timing.error = f"generation ended with status {status}"
        active = still
    replay.write_results(timings, clock.now())


if __name__ == "__main__":
    main()
