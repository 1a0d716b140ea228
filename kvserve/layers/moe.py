"""Mixture-of-Experts: a router picks k of E expert MLPs per token; the experts are held stacked (vLLM's
FusedMoE): `w13 [E, 2I, H]` (each expert's gate rows then up rows) and `w2 [E, H, I]`.

Follows transformers' Qwen3MoeTopKRouter / Qwen3MoeExperts (softmax over the router logits in float32, top-k,
optionally renormalised to sum to one; each expert is SiLU(x Wg^T) * (x Wu^T) then Wd). Three paths compute
the experts, chosen by `impl` (default from envs.moe_impl(): fused):
- "reference": the oracle, transformers' loop: for each expert a mask over the batch, gather, two matmuls.
- "sorted": the (token, choice) pairs sorted by expert once per layer, each active expert's run of rows
  multiplied in place in one gathered buffer, weighted, then summed back per token with one index_add.
- "fused": one C++ call per layer over the active experts (layers/moe_fused.py), no Python per expert; the
  sorted path where it cannot run (not on the CPU, float16 weights, no compiler) or where an expert's rows are
  many enough that a dense matmul per expert wins (prefill-sized batches; moe_fused.MAX_ROWS_PER_EXPERT).

Under `--quantization int8` the experts are int8 as the decoder layers' linears are (same group size; codes and
scales made at load, moe_fused.py): the fused path reads the codes (at one or two tokens with 16-bit fixed-point
inputs unless KVSERVE_QUANT_FIXED_POINT=0, as the dense int8 kernels), the sorted one runs the dense int8 kernel
per expert, and the reference one multiplies by the dequantized weights.

Tensor parallelism splits every expert's intermediate dimension (as a column- then row-parallel MLP): rank r
holds rows [r * I/tp, (r + 1) * I/tp) of each expert's gate and up, the same columns of its down, and the
partial outputs are summed across ranks.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kvserve.envs as envs
from kvserve.layers import moe_fused
from kvserve.layers.linear import _copy
from kvserve.layers.moe_router import select_experts
from kvserve.layers.linear_methods import LinearMethod
from kvserve.layers.moe_fused import Int8Experts


def expert_params_mapping(num_experts: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                          stacked_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
                          ) -> list[tuple[str, str, int | None, str]]:
    """(our parameter, checkpoint name relative to the MoE block, expert id, shard id) for every tensor a
    FusedMoE layer can be loaded from: one per expert and projection (`experts.{e}.gate_proj.weight`, ...),
    and transformers' own stacked tensors (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`),
    whose expert id is None. A checkpoint holds one form or the other. `names`: an expert's (gate, up, down)
    projections as the checkpoint names them (Mixtral's: w1, w3, w2); `stacked_names`: the stacked tensors'
    names (Granite-MoE's: input_linear.weight, output_linear.weight)."""
    gate, up, down = names
    mapping = []
    for e in range(num_experts):
        mapping += [("w13", f"experts.{e}.{gate}.weight", e, "w1"),
                    ("w13", f"experts.{e}.{up}.weight", e, "w3"),
                    ("w2", f"experts.{e}.{down}.weight", e, "w2")]
    mapping += [("w13", stacked_names[0], None, "w13"), ("w2", stacked_names[1], None, "w2")]
    return mapping


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


SiluAndMul = Callable[[torch.Tensor], torch.Tensor]
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, silu_and_mul: SiluAndMul = _silu_and_mul) -> torch.Tensor:
    """The oracle (transformers' expert loop). x [T, H], weights/ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for e in ids.unique().tolist():
        token_idx, pos = torch.where(ids == e)
        h = silu_and_mul(F.linear(x[token_idx], w13[e]))
        out.index_add_(0, token_idx, F.linear(h, w2[e]) * weights[token_idx, pos, None])
    return out


def _dense_linear(w: torch.Tensor, e: int, rows: torch.Tensor) -> torch.Tensor:
    return torch.mm(rows, w[e].t())


def _int8_linear(w: Int8Experts, e: int, rows: torch.Tensor) -> torch.Tensor:
    return w.linear(e, rows)


ExpertLinear = Callable[[object, int, torch.Tensor], torch.Tensor]
"""(stacked weights, expert id, rows [M, K]) -> rows [M, N] through that expert's matrix."""


def experts_sorted(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
                   silu_and_mul: SiluAndMul = _silu_and_mul, linear: ExpertLinear = _dense_linear) -> torch.Tensor:
    """Tokens sorted by expert once; one pass over the active experts. x [T, H], weights/ids [T, k] -> [T, H].
    w13 / w2: stacked tensors, or whatever `linear` multiplies by (Int8Experts)."""
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)                                                # [T k]
    order = torch.argsort(flat_ids, stable=True)                              # (token, choice) pairs by expert
    token_idx = order // k                                                    # [T k]
    counts = torch.bincount(flat_ids).tolist()                                # rows per expert (to the last chosen)
    xs = x.index_select(0, token_idx)                                         # [T k, H]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = linear(w2, e, silu_and_mul(linear(w13, e, xs[start:start + n])))
            start += n
    out.mul_(weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token_idx, out)


