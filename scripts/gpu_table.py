"""The figure rows of scripts/gpu_check.sh's summary table, from gpu_bench.py's JSON lines (argv[1]).

Verdicts: INFO (a figure), PASS / BELOW (a figure with a target: issue 16's, on an H200, 8B-shaped)."""
from __future__ import annotations

import json
import sys


def line(name: str, verdict: str, text: str) -> None:
    print(f"{name[:34]:<34} {verdict:<6} {text}")


def main(path: str) -> None:
    rows = [json.loads(x) for x in open(path) if x.strip()]
    offline = {r["engine"]: r for r in rows if r["kind"] == "offline"}
    for r in rows:
        if r["kind"] == "device":
            line("device", "INFO", f"{r['name']}: {r['hbm_bytes_s'] / 1e12:.2f} TB/s, "
                                   f"{r['bf16_flops'] / 1e12:.0f} bf16 TFLOP/s ({r['peaks_from']})")
            line("workload", "INFO", r["workload"])
        elif r["kind"] == "startup":
            graphs = "on" if r["cuda_graphs"] else "off"
            line("8B dummy startup", "INFO", f"{r['seconds']:.0f} s, {r['backend']}, CUDA graphs {graphs}, "
                                             f"KV {r['kv_cache_gib']:.1f} GiB")
            if r.get("plan"):
                line("  memory plan", "INFO", r["plan"])
        elif r["kind"] == "decode":
            text = (f"{r['step_ms']:.2f} ms/step, {r['tokens_s']:.0f} tok/s; {r['bandwidth_frac']:.0%} of HBM "
                    f"bandwidth, {r['tensor_core_frac']:.1%} of bf16 peak, {r['roofline_frac']:.0%} of the roofline")
            if r["batch"] == 1:
                line("decode batch 1", "PASS" if r["bandwidth_frac"] >= 0.7 else "BELOW",
                     text + " (target >= 70% of bandwidth)")
            else:
                line(f"decode batch {r['batch']}", "INFO", text)
    for name, r in offline.items():
        line(f"mixed: {name}".replace("transformers static batches of ", "transformers static x"), "INFO",
             f"{r['output_tps']:.0f} output tok/s ({r['output_tokens']} tokens, {r['seconds']:.1f} s)")
    kv = offline.get("kvserve")
    hf = next((r for name, r in offline.items() if name != "kvserve"), None)
    if kv and hf:
        ratio = kv["output_tps"] / hf["output_tps"]
        line("mixed: kvserve / transformers", "PASS" if ratio >= 10 else "BELOW", f"{ratio:.1f}x (target >= 10x)")


if __name__ == "__main__":
    main(sys.argv[1])
