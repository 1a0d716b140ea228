"""Tensor-parallel communication cost model (docs/PARALLELISM.md): bytes each rank sends per step, and the
share of a step the all-reduces take on a given link, for a model shape and a step shape.

Per step of T tokens, S of them sampled, a Megatron-sharded Llama runs 2 all-reduces per layer (after o_proj
and down_proj) plus one for the vocabulary-parallel embedding, each of T x hidden activations, and one
all-gather of the S x vocab / N logits. Ring collectives: an all-reduce of B bytes sends 2 (N-1)/N B per
rank in 2 (N-1) hops; an all-gather of B bytes per rank sends (N-1) B in N-1 hops. Time per collective =
hops x latency + bytes / link bandwidth (one direction). Compute is the roofline of one rank's share:
decode (memory-bound) reads its weights and KV once; prefill (compute-bound) does 2 x params x T FLOPs
over N ranks. No overlap of communication and compute is assumed (an upper bound on the share).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_params: float
    num_kv_heads: int
    head_dim: int
    act_bytes: int = 2      # bf16 activations and weights
    logit_bytes: int = 4    # float32 logits


LLAMA_3_70B = ModelShape("Llama-3-70B", 80, 8192, 128256, 70.6e9, 8, 128)


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float   # bytes/s, one direction, per rank
    latency: float     # s per ring hop


NVLINK = Link("NVLink 4 (H100 SXM, 450 GB/s per direction)", 450e9, 1e-6)
ETHERNET_100G = Link("100 Gb/s Ethernet (12.5 GB/s, TCP)", 12.5e9, 30e-6)


@dataclass(frozen=True)
class Device:
    hbm_bandwidth: float = 3.35e12   # H100 SXM
    flops: float = 989e12            # H100 SXM bf16 dense


def step_bytes(shape: ModelShape, n: int, num_tokens: int, num_sampled: int) -> dict[str, float]:
    """Bytes one rank sends in one step, by collective, and the calls (ring model above)."""
    ar_calls = 2 * shape.num_layers + 1
    ar = ar_calls * 2 * (n - 1) / n * num_tokens * shape.hidden_size * shape.act_bytes
    ag = (n - 1) * num_sampled * shape.vocab_size / n * shape.logit_bytes
    return {"all_reduce_calls": ar_calls, "all_reduce_bytes": ar, "all_gather_calls": 1, "all_gather_bytes": ag}


def comm_seconds(shape: ModelShape, n: int, num_tokens: int, num_sampled: int, link: Link) -> float:
    b = step_bytes(shape, n, num_tokens, num_sampled)
    hops = b["all_reduce_calls"] * 2 * (n - 1) + (n - 1)
    return hops * link.latency + (b["all_reduce_bytes"] + b["all_gather_bytes"]) / link.bandwidth


def compute_seconds(shape: ModelShape, n: int, num_tokens: int, context: int, device: Device = Device()) -> float:
    """One rank's roofline time: max(memory time, FLOP time) for its 1/N of the weights and KV."""
    weight_bytes = shape.num_params * shape.act_bytes / n
    kv_bytes = 2 * shape.num_layers * max(1, shape.num_kv_heads // n) * shape.head_dim * shape.act_bytes * context
    flops = 2 * shape.num_params * num_tokens / n
    return max((weight_bytes + kv_bytes) / device.hbm_bandwidth, flops / device.flops)


# (label, tokens in the step, sampled rows, KV tokens read)
STEPS = (("decode, batch 1 (ctx 2k)", 1, 1, 2048),
         ("decode, batch 64 (ctx 2k each)", 64, 64, 64 * 2048),
         ("prefill chunk, 2048 tokens", 2048, 1, 2048))


def table(shape: ModelShape = LLAMA_3_70B, sizes=(2, 4, 8), links=(NVLINK, ETHERNET_100G)) -> list[dict]:
    rows = []
    for label, tokens, sampled, context in STEPS:
        for n in sizes:
            row = {"step": label, "tp": n,
                   "bytes_per_rank": sum(v for k, v in step_bytes(shape, n, tokens, sampled).items()
                                         if k.endswith("bytes")),
                   "compute_ms": 1e3 * compute_seconds(shape, n, tokens, context)}
            for link in links:
                comm = comm_seconds(shape, n, tokens, sampled, link)
                row[link.name] = (1e3 * comm, comm / (comm + compute_seconds(shape, n, tokens, context)))
            rows.append(row)
    return rows


def format_table(rows: list[dict], links=(NVLINK, ETHERNET_100G)) -> str:
    head = ["step", "TP", "sent per rank", "compute (ms)"] + [f"{link.name}: all-reduce ms (share)" for link in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["step"], str(r["tp"]), _size(r["bytes_per_rank"]), f"{r['compute_ms']:.2f}"]
        cells += [f"{r[link.name][0]:.2f} ({100 * r[link.name][1]:.0f}%)" for link in links]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