IMPLS = ("sorted", "reference", "fused")


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(x, router_logits) -> [T, H] (summed across ranks).
    `method`: the decoder layers' linear method; when it is int8 the experts are quantized the same way."""

    supports_cuda_graphs = False
    """Every path reads which experts are active on the host (a sync per layer): not capturable in a graph."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp_rank: int = 0, tp_size: int = 1,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, impl: str | None = None,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 stacked_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj"),
                 method: LinearMethod | None = None):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp_size}")
        impl = impl or envs.moe_impl()
        if impl not in IMPLS:
            raise ValueError(f"MoE implementation must be one of {', '.join(IMPLS)}, got {impl!r}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size // tp_size                  # this rank's
        self.tp_rank, self.tp_size, self.reduce = tp_rank, tp_size, reduce
        self.impl = impl
        self.expert_names, self.stacked_names = expert_names, stacked_names
        self.int8_group = moe_fused.int8_group(method)
        if self.int8_group is not None:
            moe_fused.check_int8_group(self.int8_group, hidden_size, self.intermediate_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size),
                                requires_grad=False)                          # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size),
                               requires_grad=False)                           # [E, H, I]
        self.int8: tuple[Int8Experts, Int8Experts] | None = None
        """(w13, w2) as int8 codes and scales once loaded under --quantization int8 (w13 / w2 are then freed)."""
        self.fixed_point = envs.quant_fixed_point()
        """int8 experts on the fused path round one or two tokens' inputs to 16-bit fixed point (moe_fused.py)."""

    def process_weights_after_loading(self) -> None:
        if self.int8_group is None or self.int8 is not None:
            return
        self.int8 = (moe_fused.quantize_experts(self.w13, self.int8_group),
                     moe_fused.quantize_experts(self.w2, self.int8_group))
        # the codes and scales as attributes too, so weight_bytes counts them
        self.q13, self.s13 = self.int8[0].q, self.int8[0].scales
        self.q2, self.s2 = self.int8[1].q, self.int8[1].scales
        for name in ("w13", "w2"):  # the point of quantizing is the bytes (as drop_dense_weight)
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                silu_and_mul: SiluAndMul = _silu_and_mul, select: Router | None = None) -> torch.Tensor:
        """`select`: router logits -> (weights, expert ids) where the model routes otherwise than by softmax top-k
        (layers/moe_router.py: DeepSeek's grouped top-k)."""
        if select is None:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = select(router_logits)
        out = self._experts(x, weights, ids, silu_and_mul)
        return self.reduce(out) if self.reduce is not None else out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 silu_and_mul: SiluAndMul) -> torch.Tensor:
        if self.int8 is not None:
            w13, w2 = self.int8
            if self.impl == "fused" and moe_fused.takes(x, w13.q, self.top_k):
                return moe_fused.experts_fused(x, w13.q, w2.q, weights, ids, w13.scales, w2.scales, self.fixed_point)
            if self.impl == "reference":
                w13, w2 = w13.dequantized().to(x.dtype), w2.dequantized().to(x.dtype)
                return experts_reference(x, w13, w2, weights, ids, silu_and_mul)
            return experts_sorted(x, w13, w2, weights, ids, silu_and_mul, _int8_linear)
        if self.impl == "fused" and moe_fused.takes(x, self.w13, self.top_k):
            return moe_fused.experts_fused(x, self.w13, self.w2, weights, ids)
        if self.impl == "reference":
            return experts_reference(x, self.w13, self.w2, weights, ids, silu_and_mul)
        return experts_sorted(x, self.w13, self.w2, weights, ids, silu_and_mul)

    def expert_mapping(self) -> list[tuple[str, str, int | None, str]]:
        """The checkpoint tensors this layer loads from (expert_params_mapping), names relative to its block."""
        return expert_params_mapping(self.num_experts, self.expert_names, self.stacked_names)

    def weight_loader(self, name: str, loaded: torch.Tensor, expert_id: int | None, shard_id: str) -> None:
        """Copy this rank's part of checkpoint tensor `loaded` into parameter `name` ("w13" or "w2"): one
        expert's gate ("w1"), up ("w3") or down ("w2") projection, or (expert_id None) every expert's at once."""
        i, rank = self.intermediate_size, self.tp_rank
        rows, cols = loaded.dim() - 2, loaded.dim() - 1  # NOTE: a lazy 2-D checkpoint slice takes no negative dims
        dest = getattr(self, name).data
        if expert_id is not None:
            dest = dest[expert_id]
        if shard_id in ("w1", "w3"):           # [I_full, H]: this rank's rows into the gate or up half
            _copy(dest.narrow(-2, 0 if shard_id == "w1" else i, i), loaded.narrow(rows, rank * i, i))
        elif shard_id == "w13":                # [E, 2 I_full, H]: gate rows then up rows
            full = loaded.shape[rows] // 2
            for half in range(2):
                _copy(dest.narrow(-2, half * i, i), loaded.narrow(rows, half * full + rank * i, i))
        elif shard_id == "w2":                 # [H, I_full]: this rank's columns
            _copy(dest, loaded.narrow(cols, rank * i, i))
        else:
            raise ValueError(f"expert shard must be w1, w3, w13 or w2, got {shard_id!r}")

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate_size}, "
                f"renormalize={self.renormalize}, impl={self.impl}, tp={self.tp_rank}/{self.tp_size}"
                + ("" if self.int8_group is None else f", int8 group={self.int8_group}"))

